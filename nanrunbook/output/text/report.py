"""A bundle's verdict (``check``, ``seal``) and its rejection, in text.

A report fits one screen (:data:`SCREEN_LINES` at 80 columns); ``brief`` prints
at most six unwrapped lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.text._blocks import (
    brief_violations,
    fact_line,
    grid,
    indented,
    print_unwrapped,
    short_id,
    shorten_digests,
    show,
    show_violation,
)
from nanrunbook.output.text.checklist import sections_block
from nanrunbook.records import StageFinding, TensorFinding
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.wording import counts_phrase, number, shape_text

__all__ = ["SCREEN_LINES", "render_rejection", "render_report"]


def render_report(console: Any, report: Report, *, brief: bool, full_checklist: bool) -> None:
    if brief:
        print_unwrapped(console, _brief_lines(report))
        return
    for block in _report_blocks(console, report, full_checklist=full_checklist):
        show(console, block)


def render_rejection(console: Any, error: EvidenceRejected, bundle: str, *, brief: bool) -> None:
    from rich.text import Text

    count = len(error.violations)
    headline = Text.assemble(
        ("nanrunbook check: ", "bold"),
        ("REJECTED", "bold yellow"),
        f" - {count} violation{'s' if count != 1 else ''}; no decision is made on this evidence",
    )
    if brief:
        print_unwrapped(
            console, [headline, *brief_violations(error.violations), fact_line("bundle", bundle)]
        )
        return
    show(console, headline)
    show(console, grid([("bundle", Text(bundle))]))
    for violation in error.violations:
        show_violation(console, violation.code, violation.where, violation.message)


SCREEN_LINES = 40  # the report's height at 80 columns: one screen, no scrolling
_TENSORS_SHOWN = 5  # at most, of the earliest stage's tensors, before "N more"
_WARNINGS_SHOWN = 6  # at most, of the warnings, before "N more"
_ENTRY_LINES = 2  # a step of "Next steps" or a warning wraps to at most this many lines
_NUMERIC = ("elements", "nan", "+inf", "-inf", "max abs")


def _report_blocks(console: Any, report: Report, *, full_checklist: bool) -> list[Any]:
    """The report, block after block. The earliest stage's tensors and the warnings
    share the lines the other blocks leave of one screen (the first of each is
    always shown); when even that does not fit, the warnings and then, one by
    one, the steps take one line each. ``full_checklist`` prints every step in full, with the caps alone."""
    from rich.console import Group

    stage = _earliest_stage(report)
    head = [_verdict_block(report), _stage_table(report)]
    head.append(grid(_stage_notes(report, recovery=full_checklist or stage is None)))
    head.append(_probes_block(report) if stage is None else _earliest_heading(stage))

    def tensors(shown: int) -> Any:
        return Group() if stage is None else _earliest_tensors(report, stage, shown)

    total_tensors = 0 if stage is None else len(stage.tensors)
    caps = (min(total_tensors, _TENSORS_SHOWN), min(len(report.warnings), _WARNINGS_SHOWN))
    if full_checklist:
        heading = "Checklist (whole runbook: nanrunbook checklist)"
        steps = sections_block(report.checklist, heading=heading)
        return [*head, tensors(caps[0]), _warnings_block(console, report, caps[1]), steps]
    fixed = sum(_height(console, block) for block in head)
    # Crowded, the warnings and then, one by one, the steps take one line each.
    count = sum(len(section.steps) for section in report.checklist)
    modes = [(0, _ENTRY_LINES), *((cut, 1) for cut in range(count + 1))]
    for cut, warning_lines in modes:
        steps = _next_steps(console, report, cut)

        def warnings(shown: int, lines: int = warning_lines) -> Any:
            return _warnings_block(console, report, shown, lines=lines)

        room = SCREEN_LINES - fixed - _height(console, steps)
        shown = _fit(room, caps, lambda n: _height(console, tensors(n)),
                     lambda n: _height(console, warnings(n)))  # fmt: skip
        if _height(console, tensors(shown[0])) + _height(console, warnings(shown[1])) <= room:
            break
    return [*head, tensors(shown[0]), warnings(shown[1]), steps]


def _height(console: Any, renderable: Any) -> int:
    """Lines ``renderable`` takes at the console's width."""
    return len(console.render_lines(renderable, console.options, pad=False))


def _fit(
    room: int, caps: tuple[int, int], tensors: Callable[[int], int], warnings: Callable[[int], int]
) -> tuple[int, int]:
    """How many tensors and warnings fit in ``room`` lines, at most ``caps``: at least
    the first of each, then one more of each in turn while they fit."""
    shown = [min(1, caps[0]), min(1, caps[1])]
    heights = (tensors, warnings)
    grown = True
    while grown:
        grown = False
        for which in (0, 1):
            more = list(shown)
            more[which] += 1
            if more[which] <= caps[which] and heights[0](more[0]) + heights[1](more[1]) <= room:
                shown = more
                grown = True
    return shown[0], shown[1]


def _earliest_stage(report: Report) -> StageFinding | None:
    name = report.decision.earliest_nonfinite_stage
    return next((s for s in report.stages if s.stage == name), None)


def _verdict_facts(report: Report) -> list[tuple[str, str]]:
    decision = report.decision
    manifest = report.manifest
    stage = decision.earliest_nonfinite_stage
    facts = [("earliest non-finite stage", stage or "none: every captured element is finite")]
    if stage is not None:
        facts.append(("first non-finite tensor", _first_tensor(report)))
    run = f"{manifest.run_id} step {manifest.step}"
    if stage is None:  # a HOLD's next steps name the owner, as replay authority
        run += f", owner {manifest.incident_owner}"
    # The evidence id is named only when it says more than the run and step do.
    evidence = shorten_digests(manifest.evidence_content_id)
    if manifest.evidence_id != f"{manifest.run_id}.step-{manifest.step}":
        evidence = f"{manifest.evidence_id} {evidence}"
    alone = report.alone
    member = []
    if alone is not None:
        member = [
            (
                "incident set",
                f"rank {alone.rank} of {alone.world_size}: one member of a set, checked"
                f" alone ({alone.warning}); check the set instead:"
                f" nanrunbook check {alone.set_path}",
            )
        ]
    return [
        *facts,
        ("action", decision.action),
        ("root cause claim", decision.root_cause_claim),
        *member,
        ("bundle", report.bundle),
        ("run", run),
        ("evidence", evidence),
        ("contract", f"{report.contract_version} {short_id(report.contract_content_id)}"),
    ]


def _verdict_block(report: Report) -> Any:
    from rich.console import Group
    from rich.text import Text

    decision = report.decision.decision
    style = "bold red" if decision == HOLD else "bold green"
    headline = Text.assemble(("nanrunbook check: ", "bold"), (decision, style))
    return Group(headline, grid(_verdict_facts(report)))


def _brief_lines(report: Report) -> list[Any]:
    """Verdict, earliest stage, first tensor, action, warnings, bundle: six lines."""
    from rich.text import Text

    decision = report.decision
    style = "bold red" if decision.decision == HOLD else "bold green"
    lines = [
        Text.assemble(("nanrunbook check: ", "bold"), (decision.decision, style)),
        fact_line("earliest non-finite stage", decision.earliest_nonfinite_stage or "none"),
        fact_line("first non-finite tensor", _first_tensor(report)),
        fact_line("action", decision.action),
        fact_line("warnings", _warnings_count(report)),
        fact_line("bundle", report.bundle),
    ]
    return lines


def _warnings_count(report: Report) -> str:
    """``2 (AT_DTYPE_MAX, NEAR_DTYPE_MAX)``: how many, and which codes."""
    found = [w.code for w in report.warnings]
    if report.alone is not None:
        found.append(report.alone.warning)
    codes = ", ".join(dict.fromkeys(found))
    return f"{len(found)} ({codes})" if codes else "0"


def _first_tensor(report: Report) -> str:
    decision = report.decision
    if decision.earliest_nonfinite_stage is None:
        return "none"
    if decision.first_nonfinite_tensor is None:
        return "unknown (a summary stage has no per-tensor counts)"
    return decision.first_nonfinite_tensor


def _stage_dtypes(stage: StageFinding) -> str:
    """The stage's dtypes in capture order, each once (``F32,I64``); NOT_RUN when
    the stage did not run, as it then has no tensors."""
    return ",".join(dict.fromkeys(t.dtype for t in stage.record.tensors)) or stage.status


def _stage_table(report: Report) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, 1))  # its header row says what it is
    # On a narrow console words wrap; a number is never broken across lines (a
    # folded "160" would read as 16 and 0), it is cut with an ellipsis instead.
    for column in ("stage", "dtype"):
        table.add_column(column, overflow="fold")
    for column in _NUMERIC:
        table.add_column(column, justify="right", no_wrap=True, overflow="ellipsis")
    for stage in report.stages:
        counts = stage.counts
        numbers = (
            (counts.elements, counts.nan, counts.posinf, counts.neginf)
            if counts is not None
            else ("-",) * 4
        )
        magnitude = report.reported_magnitude(stage, stage.finite_max_abs)
        cells = [
            stage.stage,
            _stage_dtypes(stage),
            *(str(n) for n in numbers),
            "-" if magnitude is None else number(magnitude),
        ]
        style = "red" if counts is not None and counts.nonfinite else ""
        table.add_row(*(Text(c) for c in cells), style=style)
    return table


def _stage_notes(report: Report, *, recovery: bool) -> list[tuple[str, str]]:
    """What the table cannot say: counts not recounted, scaled magnitudes, why a
    stage did not run, the loss scale and, with ``recovery``, the recovery point
    (a HOLD's next steps name it)."""
    notes = [
        ("declared", f"{stage.stage}: counts of a summary, not recounted")
        for stage in report.stages
        if stage.counts_source == "declared"
    ]
    notes += [
        (stage.stage, f"gradients stored scaled: max abs divided by {report.scaler.scale:g}")
        for stage in report.stages
        if stage.record.gradients == "scaled" and stage.status == "OBSERVED"
    ]
    # Stages after the first that did not run usually share one reason: say it once.
    not_run: dict[str, list[str]] = {}
    for stage in report.stages:
        if stage.status == "NOT_RUN":
            not_run.setdefault(stage.record.reason or "", []).append(stage.stage)
    notes += [("not run", f"{', '.join(names)}: {reason}") for reason, names in not_run.items()]
    notes.append(("loss scale", _scaler_text(report)))
    learning_rate = _learning_rate_text(report)
    if learning_rate is not None:
        notes.append(("learning rate", learning_rate))
    if recovery:
        # The contract accepts a recovery point only when all five parts were verified together.
        lkg = report.manifest.last_known_good
        notes.append(("last known-good", f"{lkg.checkpoint_id} at step {lkg.step}, {_TOGETHER}"))
    return notes


_TOGETHER = "all five parts verified together"


def _learning_rate_text(report: Report) -> str | None:
    """The optimizer's learning rate as the bundle binds it (the sentinel records the
    first parameter group's), with the scheduler; None when the bundle has none."""
    details = report.manifest.binding.details
    optimizer = details.get("optimizer", {})
    lr = optimizer.get("lr")
    if not isinstance(lr, int | float) or isinstance(lr, bool):
        return None
    text = number(float(lr))
    groups = optimizer.get("param_groups")
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 1:
        text += f" (parameter group 0 of {groups})"
    scheduler = details.get("scheduler", {})
    kind = scheduler.get("class")
    if isinstance(kind, str) and kind != "none":
        epoch = scheduler.get("last_epoch")
        text += f", scheduler {kind}" + (f" at epoch {epoch}" if isinstance(epoch, int) else "")
    return text


def _scaler_text(report: Report) -> str:
    scaler = report.scaler
    if scaler.mode == "none":
        return "none (scale 1)"
    if scaler.mode == "static":
        return f"static, scale {scaler.scale:g}"
    line = (
        f"dynamic, scale {scaler.scale:g} -> {scaler.scale_after:g}, "
        f"found_inf {str(scaler.found_inf).lower()}"
    )
    if scaler.step_skipped:
        line += "; the update was skipped: evidence of overflow, not recovery"
    return line


def _tensor_facts(
    report: Report, stage: StageFinding, tensor: TensorFinding
) -> tuple[str, str | None]:
    """Counts, and the finite extremes (as reported: scaled gradients divided by the
    scale) when the tensor's data was read."""
    if tensor.counts is None:  # a summary: the header says why there are no counts
        return "", None
    counts = counts_phrase(tensor.counts)
    extremes = tensor.extremes
    if extremes is None or extremes.min is None or extremes.max is None:
        magnitude = report.reported_magnitude(stage, tensor.finite_max_abs)
        return (counts if magnitude is None else f"{counts}, max abs {number(magnitude)}"), None

    def shown(value: float) -> str:
        reported = report.reported_magnitude(stage, value)
        assert reported is not None
        return number(reported)

    line = f"finite {shown(extremes.min)}..{shown(extremes.max)}"
    if extremes.min_nonzero_abs is not None:
        line += f"; smallest non-zero |x| {shown(extremes.min_nonzero_abs)}"
    zeros = "zero" if extremes.zeros == 1 else "zeros"
    subnormals = "subnormal" if extremes.subnormals == 1 else "subnormals"
    line += f"; {extremes.zeros} {zeros}, {extremes.subnormals} {subnormals}"
    return counts, line


def _earliest_tensors(report: Report, stage: StageFinding, shown: int) -> Any:
    """The first ``shown`` of the stage's tensors, non-finite ones first (the first
    non-finite leads): name, dtype, shape and counts on a line, the extremes on the
    next; then how many more."""
    from rich.cells import cell_len
    from rich.console import Group
    from rich.text import Text

    ordered = sorted(stage.tensors, key=lambda t: not (t.counts is not None and t.counts.nonfinite))
    rows = ordered[:shown]
    names = max((cell_len(t.entry.name) for t in rows), default=0)
    dtypes = max((len(t.entry.dtype) for t in rows), default=0)
    shapes = max((len(shape_text(t.entry.shape)) for t in rows), default=0)
    lines = []
    for tensor in rows:
        entry = tensor.entry
        counts, extremes = _tensor_facts(report, stage, tensor)
        padding = " " * (names - cell_len(entry.name))
        cells = f"  {entry.dtype:<{dtypes}}  {shape_text(entry.shape):<{shapes}}  {counts}"
        lines.append(indented(Text.assemble(entry.name, padding, cells.rstrip()), 2))
        if extremes is not None:
            lines.append(indented(Text(extremes), 4))
    hidden = len(ordered) - len(rows)
    if hidden > 0:
        lines.append(indented(Text(f"... {hidden} more (all in --format json)"), 2))
    return Group(*lines)


def _earliest_heading(stage: StageFinding) -> Any:
    """The stage, its telemetry and where it was probed; its owner is named by the
    checklist's replay authority step."""
    from rich.console import Group
    from rich.text import Text

    record = stage.record
    heading = Text.assemble(
        (f"Earliest non-finite stage: {stage.stage}", "bold"),
        f" (telemetry {record.telemetry_id})",
    )
    return Group(heading, grid([("probe source", record.probe_source)]))


def _warnings_block(console: Any, report: Report, shown: int, *, lines: int = 0) -> Any:
    """The first ``shown`` early warnings, upstream stages first (their order in the
    report), each cut to ``lines`` lines (0: whole), then how many more."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    warnings = report.warnings
    alone = report.alone
    if not warnings:
        if alone is not None:
            return Text.assemble(("Warnings", "bold"), f": {alone.warning} (incident set, above)")
        return Text.assemble(("Warnings", "bold"), ": none")
    total = len(warnings) + (alone is not None)
    heading = Text(f"Warnings ({total}, upstream first)", style="bold")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="yellow")
    grid.add_column(overflow="fold")
    codes = max(len(w.code) for w in warnings[:shown]) if shown else 0
    if alone is not None:
        codes = max(codes, len(alone.warning))
        grid.add_row(alone.warning, "this bundle alone: see incident set, above")
    width = console.width - 2 - codes - 2  # indent, code, padding
    for warning in warnings[:shown]:
        tensor = warning.tensor or ""  # a bundle's warning always names its tensor
        where = Text.assemble((f"{warning.stage} ", "dim"), tensor, f": {warning.message}")
        grid.add_row(warning.code, _at_most(console, where, width, lines) if lines else where)
    hidden = len(warnings) - shown
    rest = [Text(f"... {hidden} more (all in --format json)")] if hidden > 0 else []
    return Group(heading, indented(Group(grid, *rest), 2))


def _probes_block(report: Report) -> Any:
    """On CONTINUE no stage is singled out: what was checked is where each boundary
    was probed."""
    from rich.console import Group
    from rich.text import Text

    probes = grid([(s.stage, s.record.probe_source) for s in report.stages])
    return Group(Text("Probes", style="bold"), probes)


_NEXT_STEPS = "Next steps (in full: --checklist; whole runbook: nanrunbook checklist)"


def _next_steps(console: Any, report: Report, cut: int) -> Any:
    """The checklist one step an entry: its title and the bundle's fact it refers to,
    wrapped to at most two lines; the first ``cut`` steps that wrap are cut to one."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    steps = [step for section in report.checklist for step in section.steps]
    digits = len(str(len(steps)))
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True, min_width=digits + 1)
    grid.add_column()
    width = console.width - 1 - (digits + 1) - 1  # indent, number, padding
    for number_, step in enumerate(steps, 1):
        fact = shorten_digests(step.fact or step.detail)
        text = Text.assemble((step.title, "bold"), f": {fact}")
        lines = _ENTRY_LINES
        if cut and len(text.wrap(console, max(width, 8))) > 1:
            cut, lines = cut - 1, 1
        grid.add_row(f"{number_}.", _at_most(console, text, width, lines))
    return Group(Text(_NEXT_STEPS, style="bold underline"), indented(grid, 1))


def _at_most(console: Any, text: Any, width: int, lines: int) -> Any:
    """``text`` wrapped to ``width``, cut to ``lines`` lines: the last is filled to the
    width, word or not, and ends in ``...`` when it was cut."""
    from rich.text import Text

    width = max(width, 8)
    wrapped = text.wrap(console, width)
    if len(wrapped) <= lines:
        return text
    kept = [line.copy() for line in wrapped[: lines - 1]]
    rest = text[sum(len(line.plain) for line in kept) :]
    rest = rest[len(rest.plain) - len(rest.plain.lstrip()) :]
    rest.truncate(width - 3)
    rest.rstrip()
    rest.append("...")
    return Text("\n").join([*kept, rest])

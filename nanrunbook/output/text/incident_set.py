"""An incident set's verdict, one row per rank (``check`` on a set, ``merge``), in text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import quote
from nanrunbook.output.text._blocks import (
    DECISION_STYLE,
    brief_violations,
    fact_line,
    grid,
    indented,
    print_unwrapped,
    shorten_digests,
    show,
    show_violation,
)
from nanrunbook.verdict.incident_set import REJECTED, IncidentSet, SetMember, rank_list

__all__ = ["render_incident_set"]


def render_incident_set(console: Any, result: IncidentSet, *, brief: bool) -> None:
    from rich.text import Text

    command = "nanrunbook check" if result.path is not None else "nanrunbook merge"
    headline = Text.assemble((f"{command}: ", "bold"), *_set_headline(result))
    if brief:
        print_unwrapped(console, [headline, *_brief_set_lines(result)])
        return
    show(console, headline)
    _run_directory_note(console, result)
    if result.decision == REJECTED:
        _print_set_rejection(console, result)
    else:
        show(console, grid(_set_facts(result)))
        show(console, Text("  The symptom's location is not its cause.", style="italic"))
    show(console)
    show(console, _rank_table(console, result))
    if result.nested_sets:
        show(console, Text(_nested_note(result), style="yellow"))
    if result.path is not None and result.members:
        command = f"nanrunbook check --format json {quote(result.path)}"
        show(console, Text(f"Every member's whole report: {command}"))
    if result.decision == HOLD:
        show(
            console,
            Text(
                "Containment: hold the update on every rank, preserve each rank's boundary,"
                " mark the last known-good state, choose replay authority; replay from the"
                " origin ranks (full runbook: nanrunbook checklist --stage"
                f" {result.earliest_nonfinite_stage})."
            ),
        )


_RUN_INCIDENTS_SHOWN = 10


def _run_directory_note(console: Any, result: IncidentSet) -> None:
    """A set that looks like a run directory (the sentinel's
    ``incident/<run>/<step>/``): the verdict stands, and the note says which
    incidents it holds, by step, and what to check instead."""
    from rich.text import Text

    incidents = result.run_incidents
    if not incidents:
        return
    several = len({i.step for i in incidents}) > 1
    kind = "incidents at different steps" if several else "single-rank incidents"
    note = (
        f"This looks like a run directory: its members are {kind} of run"
        f" {result.run_id}, each a whole answer on its own. The verdict here"
        " is the directory's, judged as one set (spec section 11). Check each"
        " incident instead:"
    )
    show(console, indented(Text(note, style="yellow"), 2))
    for incident in incidents[:_RUN_INCIDENTS_SHOWN]:
        step = "-" if incident.step is None else str(incident.step)
        line = f"step {step}  {incident.decision}  nanrunbook check {quote(incident.bundle)}"
        show(console, indented(Text(line), 4))
    hidden = len(incidents) - _RUN_INCIDENTS_SHOWN
    if hidden > 0:
        show(console, indented(Text(f"... {hidden} more (--format json: run_directory)"), 4))


_MISMATCHES = frozenset(
    {
        "SET_CONTRACT_MISMATCH",
        "SET_RUN_MISMATCH",
        "SET_STEP_MISMATCH",
        "SET_WORLD_SIZE_MISMATCH",
        "SET_RANK_DUPLICATE",
    }
)


def _quoted(name: str) -> str:
    return name if name.startswith(("'", '"')) else quote(name)


def _set_headline(result: IncidentSet) -> tuple[Any, ...]:
    where = (
        quote(result.path)
        if result.path is not None
        else f"merged from {len(result.merged_from)} report{'s' if len(result.merged_from) != 1 else ''}"
    )
    size = (
        f"world size {result.world_size}" if result.world_size is not None else "world size unknown"
    )
    if result.decision == REJECTED:
        count, members = len(result.violations), len(result.members)
        return (
            ("REJECTED", "bold yellow"),
            f" - incident set {where}, {members} member{'s' if members != 1 else ''}, {size}:"
            f" {count}"
            f" violation{'s' if count != 1 else ''}; no decision is made on this set",
        )
    style = DECISION_STYLE[result.decision]
    return (
        (result.decision, style),
        f" - incident set {where}, run {result.run_id} step {result.step}, {size}",
    )


def _brief_set_lines(result: IncidentSet) -> list[Any]:
    """Under the headline, five lines: the origin, stage, action and ranks, or up
    to four violations (codes and where) and the ranks."""
    facts = _set_facts(result)
    ranks = fact_line(*facts[4])
    if result.decision != REJECTED:
        return [*(fact_line(label, value) for label, value in facts[:4]), ranks]
    return [*brief_violations(result.violations), ranks]


def _set_facts(result: IncidentSet) -> list[tuple[str, str]]:
    origin = result.origin
    if result.origin_ranks:
        ranks = ", ".join(map(str, result.origin_ranks))
        origin += f": rank{'s' if len(result.origin_ranks) > 1 else ''} {ranks}"
    missing = rank_list(result.missing, listed=32)
    return [
        ("origin", origin),
        ("earliest non-finite stage", result.earliest_nonfinite_stage or "none"),
        ("action", result.action or "-"),
        ("root cause claim", result.root_cause_claim),
        (
            "ranks",
            f"{result.ranks_present} of {result.world_size} present, missing: {missing};"
            f" {result.rejected_members} rejected member{'s' if result.rejected_members != 1 else ''}",
        ),
        ("contract", f"{result.contract_version} {shorten_digests(result.contract_content_id)}"),
    ]


def _print_set_rejection(console: Any, result: IncidentSet) -> None:
    """Every violation; when the members do not form one set, what the directory
    holds instead, and the set's own violations only (the table shows each
    member's verdict, which does not matter until they form one set)."""
    from rich.text import Text

    split = any(v.code in _MISMATCHES for v in result.violations)
    if split:
        show(console, Text(_what_it_holds(result)))
    shown = [v for v in result.violations if not split or v.path is None]
    for violation in shown:
        show_violation(console, violation.code, violation.where, violation.message)
    hidden = len(result.violations) - len(shown)
    if hidden:
        show(
            console,
            Text(f"  and {hidden} violations of rejected members (--format json or kv lists them)"),
        )


def _first_five(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _nested_note(result: IncidentSet) -> str:
    """The subdirectories holding bundles one level down: this answer is not theirs."""
    names = result.nested_sets
    holds = "holds" if len(names) == 1 else "hold"
    return (
        f"Not judged: {_first_five(names)} {holds} bundles one level down, not members of this"
        " set (a member is a subdirectory with manifest.json); check each on its own."
    )


def _what_it_holds(result: IncidentSet) -> str:
    listed = _first_five([_quoted(m.name) for m in result.members])
    runs = {m.declared.run_id for m in result.members if m.declared.run_id is not None}
    steps = {m.declared.step for m in result.members if m.declared.step is not None}
    of = f"of {len(runs)} run{'s' if len(runs) != 1 else ''} and"
    of += f" {len(steps)} step{'s' if len(steps) != 1 else ''}"
    if result.path is None:
        return f"The merged reports are not of one incident set: {listed}, {of}"
    place = quote(result.path)
    return (
        f"{place} is not a bundle (it has no manifest.json) and not one incident set: it holds"
        f" bundles one level down: {listed}, {of}; judge each on its own:"
        f" nanrunbook check {quote(result.path.rstrip('/') or '/')}/*/"
    )


def _rank_table(console: Any, result: IncidentSet) -> Any:
    """One row per rank, in rank order: members, runs of missing ranks, then members
    that declare no rank. Columns are padded; the last, the first non-finite tensor
    or violation, ends the row where the row fits the console's width, and goes
    on a line of its own under its row (wrapped there) where it does not."""
    from rich.console import Group
    from rich.text import Text

    split = any(v.code in _MISMATCHES for v in result.violations)
    header = ["rank", "member", *(("run", "step") if split else ()), "decision", "earliest"]
    header += ["warnings", "first non-finite tensor, or first violation"]
    rows: list[list[str]] = []
    origin = set(result.origin_ranks)
    missing = list(result.missing)
    for member in sorted(result.members, key=lambda m: (m.rank is None, m.rank or 0, m.name)):
        while missing and member.rank is not None and missing[0].start < member.rank:
            rows.append(_missing_row(missing.pop(0), split))
        rows.append(_member_row(member, split, member.rank in origin))
    rows += [_missing_row(run, split) for run in missing]
    decision = header.index("decision")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    fixed = 2 + sum(width + 2 for width in widths)
    one_line = fixed + max(len(row[-1]) for row in [header, *rows]) <= console.width
    lines: list[Any] = [Text("Ranks", style="bold")]
    for index, row in enumerate([header, *rows]):
        style = "dim" if index == 0 else _ROW_STYLE.get(row[decision], "")
        cells = [f"{cell:<{width}}" for cell, width in zip(row, widths, strict=False)]
        if one_line:
            lines.append(Text("  " + "  ".join([*cells, row[-1]]).rstrip(), style=style))
            continue
        lines.append(Text("  " + "  ".join(cells).rstrip(), style=style))
        if row[-1] not in ("", "-"):
            lines.append(indented(Text(row[-1], style=style), 6))
    return Group(*lines)


_ROW_STYLE = {REJECTED: "yellow", HOLD: "red", "missing": "yellow"}


def _missing_row(run: range, split: bool) -> list[str]:
    rank = str(run.start) if len(run) == 1 else f"{run.start}-{run.stop - 1}"
    return [rank, "-", *(("-", "-") if split else ()), "missing", "-", "-", ""]


def _member_row(member: SetMember, split: bool, origin: bool) -> list[str]:
    declared = member.declared
    detail = member.first_nonfinite_tensor or "-"
    if member.decision == HOLD and member.first_nonfinite_tensor is None:
        detail = "unknown (summary stage)"
    if member.violations:
        first = member.violations[0]
        more = len(member.violations) - 1
        detail = f"{first.code} {first.where}" + (f" (and {more} more)" if more else "")
    if origin:
        detail += "  <- origin"
    cells = ["?" if member.rank is None else str(member.rank), member.name]
    if split:
        cells += [declared.run_id or "?", "?" if declared.step is None else str(declared.step)]
    stage = member.earliest_nonfinite_stage or "-"
    return [*cells, member.decision, stage, _warning_summary(member.warnings), detail]


def _warning_summary(codes: Sequence[str]) -> str:
    """Each warning code once, with how many times it fired: ``NEAR_DTYPE_MAX x2``."""
    counts: dict[str, int] = {}
    for code in codes:
        counts[code] = counts.get(code, 0) + 1
    shown = [code if n == 1 else f"{code} x{n}" for code, n in counts.items()]
    return ",".join(shown) or "-"

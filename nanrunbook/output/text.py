"""``--format text``: the on-call view, through rich.

Manifest strings are shown literally through ``rich.text.Text`` (never markup);
colour only on a terminal without NO_COLOR. rich is imported on first use, so
``kv`` and ``json`` never load it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.base import Renderer
from nanrunbook.records import StageFinding
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.diff import Comparison, ComparisonRejected, TensorDiff

__all__ = ["TextRenderer"]


def _magnitude(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


@functools.cache
def _verdict_console() -> Any:
    """rich's Console, except that a closed pipe raises BrokenPipeError: rich would
    exit 1, and the caller must keep the verdict's exit code. Built on first use so
    kv and json never import rich."""
    from rich.console import Console

    class VerdictConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return VerdictConsole


class TextRenderer(Renderer):
    """The on-call view, through rich; colour only on a terminal without NO_COLOR."""

    name = "text"

    def __init__(self, *, force_terminal: bool | None = None) -> None:
        self.force_terminal = force_terminal

    def _console(self, out: IO[str]) -> Any:
        # rich drops styles when ``out`` is not a terminal; NO_COLOR (any
        # non-empty value, no-color.org) turns off every escape sequence, bold
        # included. Soft wrapping keeps ids and messages whole in logs.
        plain = bool(os.environ.get("NO_COLOR"))
        return _verdict_console()(
            file=out,
            highlight=False,
            emoji=False,
            soft_wrap=True,
            force_terminal=self.force_terminal,
            color_system=None if plain else "auto",
        )

    def report(self, report: Report, out: IO[str]) -> None:
        from rich.table import Table
        from rich.text import Text

        console = self._console(out)
        decision = report.decision
        manifest = report.manifest
        style = "bold red" if decision.decision == HOLD else "bold green"
        console.print(Text.assemble(("nanrunbook check: ", "bold"), (decision.decision, style)))
        facts = [
            ("earliest non-finite stage", decision.earliest_nonfinite_stage or "none"),
            ("first non-finite tensor", _first_tensor(report)),
            ("action", decision.action),
            ("root cause claim", decision.root_cause_claim),
            ("run", f"{manifest.run_id} step {manifest.step}"),
            ("evidence", manifest.evidence_id),
            ("incident owner", manifest.incident_owner),
            ("evidence content id", manifest.evidence_content_id),
            ("contract", f"{report.contract_version} {report.contract_content_id}"),
        ]
        width = max(len(label) for label, _ in facts)
        for label, value in facts:
            console.print(Text.assemble((f"  {label:<{width}}  ", "dim"), value))
        console.print(Text("  The symptom's location is not its cause.", style="italic"))
        console.print()

        numeric = ("elements", "finite", "nan", "+inf", "-inf", "max abs")
        table = Table(title=Text("Stages"), title_justify="left", box=None, padding=(0, 1))
        for column in ("stage", "status", "counts", *numeric):
            table.add_column(column, justify="right" if column in numeric else "left", no_wrap=True)
        for stage in report.stages:
            counts = stage.counts
            values = (
                (counts.elements, counts.finite, counts.nan, counts.posinf, counts.neginf)
                if counts is not None
                else ("-",) * 5
            )
            cells = [
                stage.stage,
                stage.status,
                stage.counts_source or "-",
                *(str(v) for v in values),
                _magnitude(report.reported_magnitude(stage, stage.finite_max_abs)),
            ]
            row_style = "red" if counts is not None and counts.nonfinite else ""
            table.add_row(*(Text(c) for c in cells), style=row_style)
        console.print(table)
        for stage in report.stages:
            record = stage.record
            line = f"  {stage.stage}: owner {record.owner}, telemetry {record.telemetry_id}, "
            line += f"probe source: {record.probe_source}"
            console.print(Text(line))
            if record.status == "NOT_RUN":
                console.print(Text(f"    NOT_RUN: {record.reason or ''}"))
            elif stage.counts is not None and stage.counts.nonfinite:
                console.print(Text(f"    first non-finite tensor: {_stage_first_tensor(stage)}"))
            if record.gradients == "scaled":
                console.print(
                    Text(
                        f"    scaled gradients: magnitudes shown divided by the scale {report.scaler.scale:g}"
                    )
                )
        console.print(Text(_scaler_line(report)))
        lkg = manifest.last_known_good
        console.print(
            Text(
                f"last known-good: {lkg.checkpoint_id} at step {lkg.step} "
                f"({', '.join(lkg.verified_together)} verified together)"
            )
        )
        console.print()
        console.print(
            Text(
                "Containment: hold the update, preserve the boundary, mark the last known-good "
                "state, choose replay authority (full runbook: nanrunbook checklist)."
            )
        )
        replay = tuple(s for s in report.checklist if s.id.startswith("stage-") or s.id == "replay")
        _print_sections(console, replay, heading="Replay checklist")

    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        from rich.text import Text

        console = self._console(out)
        count = len(error.violations)
        console.print(
            Text.assemble(
                ("nanrunbook check: ", "bold"),
                ("REJECTED", "bold yellow"),
                f" - {count} violation{'s' if count != 1 else ''}; no decision is made on this evidence",
            )
        )
        for violation in error.violations:
            console.print(
                Text.assemble(
                    ("  " + violation.code, "yellow"), f" {violation.where}: {violation.message}"
                )
            )

    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        _print_sections(self._console(out), sections, heading="nanrunbook replay checklist")

    def contract(self, document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
        lines = [
            f"contract {document['contract_version']} for bundles {document['bundle_format']}",
            f"contract_content_id={content_id}",
            "stage order: " + " -> ".join(document["stage_order"]),
            "actions on HOLD (exit 1):",
            *(f"  {stage}: {action}" for stage, action in document["actions"].items()),
            f"CONTINUE_BOUNDED_DIAGNOSTICS (exit 0): {document['no_nonfinite_action']}",
            f"root cause claim: {document['root_cause_claim']}",
            "caps:",
            *(f"  {name}: {value}" for name, value in document["caps"].items()),
            "bounds:",
            *(f"  {name}: {value}" for name, value in document["bounds"].items()),
        ]
        out.write("\n".join(lines) + "\n")

    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        from rich.text import Text

        from nanrunbook.diff import ComparisonRejected

        console = self._console(out)
        if isinstance(result, ComparisonRejected):
            count = len(result.violations)
            console.print(
                Text.assemble(
                    ("nanrunbook diff: ", "bold"),
                    ("REJECTED", "bold yellow"),
                    f" - {' and '.join(result.sides)} rejected, {count} violation"
                    f"{'s' if count != 1 else ''}; no comparison is made",
                )
            )
            for violation in result.violations:
                console.print(
                    Text.assemble(
                        ("  " + violation.code, "yellow"),
                        f" {violation.where}: {violation.message}",
                    )
                )
            return
        _diff_heading(console, result)
        _diff_changes(console, result)
        _diff_divergence(console, result)
        _diff_stages(console, result)
        _diff_tensor_lists(console, result)


def _stage_first_tensor(stage: StageFinding) -> str:
    if stage.counts_source != "recounted":
        return "unknown (a summary has no per-tensor counts)"
    return stage.first_nonfinite_tensor or "-"


def _first_tensor(report: Report) -> str:
    decision = report.decision
    if decision.earliest_nonfinite_stage is None:
        return "none"
    if decision.first_nonfinite_tensor is None:
        return "unknown (summary stage has no per-tensor counts)"
    return decision.first_nonfinite_tensor


def _scaler_line(report: Report) -> str:
    scaler = report.scaler
    if scaler.mode == "none":
        return "loss scale: none (scale 1)"
    if scaler.mode == "static":
        return f"loss scale: static, scale {scaler.scale:g}"
    line = (
        f"loss scale: dynamic, scale {scaler.scale:g} -> {scaler.scale_after:g}, "
        f"found_inf {str(scaler.found_inf).lower()}"
    )
    if scaler.step_skipped:
        line += "; the update was skipped: evidence of overflow, not recovery"
    return line


def _print_sections(console: Any, sections: tuple[Section, ...], *, heading: str) -> None:
    from rich.text import Text

    console.print(Text(heading, style="bold underline"))
    number = 0
    for section in sections:
        console.print(Text(section.title, style="bold"))
        for step in section.steps:
            number += 1
            console.print(
                Text.assemble(f"  {number:>2}. ", (step.title, "bold"), f": {step.detail}")
            )


_DIFF_STYLE = {
    "REPRODUCED": "bold green",
    "ONE_MECHANISM_CHANGED": "bold green",
    "NOT_REPRODUCED": "bold red",
    "CONFOUNDED": "bold red",
}
_DIFF_MEANING = {
    "REPRODUCED": "no mechanism differs, and both answer the same",
    "NOT_REPRODUCED": "no mechanism differs, yet the answers differ: a nondeterministic or"
    " mis-captured replay",
    "ONE_MECHANISM_CHANGED": "exactly one mechanism differs: the change is attributable to it",
    "CONFOUNDED": "several mechanisms differ: no attribution is made; change one at a time",
}
_OUTCOME_MEANING = {
    "FIXED": "HOLD became CONTINUE",
    "BROKE": "CONTINUE became HOLD",
    "MOVED": "the earliest non-finite stage moved",
    "UNCHANGED": "the same decision at the same stage",
}
_LISTED = 10  # tensors listed by name in the text view; json lists them all


def _diff_heading(console: Any, result: Comparison) -> None:
    from rich.text import Text

    verdict = result.verdict
    head = Text.assemble(("nanrunbook diff: ", "bold"), (verdict, _DIFF_STYLE[verdict]))
    if result.outcome is not None:
        head.append(f" {result.changed[0]}: ")
        head.append(result.outcome, style="bold")
        head.append(f" ({_OUTCOME_MEANING[result.outcome]})")
    console.print(head)
    meaning = _DIFF_MEANING[verdict]
    if verdict == "REPRODUCED" and result.first_divergence is not None:
        meaning += ", though not bit for bit (see the first divergence)"
    if result.not_reproduced == "decision":
        meaning += " (the decision differs)"
    elif result.not_reproduced is not None:
        meaning += " (the earliest non-finite stage differs)"
    console.print(Text(f"  {meaning}"))
    for side, report in (("base", result.base), ("other", result.other)):
        decision = report.decision
        where = (
            f" at {decision.earliest_nonfinite_stage}" if decision.earliest_nonfinite_stage else ""
        )
        manifest = report.manifest
        console.print(
            Text.assemble(
                (f"  {side:<5}  ", "dim"),
                (f"{decision.decision}{where}", "red" if decision.decision == HOLD else "green"),
                f"  {manifest.run_id} step {manifest.step}  {manifest.evidence_content_id}",
            )
        )
    if not result.same_run or not result.same_step:
        what = "runs" if not result.same_run else "steps"
        console.print(
            Text(f"  note: the bundles are of different {what}: identities, not mechanisms")
        )


def _diff_changes(console: Any, result: Comparison) -> None:
    from rich.text import Text

    for change in result.changes:
        console.print(Text(f"Changed mechanism: {change.item}", style="bold"))
        width = max(len(field) for field in change.fields)
        for field in change.fields:
            old = change.base.get(field, "(absent)")
            new = change.other.get(field, "(absent)")
            console.print(Text(f"  {field:<{width}}  {old!s} -> {new!s}"))
    if not result.changes:
        console.print(Text("Changed mechanisms: none"))


def _tensor_line(tensor: TensorDiff) -> str:
    line = f"{tensor.name} ({tensor.base_stage})"
    if tensor.status == "dtype_differs":
        return f"{line}: dtype {tensor.base.dtype} -> {tensor.other.dtype}"
    if tensor.status == "shape_differs":
        return f"{line}: shape {list(tensor.base.shape)} -> {list(tensor.other.shape)}"
    delta = tensor.delta
    if delta is None:
        return f"{line}: {tensor.status}"
    line += f": {delta.differing} of {delta.elements} elements differ"
    if delta.max_abs_diff is not None:
        line += f", max abs diff {_figure(delta.max_abs_diff)}"
        line += f", max rel diff {_figure(delta.max_rel_diff)}"
    for label, count in (
        ("NaN appeared", delta.nan_appeared),
        ("NaN disappeared", delta.nan_disappeared),
        ("inf appeared", delta.inf_appeared),
        ("inf disappeared", delta.inf_disappeared),
    ):
        if count:
            line += f", {label} in {count}"
    return line


def _figure(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _diff_divergence(console: Any, result: Comparison) -> None:
    from rich.text import Text

    first = result.first_divergence
    if first is None:
        shown = "none: every tensor both hold is bit-identical"
        if any(t.status == "not_compared" for t in result.tensors):
            shown = "none among the tensors both hold with data (summaries are not compared)"
        console.print(Text(f"First divergence: {shown}"))
        return
    console.print(Text.assemble(("First divergence: ", "bold"), _tensor_line(first)))


def _diff_stages(console: Any, result: Comparison) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=Text("Stages, side by side"), title_justify="left", box=None, padding=(0, 1)
    )
    table.add_column("stage", no_wrap=True)
    # Two-line headers keep the table within 80 columns.
    for column in ("base\nnan/+inf/-inf", "other\nnan/+inf/-inf"):
        table.add_column(column, no_wrap=True)
    for column in ("tensors\nsame", "tensors\ndiffer", "only in\nbase", "only in\nother"):
        table.add_column(column, justify="right", no_wrap=True)
    for stage in result.stages:
        cells = [stage.stage, _stage_counts(stage.base), _stage_counts(stage.other)]
        cells += [str(stage.identical), str(stage.differing)]
        cells += [str(stage.base_only), str(stage.other_only)]
        nonfinite = any(
            f.counts is not None and f.counts.nonfinite for f in (stage.base, stage.other)
        )
        table.add_row(*(Text(c) for c in cells), style="red" if nonfinite else "")
    console.print(table)


def _stage_counts(finding: StageFinding) -> str:
    counts = finding.counts
    if counts is None:
        return finding.status
    return f"{counts.nan}/{counts.posinf}/{counts.neginf}"


def _diff_tensor_lists(console: Any, result: Comparison) -> None:
    from rich.text import Text

    differing = [t for t in result.tensors if t.differs]
    if len(differing) > 1:
        console.print(Text(f"Differing tensors ({len(differing)}):", style="bold"))
        for tensor in differing[:_LISTED]:
            console.print(Text(f"  {_tensor_line(tensor)}"))
        if len(differing) > _LISTED:
            console.print(Text(f"  and {len(differing) - _LISTED} more (--format json lists all)"))
    for side, tensors in (("base", result.base_only), ("other", result.other_only)):
        if not tensors:
            continue
        names = ", ".join(f"{t.name} ({t.stage})" for t in tensors[:_LISTED])
        more = f" and {len(tensors) - _LISTED} more" if len(tensors) > _LISTED else ""
        console.print(Text(f"Only in {side} ({len(tensors)}): {names}{more}"))
    console.print(Text("  The symptom's location is not its cause.", style="italic"))

"""Two bundles compared (``diff``), or the rejection of one side or both, in text.

The diff records import numpy: they are imported here only to type the
functions, and ``ComparisonRejected`` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanrunbook.contract import HOLD
from nanrunbook.output.text._blocks import grid, short_id, show, show_violation
from nanrunbook.records import StageFinding

if TYPE_CHECKING:
    from nanrunbook.diff import Comparison, ComparisonRejected, TensorDiff

__all__ = ["render_diff"]


def render_diff(console: Any, result: Comparison | ComparisonRejected) -> None:
    from rich.text import Text

    from nanrunbook.diff import ComparisonRejected

    if isinstance(result, ComparisonRejected):
        count = len(result.violations)
        show(
            console,
            Text.assemble(
                ("nanrunbook diff: ", "bold"),
                ("REJECTED", "bold yellow"),
                f" - {' and '.join(result.sides)} rejected, {count} violation"
                f"{'s' if count != 1 else ''}; no comparison is made",
            ),
        )
        for violation in result.violations:
            show_violation(console, violation.code, violation.where, violation.message)
        return
    if result.same_bundle:
        _diff_same_bundle(console, result)
        return
    _diff_heading(console, result)
    _diff_changes(console, result)
    _diff_divergence(console, result)
    _diff_stages(console, result)
    _diff_tensor_lists(console, result)


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


def _diff_same_bundle(console: Any, result: Comparison) -> None:
    """One directory on both sides: no replay was compared, so no verdict."""
    from rich.text import Text

    console.print(
        Text.assemble(
            ("nanrunbook diff: ", "bold"),
            ("SAME BUNDLE", "bold yellow"),
            " - base and other are one directory, one evidence",
        )
    )
    manifest = result.base.manifest
    console.print(f"  evidence  {short_id(manifest.evidence_content_id)} on both sides")
    console.print(
        f"  bundle    {manifest.run_id} step {manifest.step}, {result.base.decision.decision}"
    )
    console.print("  Nothing was compared (exit 2): give the original as BASE and the")
    console.print("  replay's bundle as OTHER.")


def _diff_heading(console: Any, result: Comparison) -> None:
    from rich.text import Text

    verdict = result.verdict
    head = Text.assemble(("nanrunbook diff: ", "bold"), (verdict, _DIFF_STYLE[verdict]))
    if result.outcome is not None:
        head.append(f" {result.changed[0]}: ")
        head.append(result.outcome, style="bold")
        head.append(f" ({_OUTCOME_MEANING[result.outcome]})")
    show(console, head)
    meaning = _DIFF_MEANING[verdict]
    if verdict == "REPRODUCED" and result.first_divergence is not None:
        meaning += ", though not bit for bit (see the first divergence)"
    if result.not_reproduced == "decision":
        meaning += " (the decision differs)"
    elif result.not_reproduced is not None:
        meaning += " (the earliest non-finite stage differs)"
    show(console, Text(f"  {meaning}"))
    for side, report in (("base", result.base), ("other", result.other)):
        decision = report.decision
        where = (
            f" at {decision.earliest_nonfinite_stage}" if decision.earliest_nonfinite_stage else ""
        )
        manifest = report.manifest
        show(
            console,
            Text.assemble(
                (f"  {side:<5}  ", "dim"),
                (f"{decision.decision}{where}", "red" if decision.decision == HOLD else "green"),
                f"  {manifest.run_id} step {manifest.step}  {short_id(manifest.evidence_content_id)}",
            ),
        )
    if result.same_evidence:
        console.print("  note: both sides are the same evidence (one content id): a replay")
        console.print("  that came out bit for bit, or a copy of BASE; the bundles cannot")
        console.print("  tell which")
    if not result.same_run or not result.same_step:
        what = "runs" if not result.same_run else "steps"
        show(
            console,
            Text(f"  note: the bundles are of different {what}: identities, not mechanisms"),
        )


def _diff_changes(console: Any, result: Comparison) -> None:
    from rich.text import Text

    for change in result.changes:
        show(console, Text(f"Changed mechanism: {change.item}", style="bold"))
        rows = []
        for field in change.fields:
            old = change.base.get(field, "(absent)")
            new = change.other.get(field, "(absent)")
            rows.append((field, f"{old!s} -> {new!s}"))
        show(console, grid(rows, label_style=""))
    if not result.changes:
        show(console, Text("Changed mechanisms: none"))


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
        show(console, Text(f"First divergence: {shown}"))
        return
    show(console, Text.assemble(("First divergence: ", "bold"), _tensor_line(first)))


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
    show(console, table)


def _stage_counts(finding: StageFinding) -> str:
    counts = finding.counts
    if counts is None:
        return finding.status
    return f"{counts.nan}/{counts.posinf}/{counts.neginf}"


def _diff_tensor_lists(console: Any, result: Comparison) -> None:
    from rich.text import Text

    differing = [t for t in result.tensors if t.differs]
    if len(differing) > 1:
        show(console, Text(f"Differing tensors ({len(differing)}):", style="bold"))
        for tensor in differing[:_LISTED]:
            show(console, Text(f"  {_tensor_line(tensor)}"))
        if len(differing) > _LISTED:
            show(console, Text(f"  and {len(differing) - _LISTED} more (--format json lists all)"))
    for side, tensors in (("base", result.base_only), ("other", result.other_only)):
        if not tensors:
            continue
        names = ", ".join(f"{t.name} ({t.stage})" for t in tensors[:_LISTED])
        more = f" and {len(tensors) - _LISTED} more" if len(tensors) > _LISTED else ""
        show(console, Text(f"Only in {side} ({len(tensors)}): {names}{more}"))
    show(console, Text("  The symptom's location is not its cause.", style="italic"))

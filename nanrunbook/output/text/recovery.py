"""A recovery point verified or not (``verify-recovery``) and a proof of recovery
(``prove``), in text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanrunbook.output.text._blocks import grid, indented, show, show_violation

if TYPE_CHECKING:
    from nanrunbook.capture.recovery import RecoveryRecord, RecoveryVerification

__all__ = ["render_recovery_record", "render_recovery_verification"]


def render_recovery_verification(console: Any, verification: RecoveryVerification) -> None:
    from rich.text import Text

    count = len(verification.violations)
    if verification.verified:
        headline = Text.assemble(
            ("nanrunbook verify-recovery: ", "bold"),
            ("VERIFIED", "bold green"),
            f" - step {verification.step}, every file as written",
        )
    else:
        headline = Text.assemble(
            ("nanrunbook verify-recovery: ", "bold"),
            ("REJECTED", "bold yellow"),
            f" - {count} violation{'s' if count != 1 else ''}; not a recovery point",
        )
    show(console, headline)
    rows: list[tuple[str, Any]] = [("point", Text(verification.path))]
    if verification.point_id is not None:
        rows.append(("id", Text(verification.point_id)))
    if verification.run_id is not None:
        rows.append(("run", Text(verification.run_id)))
    if verification.parts:
        shown = ", ".join(f"{part} {kind}" for part, kind in sorted(verification.parts.items()))
        rows.append(("parts", Text(shown)))
    if verification.files:
        size = f"{verification.files} files, {verification.total_bytes} bytes"
        torch_version = verification.torch_version or "?"
        rows.append(
            (
                "read",
                Text(f"{size}; torch {torch_version}, world size {verification.world_size}"),
            )
        )
    show(console, grid(rows))
    for violation in verification.violations:
        show_violation(console, violation.code, violation.where, violation.message)


def render_recovery_record(console: Any, record: RecoveryRecord) -> None:
    from rich.text import Text

    verdict = ("PROVEN", "bold green") if record.proven else ("NOT PROVEN", "bold red")
    change = record.change or "no change"
    after = sum(1 for n in record.steps_run if n > record.incident_step)
    ran = f"held at step {record.held_at}" if record.held_at is not None else f"then {after} steps"
    show(
        console,
        Text.assemble(
            ("nanrunbook prove: ", "bold"),
            verdict,
            f" - step {record.incident_step} with {change}, {ran}",
        ),
    )

    def trend(label: str, value: Any) -> str:
        loss = "-" if value.loss is None else f"{value.loss:.4g}"
        norm = "-" if value.grad_norm is None else f"{value.grad_norm:.4g}"
        return f"{label}: median loss {loss}, grad norm {norm} ({value.steps} steps)"

    diff = record.diff_verdict or "none"
    if record.diff_outcome:
        diff += f", {record.diff_outcome}"
    rows: list[tuple[str, Any]] = [
        ("point", Text(f"{record.point_id} (step {record.point_step})")),
        ("resumed", Text("bit for bit" if record.digests_match else "NOT the point's state")),
        ("held", Text("none" if record.held_at is None else f"at step {record.held_at}")),
        ("new bundle", Text(f"{record.new_decision or 'none'}; diff {diff}")),
        ("trend", Text(trend("before", record.before))),
        ("", Text(trend("from the incident", record.after))),
        ("warnings", Text(", ".join(f"{c} (step {s})" for s, c in record.warnings) or "none")),
        ("reopen", Text(f"a person's decision: {record.reopen_decided_by}")),
    ]
    show(console, grid(rows))
    for reason in record.reasons:
        show(console, indented(Text(f"not proven: {reason}"), 2))

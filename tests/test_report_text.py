"""The on-call text report (one screen, 80 columns, each fact once), ``check --brief``,
and the checklist that follows the verdict and names the bundle's evidence."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_support import OWNER, binding

from nanrunbook import EvidenceRejected, Report, Violation, check_bundle, report_document
from nanrunbook.capture import BundleWriter
from nanrunbook.contract import contract_content_id
from nanrunbook.manifest.parse import RECOVERY_PARTS
from nanrunbook.output.text import SCREEN_LINES, TextRenderer
from nanrunbook.records import Counts
from nanrunbook.verdict.runbook import SECTIONS, STAGE_STEPS, Section

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
ACCEPTED = sorted(name for name, e in EXPECTED.items() if e["exit"] in (0, 1))
CLI = [sys.executable, "-m", "nanrunbook"]


def run(*args: str, columns: str = "80") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": columns}
    env.pop("NO_COLOR", None)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


def render(report: Report, *, width: int = 80, brief: bool = False, checklist: bool = False) -> str:
    out = io.StringIO()
    TextRenderer(width=width, brief=brief, checklist=checklist).report(report, out)
    return out.getvalue()


def render_rejection(name: str, *, width: int = 80, brief: bool = False) -> str:
    with pytest.raises(EvidenceRejected) as caught:
        check_bundle(FIXTURES / name)
    out = io.StringIO()
    TextRenderer(width=width, brief=brief).rejection(
        caught.value, str(FIXTURES / name), contract_content_id(), out
    )
    return out.getvalue()


def writer_for(
    run_id: str, step: int, checkpoint: str, good_step: int, items: Any = None
) -> BundleWriter:
    """A writer for one test bundle: owner ml-oncall, every recovery part verified."""
    return BundleWriter(
        run_id=run_id,
        step=step,
        incident_owner="ml-oncall",
        binding=binding() if items is None else items,
        last_known_good={
            "checkpoint_id": checkpoint,
            "step": good_step,
            "verified_together": list(RECOVERY_PARTS),
        },
    )


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


# ---------------------------------------------------------------- 80 columns


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fixture_fits_80_columns_through_the_renderer(name: str) -> None:
    text = render(check_bundle(FIXTURES / name)) if name in ACCEPTED else render_rejection(name)
    assert widest(text) <= 80, text
    assert not any(line != line.rstrip() for line in text.splitlines()), "trailing spaces"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fixture_fits_80_columns_through_the_cli(name: str) -> None:
    done = run("check", str(FIXTURES / name))
    assert done.returncode == EXPECTED[name]["exit"], done.stderr
    assert widest(done.stdout) <= 80, done.stdout
    assert "\x1b[" not in done.stdout


@pytest.mark.parametrize("columns", ["100", "132"])
def test_the_report_wraps_to_a_wider_terminal(columns: str) -> None:
    bundle = str(FIXTURES / "hold-backward-dynamic-skip")
    wide = run("check", bundle, columns=columns).stdout
    assert widest(wide) <= int(columns)
    assert widest(wide) > 80  # a wider terminal gets longer lines
    assert len(wide.splitlines()) <= SCREEN_LINES
    # Without the screen's budget (--checklist), longer lines are fewer of them.
    narrow = run("check", "--checklist", bundle).stdout
    wide = run("check", "--checklist", bundle, columns=columns).stdout
    assert widest(wide) <= int(columns) and widest(wide) > 80
    assert len(wide.splitlines()) < len(narrow.splitlines())


def test_huge_counts_stay_whole_and_within_the_width(tmp_path: Path) -> None:
    """A number is never folded across lines (a folded 160 would read as 16 and 0)."""
    writer = writer_for("run-huge", 2, "ckpt-1", 1)
    elements = 2**31
    writer.summarize(
        "input",
        [("batch/huge", "F32", (elements,), "loader")],
        Counts(elements, 1, 715827882, 715827883, 715827882),
        owner=OWNER,
        probe_source="fused count",
        finite_max_abs=3.4028234663852886e38,
    )
    writer.not_run_rest(owner=OWNER, reason="aborted")
    text = render(check_bundle(writer.write(tmp_path / "b")))
    assert widest(text) <= 80
    row = next(line for line in text.splitlines() if line.startswith(" input "))
    assert row.split() == ["input", "F32", "2147483648", *["715827882", "715827883", "715827882"],
                           "3.40282e38"]  # fmt: skip


# ---------------------------------------------------------------- each fact once


def test_hold_report_says_each_fact_once_and_names_the_bundle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(FIXTURES)  # a short path, so its line does not wrap
    report = check_bundle("hold-backward-dynamic-skip")
    text = render(report)
    lines = text.splitlines()
    assert lines[0] == "nanrunbook check: HOLD"
    labelled = [line.split("  ")[1] for line in lines[1:12] if line.startswith("  ")]
    assert len(labelled) == len(set(labelled))
    assert sum(line.startswith("  first non-finite tensor ") for line in lines) == 1
    assert text.count("NONE_SYMPTOM_LOCATION_IS_NOT_CAUSALITY") == 1
    assert "The symptom's location is not its cause" not in text
    assert text.count("evidence of overflow, not recovery") == 1
    assert "  bundle                     hold-backward-dynamic-skip" in lines


def test_content_ids_are_short_in_text_and_whole_in_json_and_kv() -> None:
    report = check_bundle(FIXTURES / "hold-backward-dynamic-skip")
    evidence_id = report.manifest.evidence_content_id
    text = render(report)
    assert evidence_id not in text and report.contract_content_id not in text
    prefix, digest = evidence_id.split("sha256:")
    assert f"{prefix}sha256:{digest[:12]}..." in text
    bundle = str(FIXTURES / "hold-backward-dynamic-skip")
    assert f"evidence_content_id={evidence_id}" in run("check", "-f", "kv", bundle).stdout
    assert (
        json.loads(run("check", "-f", "json", bundle).stdout)["evidence_content_id"] == evidence_id
    )


def test_digests_in_rejection_messages_are_short_in_text() -> None:
    text = render_rejection("rejected-digests")
    assert not re.search(r"[0-9a-f]{13}", text)
    assert re.search(r"hashes to [0-9a-f]{12}\.\.\.", text)


def test_stage_table_has_a_dtype_column() -> None:
    text = render(check_bundle(FIXTURES / "hold-forward-bf16"))
    header = next(line for line in text.splitlines() if line.lstrip().startswith("stage "))
    assert header.split() == ["stage", "dtype", "elements", "nan", "+inf", "-inf", "max", "abs"]
    table = text[text.index(header) : text.index("  not run ")].splitlines()[1:]
    rows = {line.split()[0]: line.split() for line in table}
    assert list(rows) == ["input", "forward", "loss", "backward", "optimizer"]
    assert rows["input"] == ["input", "F32,I64", "72", "0", "0", "0", "2"]
    assert rows["forward"][:6] == ["forward", "BF16", "160", "1", "1", "0"]
    assert rows["loss"] == ["loss", "NOT_RUN", "-", "-", "-", "-", "-"]
    assert "  not run        loss, backward, optimizer: " in text


def test_declared_counts_are_marked() -> None:
    text = render(check_bundle(FIXTURES / "hold-optimizer-summary"))
    assert "  declared       optimizer: counts of a summary, not recounted" in text


# ---------------------------------------------------------------- the earliest stage


def _wide_stage_bundle(tmp_path: Path) -> Path:
    """A forward stage of eight tensors, the third and sixth non-finite, and an F16
    activation at exactly F16's largest finite value in the stage before."""
    writer = writer_for("run-wide", 7, "ckpt-5", 5)
    batch = np.array([1.0, 65504.0, -3.0, 0.0], dtype="float16")
    writer.observe("input", [("batch/x", batch, "p")], owner=OWNER, probe_source="loader")
    acts = []
    for index in range(8):
        value = np.full(4, float(index + 1), dtype="float32")
        if index in (2, 5):
            value[1] = np.nan if index == 2 else np.inf
        acts.append((f"act/block.{index}", value, "hook"))
    writer.observe("forward", acts, owner="modeling-oncall", probe_source="hooks")
    writer.not_run_rest(owner=OWNER, reason="aborted after a non-finite activation")
    return writer.write(tmp_path / "bundle")


def test_earliest_stage_lists_its_tensors_first_nonfinite_first_capped(tmp_path: Path) -> None:
    report = check_bundle(_wide_stage_bundle(tmp_path))
    # In full (--checklist) the cap is five tensors; on one screen, what fits.
    for text, shown in ((render(report, checklist=True), 5), (render(report), None)):
        section = text[text.index("Earliest non-finite stage: forward") : text.index("Warnings")]
        names = re.findall(r"^  (act/block\.\d)\s", section, re.MULTILINE)
        order = ["act/block.2", "act/block.5", "act/block.0", "act/block.1", "act/block.3"]
        assert names == order[: shown or len(names)] and len(names) >= 1
        assert f"  ... {8 - len(names)} more (all in --format json)" in section.splitlines()
        rows = section.splitlines()
        at = next(i for i, line in enumerate(rows) if line.startswith("  act/block.2 "))
        assert rows[at].split() == ["act/block.2", "F32", "4", "1", "NaN", "of", "4", "elements"]
        # Its extremes, exact from the data, on the line under the counts.
        assert rows[at + 1] == "    finite 3..3; smallest non-zero |x| 3; 0 zeros, 0 subnormals"
        assert section.startswith("Earliest non-finite stage: forward (telemetry ")
        # The stage's owner is named once, by the replay authority step.
        assert text.count("modeling-oncall") == 1
        assert len(text.splitlines()) <= SCREEN_LINES or shown
    assert "Choose replay authority: ml-oncall, with modeling-oncall (forward)" in render(report)


def test_summary_stage_lists_tensors_without_counts() -> None:
    text = render(check_bundle(FIXTURES / "hold-optimizer-summary"))
    section = text[text.index("Earliest non-finite stage") : text.index("Next steps")]
    assert "  opt/layers.0.weight.exp_avg_sq  F32  16x8" in section.splitlines()
    assert "unknown (a summary stage has no per-tensor counts)" in text


def test_continue_shows_every_probe_and_no_earliest_stage() -> None:
    text = render(check_bundle(FIXTURES / "continue-all-finite"))
    assert "none: every captured element is finite" in text
    assert "first non-finite tensor" not in text
    assert "Earliest non-finite stage" not in text
    probes = text[text.index("Probes") : text.index("Next steps")]
    assert "  backward   after scaler.unscale_(optimizer)" in probes.splitlines()


# ---------------------------------------------------------------- --brief


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_brief_is_at_most_six_lines(name: str) -> None:
    done = run("check", "--brief", str(FIXTURES / name), columns="40")
    expected = EXPECTED[name]
    assert done.returncode == expected["exit"]
    lines = done.stdout.splitlines()
    assert 1 <= len(lines) <= 6, done.stdout
    assert lines[-1] == f"  {'bundle':<25}  {FIXTURES / name}"
    if expected["exit"] == 3:
        assert lines[0].startswith("nanrunbook check: REJECTED")
        return
    stage = expected["earliest_nonfinite_stage"] or "none"
    assert f"  earliest non-finite stage  {stage}" in lines
    first = expected["first_nonfinite_tensor"] or ("none" if stage == "none" else "unknown")
    assert any(line.startswith(f"  first non-finite tensor    {first}") for line in lines)
    assert any(line.startswith("  action                     ") for line in lines)


def test_brief_refuses_other_formats() -> None:
    done = run("check", "--brief", "--format", "kv", str(FIXTURES / "hold-loss"))
    assert done.returncode == 2
    assert done.stdout == ""
    assert "--brief" in done.stderr and "Traceback" not in done.stderr


def test_brief_rejection_keeps_six_lines_with_many_violations() -> None:
    error = EvidenceRejected([Violation(f"CODE_{i}", f"$.stages[{i}]", "m") for i in range(7)])
    out = io.StringIO()
    TextRenderer(brief=True).rejection(error, "b", contract_content_id(), out)
    assert out.getvalue().splitlines() == [
        "nanrunbook check: REJECTED - 7 violations; no decision is made on this evidence",
        "  CODE_0 $.stages[0]",
        "  CODE_1 $.stages[1]",
        "  CODE_2 $.stages[2]",
        "  ... 4 more (without --brief)",
        f"  {'bundle':<25}  b",
    ]


# ---------------------------------------------------------------- the checklist


def _steps(report: Report) -> dict[str, str]:
    return {step.id: step.detail for section in report.checklist for step in section.steps}


def _checklist_text(sections: tuple[Section, ...]) -> str:
    return "\n".join(f"{s.title}: {s.detail}" for section in sections for s in section.steps)


def test_checklist_differs_for_every_verdict_and_stage() -> None:
    texts = {name: _checklist_text(check_bundle(FIXTURES / name).checklist) for name in ACCEPTED}
    assert len(set(texts.values())) == len(ACCEPTED)
    section_ids = {
        name: [s.id for s in check_bundle(FIXTURES / name).checklist] for name in ACCEPTED
    }
    for name in ACCEPTED:
        stage = EXPECTED[name]["earliest_nonfinite_stage"]
        if stage is None:
            assert section_ids[name] == ["bounded-diagnostics"]
        else:
            assert section_ids[name] == [f"stage-{stage}", "containment", "replay"]


@pytest.mark.parametrize("name", ACCEPTED)
def test_checklist_names_this_bundles_evidence(name: str) -> None:
    report = check_bundle(FIXTURES / name)
    expected = EXPECTED[name]
    steps = _steps(report)
    text = _checklist_text(report.checklist)
    lkg = report.manifest.last_known_good
    if expected["earliest_nonfinite_stage"] is None:
        assert "hold the update" not in text.lower()
        assert "bounded" in text.lower()
        assert f"step {report.manifest.step}" in steps["read-continue"]
        assert "681 elements" in steps["read-continue"]
        assert "act/logits (forward, F32) reached 4" in steps["look-at-warnings"]
        return
    stage = expected["earliest_nonfinite_stage"]
    first_section = report.checklist[0]
    assert first_section.title == STAGE_STEPS[stage].title
    first = expected["first_nonfinite_tensor"]
    assert (first or f"in the {stage} summary (no per-tensor counts)") in first_section.steps[
        0
    ].detail
    assert lkg.checkpoint_id in steps["mark-last-known-good"]
    assert f"{report.manifest.step - lkg.step} steps back" in steps["mark-last-known-good"]
    assert report.manifest.incident_owner in steps["choose-replay-authority"]
    assert "Hold the update" in text
    if stage == "input":
        assert "inspect-upstream-extremes" not in steps
        assert "reproduce-without-update" not in steps
        assert "nothing upstream" in steps["trace-preprocessing"]
        assert "data-synthetic-v1" in steps["validate-batch"]
        assert "cursor-epoch3-pos1842" in steps["reload-samples"]
    else:
        assert lkg.checkpoint_id in steps["reproduce-without-update"]
        assert (first or stage) in steps["reproduce-without-update"]
        compute = report.manifest.binding.compute_dtype
        limit = "F32's max" if compute == "F32" else f"{compute}'s max \\(the compute dtype\\)"
        assert re.search(rf"\(\w+, F32\) reached [\d.]+, [\d.]+ bits below {limit}, \w+ stages? "
                         r"before the first non-finite (tensor|stage)",
                         steps["inspect-upstream-extremes"])  # fmt: skip


def test_backward_checklist_names_the_scale_transition() -> None:
    steps = _steps(check_bundle(FIXTURES / "hold-backward-dynamic-skip"))
    assert steps["loss-scaling"].startswith(
        "The scale went 65536 -> 32768 (found_inf true) and the update was skipped"
    )
    assert "probed scaled: unscale before any threshold" in steps["loss-scaling"]
    assert steps["hold-the-update"].startswith("The scaler skipped optimizer.step() at step 1842")
    assert "F32 instead of F16 autocast, a lower scale than 65536" in steps["change-one-mechanism"]


def test_checklist_names_an_extreme_at_the_dtype_limit(tmp_path: Path) -> None:
    steps = _steps(check_bundle(_wide_stage_bundle(tmp_path)))
    assert steps["inspect-upstream-extremes"] == (
        "batch/x (input, F16) reached 65504, exactly F16's largest finite value, "
        "one stage before the first non-finite tensor. "
        "Warnings upstream: AT_DTYPE_MAX at batch/x (input)."
    )


def test_checklist_headroom_in_bits(tmp_path: Path) -> None:
    writer = writer_for("run-near", 3, "ckpt-1", 1)
    writer.observe(
        "input", [("batch/x", np.ones(2, dtype="float32"), "p")], owner=OWNER, probe_source="l"
    )
    near = np.array([61000.0, 1.0], dtype="float16")
    writer.observe("forward", [("act/encoder.4", near, "h")], owner=OWNER, probe_source="h")
    writer.observe(
        "loss", [("loss", np.array(np.inf, dtype="float32"), "l")], owner=OWNER, probe_source="l"
    )
    writer.not_run_rest(owner=OWNER, reason="aborted")
    steps = _steps(check_bundle(writer.write(tmp_path / "b")))
    bits = np.log2(65504 / float(np.float16(61000.0)))
    assert steps["inspect-upstream-extremes"] == (
        f"act/encoder.4 (forward, F16) reached {float(np.float16(61000.0)):g}, "
        f"{bits:.1f} bits below F16's max, one stage before the first non-finite tensor. "
        "Warnings upstream: NEAR_DTYPE_MAX at act/encoder.4 (forward)."
    )


def test_the_report_shows_the_checklist_it_carries() -> None:
    report = check_bundle(FIXTURES / "hold-loss")
    flat = " ".join(render(report, checklist=True).split())
    for number, step in enumerate((s for sec in report.checklist for s in sec.steps), 1):
        assert f"{number}. {step.title}: {' '.join(step.detail.split())}" in flat
    assert report_document(report)["checklist"][0]["id"] == "stage-loss"
    # On one screen, each step is its title and the bundle's fact, in at most two lines.
    text = render(report)
    steps = text[text.index("Next steps") :].splitlines()[1:]
    flat = " ".join(" ".join(steps).split())
    for number, step in enumerate((s for sec in report.checklist for s in sec.steps), 1):
        assert step.fact and f"{number}. {step.title}: {' '.join(step.fact.split())}" in flat
    assert len(steps) <= 2 * number


def test_checklist_command_alone_is_still_the_whole_runbook() -> None:
    lines = run("checklist", "--format", "kv").stdout.splitlines()
    whole = [f"step={sec.id}/{step.id}" for sec in SECTIONS for step in sec.steps]
    assert lines == [f"steps={len(whole)}", *whole]
    assert "step=containment/hold-the-update" in lines
    assert "step=bounded-diagnostics/read-continue" in lines


# ---------------------------------------------------------------- warnings


def _warned_writer(*, nonfinite_gradient: bool = False) -> BundleWriter:
    """Three warnings upstream to downstream: the F32 batch near the compute dtype
    F16's max, a saturated F16 activation, mostly-zero F16 gradients. All finite
    (CONTINUE), or with a second, infinite gradient (HOLD at backward)."""
    bound = binding()
    bound["precision"] = {"id": "fp16", "param_dtype": "F32", "compute_dtype": "F16"}
    writer = writer_for("run-warned", 4, "ckpt-3", 3, items=bound)
    batch = np.array([40000.0, 1.0], dtype="float32")
    writer.observe("input", [("batch/x", batch, "p")], owner=OWNER, probe_source="loader")
    acts = [
        ("act/a", np.array([1.0, 2.0], dtype="float16"), "h"),
        ("act/b", np.array([65504.0, -3.0], dtype="float16"), "h"),
    ]
    writer.observe("forward", acts, owner=OWNER, probe_source="hooks")
    loss = np.array(0.5, dtype="float32")
    writer.observe("loss", [("loss", loss, "l")], owner=OWNER, probe_source="loss")
    grads = [("grad/w", np.array([0, 0, 0, 0, 0, 0, 0.5, 0.25], dtype="float16"), "g")]
    if nonfinite_gradient:
        grads.append(("grad/v", np.array([np.inf, 1.0], dtype="float16"), "g"))
    writer.observe("backward", grads, owner=OWNER, probe_source="g", gradients="unscaled")
    if nonfinite_gradient:
        writer.not_run_rest(owner=OWNER, reason="non-finite gradient")
    else:
        step = np.array([0.1, 0.2], dtype="float32")
        writer.observe("optimizer", [("opt/u", step, "o")], owner=OWNER, probe_source="opt")
    return writer


WARNED_KV = [
    "warnings=3",
    "warning=NEAR_DTYPE_MAX input#0",
    "warning=AT_DTYPE_MAX forward#1",
    "warning=GRADIENT_UNDERFLOW backward#0",
]


def test_warnings_get_their_own_section_upstream_first(tmp_path: Path) -> None:
    report = check_bundle(_warned_writer().write(tmp_path / "b"))
    assert report.decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"
    text = render(report)
    assert widest(text) <= 80
    section = text[text.index("Warnings (3, upstream first)") : text.index("Next steps")]
    starts = [line.split()[:3] for line in section.splitlines()[1:] if line.startswith("  ")]
    starts = [s for s in starts if s[0].isupper()]
    assert starts == [
        ["NEAR_DTYPE_MAX", "input", "batch/x:"],
        ["AT_DTYPE_MAX", "forward", "act/b:"],
        ["GRADIENT_UNDERFLOW", "backward", "grad/w:"],
    ]
    assert "Warnings: none" in render(check_bundle(FIXTURES / "continue-all-finite"))


def test_warnings_section_is_capped(tmp_path: Path) -> None:
    writer = writer_for("run-many", 4, "ckpt-3", 3)
    saturated = [(f"act/{i}", np.array([65504.0], dtype="float16"), "h") for i in range(8)]
    saturated.append(("act/nan", np.array([np.nan], dtype="float16"), "h"))
    writer.observe("input", [("batch/x", np.ones(2, "float32"), "p")], owner=OWNER,
                   probe_source="l")  # fmt: skip
    writer.observe("forward", saturated, owner=OWNER, probe_source="h")
    writer.not_run_rest(owner=OWNER, reason="stopped by hand")
    report = check_bundle(writer.write(tmp_path / "b"))
    text = render(report, checklist=True)
    section = text[text.index("Warnings (8, upstream first)") : text.index("Checklist")]
    assert section.count("AT_DTYPE_MAX") == 6
    assert "  ... 2 more (all in --format json)" in section.splitlines()
    # On one screen, as many as fit, and how many more.
    text = render(report)
    assert len(text.splitlines()) <= SCREEN_LINES
    section = text[text.index("Warnings (8, upstream first)") : text.index("Next steps")]
    shown = section.count("AT_DTYPE_MAX")
    assert 1 <= shown < 8
    assert f"  ... {8 - shown} more (all in --format json)" in section.splitlines()


def test_kv_appends_the_warnings_after_the_spec_lines(tmp_path: Path) -> None:
    bundle = _warned_writer().write(tmp_path / "b")
    lines = run("check", "-f", "kv", str(bundle)).stdout.splitlines()
    assert [line.split("=")[0] for line in lines[:10]] == [
        "contract_version", "contract_content_id", "run", "step", "evidence_id",
        "evidence_content_id", "earliest_nonfinite", "decision", "action", "root_cause_claim",
    ]  # fmt: skip
    assert lines[10:] == WARNED_KV
    kv_fixture = run("check", "-f", "kv", str(FIXTURES / "hold-loss")).stdout.splitlines()
    assert kv_fixture[10:] == ["warnings=0"]


def test_brief_counts_the_warnings(tmp_path: Path) -> None:
    bundle = _warned_writer().write(tmp_path / "b")
    lines = run("check", "--brief", str(bundle)).stdout.splitlines()
    assert len(lines) == 6
    assert (
        lines[4]
        == "  warnings                   3 (NEAR_DTYPE_MAX, AT_DTYPE_MAX, GRADIENT_UNDERFLOW)"
    )
    brief = run("check", "--brief", str(FIXTURES / "hold-loss")).stdout.splitlines()
    assert brief[4] == "  warnings                   0"


def test_fail_on_warnings_is_exit_5_only_for_a_continue_with_warnings(tmp_path: Path) -> None:
    warned = str(_warned_writer().write(tmp_path / "b"))
    assert run("check", "-f", "kv", warned).returncode == 0
    assert run("check", "-f", "kv", "--fail-on-warnings", warned).returncode == 5
    assert run("check", "--fail-on-warnings", warned).returncode == 5
    clean = str(FIXTURES / "continue-all-finite")
    assert run("check", "-f", "kv", "--fail-on-warnings", clean).returncode == 0
    # A HOLD with a warning stays 1; a rejection stays 3.
    hold = str(FIXTURES / "hold-backward-dynamic-skip")
    assert "warnings=1" in run("check", "-f", "kv", hold).stdout
    assert run("check", "-f", "kv", "--fail-on-warnings", hold).returncode == 1
    rejected = str(FIXTURES / "rejected-caps")
    assert run("check", "-f", "kv", "--fail-on-warnings", rejected).returncode == 3
    # The JSON report's exit_code stays the verdict's.
    document = json.loads(run("check", "-f", "json", "--fail-on-warnings", warned).stdout)
    assert (document["decision"], document["exit_code"]) == ("CONTINUE_BOUNDED_DIAGNOSTICS", 0)


def test_threshold_options_change_which_warnings_fire(tmp_path: Path) -> None:
    warned = str(_warned_writer().write(tmp_path / "b"))

    def warnings(*options: str) -> list[str]:
        done = run("check", "-f", "kv", *options, warned)
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if line.startswith("warning=")]

    assert warnings() == WARNED_KV[1:]
    assert warnings("--near-max-bits", "0.5") == WARNED_KV[2:]  # 0.71 bits of headroom
    assert warnings("--near-max-bits", "0") == WARNED_KV[2:]
    assert warnings("--underflow-share", "0.75") == WARNED_KV[1:3]  # exactly 6 of 8 zero
    assert warnings("--underflow-share", "0.7") == WARNED_KV[1:]
    assert warnings("--underflow-dtypes", "BF16,F8_E4M3") == WARNED_KV[1:3]
    assert warnings("--underflow-dtypes", " F16 ") == WARNED_KV[1:]


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--near-max-bits", "x", "'x' is not a number"),
        ("--near-max-bits", "inf", "'inf' is not a finite number"),
        ("--near-max-bits", "-1", "near_max_bits must be finite and >= 0"),
        ("--underflow-share", "1.5", "underflow_share must be within [0, 1]"),
        ("--underflow-dtypes", "F16,I32", "not floating dtypes: I32"),
    ],
)
def test_a_threshold_out_of_range_is_a_usage_error(option: str, value: str, reason: str) -> None:
    done = run("check", option, value, str(FIXTURES / "hold-loss"))
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"'{option}'" in done.stderr and reason in done.stderr
    assert "Traceback" not in done.stderr


def test_continue_checklist_lists_the_warnings_to_look_at(tmp_path: Path) -> None:
    steps = _steps(check_bundle(_warned_writer().write(tmp_path / "b")))
    assert steps["look-at-warnings"] == (
        "3 warnings, upstream first: NEAR_DTYPE_MAX at batch/x (input); AT_DTYPE_MAX at "
        "act/b (forward); GRADIENT_UNDERFLOW at grad/w (backward)."
    )
    assert "hold-the-update" not in steps


def test_hold_checklist_names_warnings_upstream_and_at_the_stage(tmp_path: Path) -> None:
    steps = _steps(check_bundle(_wide_stage_bundle(tmp_path)))
    assert steps["inspect-upstream-extremes"].endswith(
        " Warnings upstream: AT_DTYPE_MAX at batch/x (input)."
    )
    # HOLD at backward, where the mostly-zero gradient's warning is.
    report = check_bundle(_warned_writer(nonfinite_gradient=True).write(tmp_path / "hold"))
    assert report.decision.earliest_nonfinite_stage == "backward"
    steps = _steps(report)
    assert steps["gradient-path"].endswith(
        " Warnings here: GRADIENT_UNDERFLOW at grad/w (backward)."
    )
    assert steps["inspect-upstream-extremes"].endswith(
        " Warnings upstream: NEAR_DTYPE_MAX at batch/x (input); AT_DTYPE_MAX at act/b (forward)."
    )


# ---------------------------------------------------------------- one screen


def _crowded_bundle(tmp_path: Path) -> Path:
    """A HOLD at backward as crowded as a real one: fp16 autocast, a dynamic scale that
    backed off and skipped the step, gradients stored scaled, 40 gradients of
    transformer-length names (three non-finite), 12 saturated F16 activations, a batch
    beyond F16 and mostly-zero gradients: 14 or more warnings."""
    bound = binding()
    bound["precision"] = {"id": "fp16", "param_dtype": "F32", "compute_dtype": "F16"}
    bound["scaler"] = {
        "id": "gradscaler", "mode": "dynamic", "scale": 65536, "growth_factor": 2.0,
        "backoff_factor": 0.5, "found_inf": True, "step_skipped": True, "scale_after": 32768,
    }  # fmt: skip
    writer = writer_for(
        "run-2026-11-30-llm-pretrain-017", 120345, "ckpt-step-120000", 120000, items=bound
    )
    batch = np.array([70354.1, 1.0, -2.0, 0.5], dtype="float32")
    writer.observe("input", [("batch/input_embeds", batch, "p")], owner="data-oncall",
                   probe_source="DataLoader batch before .to(device)")  # fmt: skip
    acts = [
        (f"act/model.layers.{i}.mlp.down_proj", np.array([65504.0, -3.0], dtype="float16"), "h")
        for i in range(12)
    ]
    writer.observe("forward", acts, owner="modeling-oncall", probe_source="forward hooks")
    loss = np.array(2.5, dtype="float32")
    writer.observe("loss", [("loss", loss, "l")], owner=OWNER, probe_source="loss")
    grads = []
    for i in range(40):
        value = np.array([0, 0, 0, 0, 0, 0, 0.5, 0.25], dtype="float16")
        if i in (7, 19, 33):
            value[0] = np.inf
        grads.append((f"grad/model.layers.{i}.self_attn.q_proj.weight", value, "g"))
    writer.observe("backward", grads, owner="training-oncall", gradients="scaled",
                   probe_source="after scaler.scale(loss).backward(), before unscale_")  # fmt: skip
    writer.not_run_rest(owner=OWNER, reason="GradScaler found inf and skipped optimizer.step()")
    return writer.write(tmp_path / "crowded")


def test_a_crowded_hold_still_fits_one_screen(tmp_path: Path) -> None:
    report = check_bundle(_crowded_bundle(tmp_path))
    assert report.decision.earliest_nonfinite_stage == "backward"
    assert len(report.warnings) >= 14
    text = render(report)
    lines = text.splitlines()
    assert len(lines) <= SCREEN_LINES, text
    assert widest(text) <= 80
    # The first non-finite tensor leads, the rest are counted; so are the warnings,
    # the upstream one first.
    tensors = text[text.index("Earliest non-finite stage: backward") : text.index("Warnings")]
    assert tensors.splitlines()[2].startswith("  grad/model.layers.7.self_attn.q_proj.weight ")
    shown = len(re.findall(r"^  grad/", tensors, re.MULTILINE))
    assert f"  ... {40 - shown} more (all in --format json)" in tensors.splitlines()
    warned = text[text.index(f"Warnings ({len(report.warnings)}, upstream first)") :]
    warned = warned[: warned.index("Next steps")]
    assert warned.splitlines()[1].startswith("  BEYOND_COMPUTE_DTYPE  input batch/input_embeds")
    listed = len(re.findall(r"^  [A-Z_]+  ", warned, re.MULTILINE))
    assert f"  ... {len(report.warnings) - listed} more (all in --format json)" in warned
    # Every step of the checklist, one numbered entry each.
    steps = [s for section in report.checklist for s in section.steps]
    assert re.findall(r"^ *(\d+)\. ", text[text.index("Next steps") :], re.MULTILINE) == [
        str(n) for n in range(1, len(steps) + 1)
    ]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_fixture_fits_one_screen(name: str) -> None:
    done = run("check", str(FIXTURES / name))
    assert len(done.stdout.splitlines()) <= SCREEN_LINES, done.stdout
    if name not in ACCEPTED:
        return
    # Each step of the next steps in at most two lines, naming the bundle's facts.
    steps = done.stdout[done.stdout.index("Next steps") :].splitlines()[1:]
    starts = [i for i, line in enumerate(steps) if re.match(r"^ *\d+\. ", line)]
    assert all(b - a <= 2 for a, b in zip(starts, [*starts[1:], len(steps)], strict=True))
    report = check_bundle(FIXTURES / name)
    assert "hold the update" not in done.stdout.lower() or report.decision.decision == "HOLD"
    first = report.decision.first_nonfinite_tensor
    if first is not None:
        assert done.stdout.count(f"  first non-finite tensor    {first}\n") == 1
        assert first in "".join(steps)


def test_a_long_step_is_cut_at_two_lines(tmp_path: Path) -> None:
    """A tensor name longer than two lines cannot push the next steps off the screen."""
    writer = writer_for("run-long", 2, "ckpt-1", 1)
    name = "batch/" + "very_long_feature_name." * 8
    writer.observe("input", [(name, np.array([np.nan], "float32"), "p")], owner=OWNER,
                   probe_source="loader")  # fmt: skip
    writer.not_run_rest(owner=OWNER, reason="aborted")
    text = render(check_bundle(writer.write(tmp_path / "b")))
    steps = text[text.index("Next steps") :].splitlines()[1:]
    assert steps[0] == " 1. Validate the batch against the data contract:"
    assert steps[1].startswith("    batch/very_long_feature_name.") and steps[1].endswith("...")
    assert steps[2].startswith(" 2. Reload the same samples: ")
    assert widest(text) <= 80


def test_each_fact_once_on_one_screen() -> None:
    """The recovery point, the stage's owner and the loss-scale verdict are each named
    once: the next steps name what the notes above them no longer repeat."""
    text = render(check_bundle(FIXTURES / "hold-backward-dynamic-skip"))
    assert text.count("ckpt-step-1800") == 1
    assert text.count("training-oncall") == 1
    assert text.count("tel-1842-backward") == 1
    assert text.count("evidence of overflow, not recovery") == 1
    assert text.count("after scaler.scale(loss).backward(), before unscale_") == 1
    assert "  contract                   training-incident-v1 sha256:5df540288221...\n" in text


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (["--format", "kv"], "--format json holds the whole checklist"),
        (["--format", "json"], "--format json holds the whole checklist"),
        (["--brief"], "--brief shortens the report"),
        (["hold-input"], "several paths are one line each"),
    ],
)
def test_checklist_option_is_for_one_text_report(options: list[str], reason: str) -> None:
    paths = [str(FIXTURES / o) if o == "hold-input" else o for o in options]
    done = run("check", "--checklist", *paths, str(FIXTURES / "hold-loss"))
    assert done.returncode == 2
    assert done.stdout == ""
    assert "'--checklist'" in done.stderr and reason in done.stderr
    assert "Traceback" not in done.stderr


def test_checklist_option_prints_every_step_in_full() -> None:
    report = check_bundle(FIXTURES / "hold-input")
    done = run("check", "--checklist", str(FIXTURES / "hold-input"))
    assert done.returncode == 1
    assert widest(done.stdout) <= 80
    flat = " ".join(done.stdout.split())
    for section in report.checklist:
        assert f" {section.title} " in flat
    assert "Input stage specifics" in done.stdout and "Next steps" not in done.stdout
    assert "nothing upstream" in flat and "Inspect upstream" not in flat


def test_the_learning_rate_the_step_ran_with_is_on_screen(tmp_path: Path) -> None:
    from diffkit import write_bundle

    assert "learning rate  0.001\n" in render(check_bundle(FIXTURES / "hold-loss"))
    bundle = write_bundle(
        tmp_path / "groups",
        changes={
            "optimizer": {"lr": 2.5e-4, "param_groups": 3},
            "scheduler": {"class": "CosineAnnealingLR", "last_epoch": 7},
        },
    )
    report = check_bundle(bundle)
    said = "learning rate 0.00025 (parameter group 0 of 3), scheduler CosineAnnealingLR at epoch 7"
    for text in (render(report), render(report, checklist=True)):
        assert said in " ".join(text.split())
    assert max(len(line) for line in render(report).splitlines()) <= 80

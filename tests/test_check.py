"""check end to end: fixtures, output formats, exit codes, the decision's distrust."""

from __future__ import annotations

import dataclasses
import filecmp
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bundlekit import FIXTURES, copy_fixture, load, save

import nanrunbook
from nanrunbook import EvidenceRejected, check_bundle, decide
from nanrunbook.capture import BundleWriter
from nanrunbook.contract import ACTIONS, contract_content_id
from nanrunbook.output.kv import kv_where
from nanrunbook.output.renderers import RENDERERS
from nanrunbook.output.text import TextRenderer
from nanrunbook.records import Counts

EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
HOLD_FIXTURE = FIXTURES / "hold-backward-dynamic-skip"
CLI = [sys.executable, "-m", "nanrunbook"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


# ---- fixtures ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_answers(name: str) -> None:
    expected = EXPECTED[name]
    if expected["exit"] == 3:
        with pytest.raises(EvidenceRejected) as info:
            check_bundle(FIXTURES / name)
        assert sorted(set(info.value.codes)) == expected["codes"]
        return
    report = check_bundle(FIXTURES / name)
    assert report.exit_code == expected["exit"]
    assert report.decision.earliest_nonfinite_stage == expected["earliest_nonfinite_stage"]
    assert report.decision.first_nonfinite_tensor == expected["first_nonfinite_tensor"]
    stage = expected["earliest_nonfinite_stage"]
    assert report.decision.action == (
        ACTIONS[stage] if stage else "no-nonfinite-evidenced-check-other-signals"
    )
    assert report.decision.root_cause_claim == "NONE_SYMPTOM_LOCATION_IS_NOT_CAUSALITY"


def test_fixtures_cover_every_stage_and_rule_family() -> None:
    holds = {v["earliest_nonfinite_stage"] for v in EXPECTED.values() if v["exit"] == 1}
    assert holds == {"input", "forward", "loss", "backward", "optimizer"}
    assert any(v["exit"] == 0 for v in EXPECTED.values())
    manifest = load(FIXTURES / "hold-forward-bf16")
    assert any(t["dtype"] == "BF16" for s in manifest["stages"] for t in s.get("tensors", []))
    dynamic = load(HOLD_FIXTURE)
    assert dynamic["binding"]["scaler"]["step_skipped"] is True
    assert dynamic["stages"][4]["status"] == "NOT_RUN"


def test_fixture_regeneration_is_byte_identical(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(FIXTURES / "generate.py"), str(tmp_path)], check=True, timeout=120
    )
    committed = sorted(
        p.relative_to(FIXTURES)
        for p in FIXTURES.rglob("*")
        if p.is_file() and p.name != "generate.py"
    )
    regenerated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert committed == regenerated
    for relative in committed:
        assert filecmp.cmp(FIXTURES / relative, tmp_path / relative, shallow=False), relative


def test_check_never_writes(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path, "hold-backward-dynamic-skip")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in bundle.iterdir()}
    check_bundle(bundle)
    assert run("check", "--format", "json", str(bundle)).returncode == 1
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in bundle.iterdir()} == before


# ---- exit codes ----------------------------------------------------------------------


def test_exit_codes() -> None:
    assert run("check", str(FIXTURES / "continue-all-finite")).returncode == 0
    assert run("check", str(HOLD_FIXTURE)).returncode == 1
    assert run("check").returncode == 2
    assert run("check", "--format", "yaml", str(HOLD_FIXTURE)).returncode == 2
    assert run("check", str(FIXTURES / "rejected-digests")).returncode == 3
    assert run("check", "/nonexistent/bundle").returncode == 3


def test_internal_error_is_exit_4_without_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import nanrunbook.check
    from nanrunbook.cli import app

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated defect")

    monkeypatch.setattr(nanrunbook.check, "check_bundle", broken)
    result = CliRunner().invoke(app, ["check", str(HOLD_FIXTURE)])
    assert result.exit_code == 4
    assert "Traceback" not in result.output
    assert "internal error: RuntimeError: simulated defect" in result.output


def test_rejection_is_one_line_reason_first() -> None:
    result = run("check", "/nonexistent/bundle")
    first = result.stdout.splitlines()[0]
    assert first.startswith("nanrunbook check: REJECTED")
    assert "BUNDLE_NOT_FOUND" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


# ---- formats ----------------------------------------------------------------------


def test_kv_is_exactly_the_spec_lines() -> None:
    result = run("check", "--format", "kv", str(HOLD_FIXTURE))
    report = check_bundle(HOLD_FIXTURE)
    assert result.stdout.splitlines() == [
        "contract_version=training-incident-v1",
        f"contract_content_id={contract_content_id()}",
        "run=run-2026-08-25-001",
        "step=1842",
        "evidence_id=run-2026-08-25-001.step-1842",
        f"evidence_content_id={report.manifest.evidence_content_id}",
        "earliest_nonfinite=backward",
        "decision=HOLD",
        "action=hold-and-inspect-gradient-path-and-loss-scaling",
        "root_cause_claim=NONE_SYMPTOM_LOCATION_IS_NOT_CAUSALITY",
        # Appended after the spec's lines (section 10): the early warnings.
        "warnings=1",
        "warning=NEAR_DTYPE_MAX backward#0",
    ]


def test_kv_continue_says_none() -> None:
    lines = run("check", "-f", "kv", str(FIXTURES / "continue-all-finite")).stdout.splitlines()
    assert "earliest_nonfinite=none" in lines
    assert "decision=CONTINUE_BOUNDED_DIAGNOSTICS" in lines
    assert "action=no-nonfinite-evidenced-check-other-signals" in lines


def test_kv_rejection() -> None:
    lines = run("check", "-f", "kv", str(FIXTURES / "rejected-identity")).stdout.splitlines()
    assert lines[:4] == [
        "contract_version=training-incident-v1",
        f"contract_content_id={contract_content_id()}",
        "decision=REJECTED",
        "violations=3",
    ]
    assert lines[4:] == [
        "violation=IDENTIFIER_INVALID $.incident_owner",
        "violation=TELEMETRY_ID_DUPLICATE $.stages[2].telemetry_id",
        "violation=TENSOR_NAME_DUPLICATE $.stages[3].tensors[1].name",
    ]
    assert "rm -rf" not in "\n".join(lines)


def test_a_stage_record_with_its_own_violation_leaves_the_others_compared(
    tmp_path: Path,
) -> None:
    """One stage record's own violation (a text too long) does not hide a repeated id
    or a cap among the others; the order and transitions, which need all five
    records, wait for the next check (man 5, ORDER OF CHECKING)."""
    bundle = copy_fixture(tmp_path)
    manifest = load(bundle)
    stages = manifest["stages"]
    stages[0]["tensor_set"]["probe_source"] = "p" * 1025
    stages[2]["telemetry_id"] = stages[1]["telemetry_id"]
    save(bundle, manifest)
    widest = max(range(1, 5), key=lambda k: len(stages[k].get("tensors", [])))
    cap = nanrunbook.Caps(max_stage_tensors=len(stages[widest]["tensors"]) - 1)
    with pytest.raises(EvidenceRejected) as caught:
        check_bundle(bundle, caps=cap)
    found = [(v.code, v.where) for v in caught.value.violations]
    assert ("TEXT_INVALID", "$.stages[0].tensor_set.probe_source") in found
    assert ("TELEMETRY_ID_DUPLICATE", "$.stages[2].telemetry_id") in found
    assert ("CAP_STAGE_TENSORS", f"$.stages[{widest}].tensors") in found


def test_kv_where_hides_untrusted_keys() -> None:
    assert kv_where("$.stages[0].counts") == "$.stages[0].counts"
    assert kv_where("$.binding.model['$(reboot) x']") == "$.binding.model[?]"
    assert kv_where("bad path`x`") == "bad?path?x?"


def test_json_report_is_whole() -> None:
    result = run("check", "--format", "json", str(HOLD_FIXTURE))
    document = json.loads(result.stdout)
    assert document["report_format"] == "nanrunbook-report/1"
    assert document["decision"] == "HOLD"
    assert document["earliest_nonfinite_stage"] == "backward"
    assert document["first_nonfinite_tensor"] == "grad/layers.0.weight"
    assert document["exit_code"] == 1
    backward = document["stages"][3]
    assert backward["counts"] == {
        "elements": 192,
        "finite": 191,
        "nan": 0,
        "posinf": 0,
        "neginf": 1,
    }
    assert backward["counts_source"] == "recounted"
    # Scaled gradients: the reported magnitude is divided by the scale.
    assert backward["finite_max_abs"] == backward["finite_max_abs_stored"] / 65536
    assert document["scaler"] == {
        "mode": "dynamic",
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "found_inf": True,
        "step_skipped": True,
        "scale_after": 32768.0,
    }
    assert document["stages"][4]["status"] == "NOT_RUN"
    assert document["checklist"][0]["id"] == "stage-backward"


def test_json_rejection_lists_all_violations() -> None:
    result = run("check", "-f", "json", str(FIXTURES / "rejected-json-lexical"))
    document = json.loads(result.stdout)
    assert document["decision"] == "REJECTED"
    assert document["exit_code"] == 3
    assert {v["code"] for v in document["violations"]} == {
        "JSON_DUPLICATE_KEY",
        "JSON_NONFINITE_NUMBER",
        "JSON_INTEGER_OUT_OF_RANGE",
    }


def test_summary_first_tensor_is_null_in_json() -> None:
    document = json.loads(
        run("check", "-f", "json", str(FIXTURES / "hold-optimizer-summary")).stdout
    )
    assert document["earliest_nonfinite_stage"] == "optimizer"
    assert document["first_nonfinite_tensor"] is None
    assert document["stages"][4]["counts_source"] == "declared"


def test_text_report_plain_when_not_a_terminal() -> None:
    result = run("check", str(HOLD_FIXTURE))
    assert "\x1b[" not in result.stdout
    assert "HOLD" in result.stdout
    assert "grad/layers.0.weight" in result.stdout
    assert "evidence of overflow, not recovery" in result.stdout
    # The report ends with the next steps, the earliest stage's specifics first; in
    # full with --checklist.
    tail = result.stdout[result.stdout.index("Next steps (in full: --checklist; ") :]
    assert tail.index("Inspect the gradient path") < tail.index("Reproduce without an update")
    full = run("check", "--checklist", str(HOLD_FIXTURE)).stdout
    tail = full[full.index("Checklist (whole runbook: nanrunbook checklist)") :]
    assert tail.index("Backward stage specifics") < tail.index("Reproduce without an update")


def colour_render(report: nanrunbook.Report) -> str:
    """The text renderer as it draws on a colour terminal."""
    out = io.StringIO()
    TextRenderer(force_terminal=True).report(report, out)
    return out.getvalue()


def test_text_colour_on_terminal_and_none_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    report = check_bundle(HOLD_FIXTURE)
    assert "\x1b[" in colour_render(report)
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in colour_render(report)


def test_markup_in_manifest_is_shown_literally(tmp_path: Path) -> None:
    from fixtures_support import finite_writer

    writer: BundleWriter = finite_writer(probe="[red]x[/red] [link=https://evil]y[/link] $(id)")
    bundle = writer.write(tmp_path / "bundle")
    report = check_bundle(bundle)
    out = io.StringIO()
    RENDERERS["text"].report(report, out)
    assert "[red]x[/red] [link=https://evil]y[/link] $(id)" in out.getvalue()
    coloured = colour_render(report)
    assert "[red]x[/red]" in coloured
    assert "\x1b]8;" not in coloured  # no hyperlink escape was produced


# ---- the decision distrusts what it is handed ------------------------------------------


def test_decide_rejects_a_record_mutated_after_construction() -> None:
    report = check_bundle(HOLD_FIXTURE)
    stages = report.stages
    assert decide(stages).decision == "HOLD"
    backward = stages[3]
    assert backward.counts is not None
    # Hide the infinity: counts no longer reconcile with the elements.
    object.__setattr__(backward, "counts", dataclasses.replace(backward.counts, neginf=0))
    with pytest.raises(EvidenceRejected) as info:
        decide(stages)
    assert "COUNTS_NOT_RECONCILED" in info.value.codes


def test_decide_rejects_counts_that_disagree_with_their_tensors() -> None:
    stages = check_bundle(HOLD_FIXTURE).stages
    backward = stages[3]
    object.__setattr__(backward, "counts", Counts(192, 192, 0, 0, 0))
    with pytest.raises(EvidenceRejected) as info:
        decide(stages)
    assert "RECORD_INCONSISTENT" in info.value.codes


def test_decide_rejects_a_reordered_or_relabelled_stage() -> None:
    stages = check_bundle(HOLD_FIXTURE).stages
    object.__setattr__(stages[3].record, "status", "NOT_RUN")
    with pytest.raises(EvidenceRejected) as info:
        decide(stages)
    assert "RECORD_INCONSISTENT" in info.value.codes
    stages = check_bundle(HOLD_FIXTURE).stages
    object.__setattr__(stages[0].record, "stage", "loss")
    with pytest.raises(EvidenceRejected) as info:
        decide(stages)
    assert "STAGE_ORDER" in info.value.codes


def test_records_are_frozen() -> None:
    report = check_bundle(HOLD_FIXTURE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.decision.decision = "CONTINUE_BOUNDED_DIAGNOSTICS"  # type: ignore[misc]


# ---- the other commands ----------------------------------------------------------------


def test_contract_command_and_its_id() -> None:
    document = json.loads(run("contract").stdout)
    import hashlib

    import rfc8785

    digest = hashlib.sha256(rfc8785.dumps(document)).hexdigest()
    assert contract_content_id() == f"training-incident-contract@sha256:{digest}"
    assert document["caps"] == {
        "max_stage_elements": 2**31,
        "max_bundle_elements": 2**33,
        "max_stage_tensors": 4096,
    }
    text = run("contract", "--format", "text").stdout
    assert f"contract_content_id={contract_content_id()}" in text


def test_raising_a_cap_changes_the_contract_id() -> None:
    raised = run("check", "-f", "kv", "--max-stage-tensors", "8192", str(HOLD_FIXTURE)).stdout
    default = run("check", "-f", "kv", str(HOLD_FIXTURE)).stdout
    raised_id = re.search(r"contract_content_id=(\S+)", raised)
    default_id = re.search(r"contract_content_id=(\S+)", default)
    assert raised_id and default_id and raised_id.group(1) != default_id.group(1)
    assert raised_id.group(1) == contract_content_id(nanrunbook.Caps(max_stage_tensors=8192))


def test_checklist_command() -> None:
    text = run("checklist").stdout
    for heading in ("Containment", "Mixed-precision order", "Replay", "Hardening"):
        assert heading in text
    for step in (
        "Hold the update",
        "Scale before backward",
        "Unscale before clipping",
        "Prove recovery",
    ):
        assert step in text
    document = json.loads(run("checklist", "--stage", "loss", "--format", "json").stdout)
    assert document["checklist"][0]["id"] == "stage-loss"
    assert run("checklist", "--stage", "nowhere").returncode == 2


def test_version() -> None:
    result = run("--version")
    assert result.stdout.strip() == f"nanrunbook {nanrunbook.__version__}"


def test_python_dash_m_and_console_script_agree() -> None:
    script = Path(sys.executable).parent / "nanrunbook"
    if not script.exists():
        pytest.fail("the console script is not installed: run `make test`")
    via_script = subprocess.run(
        [str(script), "check", "-f", "kv", str(HOLD_FIXTURE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert via_script.returncode == 1
    assert via_script.stdout == run("check", "-f", "kv", str(HOLD_FIXTURE)).stdout


def test_stale_content_id_and_bad_data_are_reported_together(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    manifest = load(bundle)
    manifest["stages"][2]["tensors"][0]["sha256"] = "0" * 64
    save(bundle, manifest, reseal=False)
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert set(info.value.codes) == {"EVIDENCE_CONTENT_ID_MISMATCH", "DIGEST_MISMATCH"}


def test_environment_without_color_vars_is_plain() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TERM")}
    env["NO_COLOR"] = "1"
    assert "\x1b[" not in run("check", str(HOLD_FIXTURE), env=env).stdout


@pytest.mark.parametrize("fmt", ["text", "json", "kv"])
@pytest.mark.parametrize(
    ("fixture", "code"),
    [("continue-all-finite", 0), ("hold-loss", 1), ("rejected-identity", 3)],
)
def test_closed_stdout_keeps_the_verdicts_exit_code(fmt: str, fixture: str, code: int) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write gets EPIPE, as after `| head -0` or `grep -q`
    try:
        result = subprocess.run(
            [*CLI, "check", "-f", fmt, str(FIXTURES / fixture)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == code
    assert "Traceback" not in result.stderr


def test_seal_keeps_the_verdicts_exit_code_on_a_closed_stdout(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path, "hold-loss")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [*CLI, "seal", "-f", "kv", str(bundle)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr

"""Messages on the manifest side say the fact first, then what may explain it
(issue 10 items 9 and 10), and the found_inf rule has one home that the
parser, the check and the decision all use."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from bundlekit import copy_fixture, load, save

from nanrunbook import EvidenceRejected, check_bundle
from nanrunbook.manifest.rules import found_inf_violations, scaler_violations
from nanrunbook.records import Scaler
from nanrunbook.verdict.decision import decide


def rejection(bundle: Path) -> EvidenceRejected:
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    return info.value


def hand_edited(tmp_path: Path, change: Any, fixture: str = "continue-all-finite") -> Path:
    bundle = copy_fixture(tmp_path, fixture)
    manifest = load(bundle)
    change(manifest)
    save(bundle, manifest)  # resealed, as someone editing by hand would
    return bundle


def fact_then_causes(message: str, *facts: str) -> None:
    positions = [message.index(fact) for fact in facts]
    assert positions == sorted(positions), message
    assert "edited" in message[positions[-1] :], message


# ------------------------------------------------------------- issue 10 item 9


def test_a_hand_edited_count_states_declared_and_recounted_first(tmp_path: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["stages"][1]["counts"].update(finite=159, nan=1)

    error = rejection(hand_edited(tmp_path, edit))
    (violation,) = [v for v in error.violations if v.code == "COUNTS_RECOUNT_MISMATCH"]
    assert violation.where == "$.stages[1].counts"
    assert violation.message.startswith("declared finite=159 nan=1")
    fact_then_causes(violation.message, "declared", "finite=159", "recounted", "finite=160")


def test_a_hand_edited_magnitude_states_declared_and_recounted_first(tmp_path: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["stages"][0]["finite_max_abs"] = 1.5

    error = rejection(hand_edited(tmp_path, edit))
    (violation,) = [v for v in error.violations if v.code == "FINITE_MAX_ABS_RECOUNT_MISMATCH"]
    fact_then_causes(violation.message, "declared 1.5", "recounted")


def test_the_recount_fixture_names_editing_among_the_causes() -> None:
    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "rejected-counts-recount"
    (violation,) = rejection(fixture).violations
    fact_then_causes(violation.message, "declared", "recounted")


def test_a_hand_edited_found_inf_states_the_contradiction_first(tmp_path: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["binding"]["scaler"].update(found_inf=False, step_skipped=False, scale_after=65536)

    bundle = hand_edited(tmp_path, edit, "hold-backward-dynamic-skip")
    (violation,) = [v for v in rejection(bundle).violations]
    assert violation.code == "SCALER_FOUND_INF_MISMATCH"
    fact_then_causes(violation.message, "found_inf is false", "non-finite element")


# ------------------------------------------------------------ issue 10 item 10

DYNAMIC = {"mode": "dynamic", "growth_factor": 2.0, "backoff_factor": 0.5}


@pytest.mark.parametrize(
    ("found_inf", "after"),
    [(False, 5.0), (True, 5.0)],
)
def test_an_unsafe_scale_is_never_offered_as_a_valid_scale_after(
    found_inf: bool, after: float
) -> None:
    scaler = Scaler(
        scale=3e9, found_inf=found_inf, step_skipped=found_inf, scale_after=after, **DYNAMIC
    )
    found = {v.code: v.message for v in scaler_violations(scaler, "$.binding.scaler")}
    assert set(found) == {"SCALER_SCALE_UNSAFE", "SCALER_TRANSITION_INVALID"}
    message = found["SCALER_TRANSITION_INVALID"]
    for unsafe in ("3000000000.0", "6000000000.0", "1500000000.0"):
        assert f"is {unsafe}" not in message and f"= {unsafe}" not in message
        assert f"{unsafe} or" not in message
    assert "not a power of two within [2^-24, 2^24]" in message


def test_a_safe_scale_still_names_the_values_scale_after_may_take() -> None:
    scaler = Scaler(scale=1024.0, found_inf=False, step_skipped=False, scale_after=5.0, **DYNAMIC)
    (violation,) = scaler_violations(scaler, "$.binding.scaler")
    assert violation.message == "with no inf found scale_after is 1024.0 or 2048.0"
    scaler = dataclasses.replace(scaler, found_inf=True, step_skipped=True)
    (violation,) = scaler_violations(scaler, "$.binding.scaler")
    assert violation.message == "found_inf means scale_after = scale * backoff_factor = 512.0"


def test_unsafe_scale_end_to_end_message(tmp_path: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["binding"]["scaler"].update(scale=3e9, scale_after=3e9 * 3)

    error = rejection(hand_edited(tmp_path, edit, "hold-backward-dynamic-skip"))
    messages = {v.code: v.message for v in error.violations}
    assert "SCALER_SCALE_UNSAFE" in messages
    assert "1500000000.0" not in messages["SCALER_TRANSITION_INVALID"]


# ------------------------------------------------------ found_inf: one function


def test_decide_asks_the_found_inf_rule_when_given_the_scaler() -> None:
    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "hold-backward-dynamic-skip"
    report = check_bundle(fixture)
    scaler = report.manifest.binding.scaler
    assert decide(report.stages, scaler) == report.decision
    contradicted = dataclasses.replace(scaler, found_inf=False, step_skipped=False)
    assert found_inf_violations(contradicted, report.stages, "$")
    with pytest.raises(EvidenceRejected) as info:
        decide(report.stages, contradicted)
    assert info.value.codes == ("SCALER_FOUND_INF_MISMATCH",)
    assert decide(report.stages) == report.decision  # without a scaler: the stages alone


def test_the_check_reads_no_code_strings() -> None:
    """check.py composes the pipeline; it never filters violations by code."""
    source = (Path(__file__).resolve().parent.parent / "nanrunbook" / "check.py").read_text()
    assert ".code ==" not in source and ".code in" not in source
    assert '"EVIDENCE_CONTENT_ID' not in source and '"SCALER_' not in source

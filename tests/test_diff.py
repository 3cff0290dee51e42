"""``diff``: every verdict, outcome and exit code; mechanisms; where two runs part;
the three formats; rejected sides; the recovery gate."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import nanrunbook
from nanrunbook import diff as diff_module
from nanrunbook.cli import app
from nanrunbook.diff import (
    Comparison,
    ComparisonRejected,
    diff_bundles,
    diff_document,
    diff_rejection_document,
)
from nanrunbook.output.renderers import RENDERERS
from tests.bundlekit import load, save
from tests.diffkit import DYNAMIC_SCALER, finite_tensors, with_value, write_bundle

runner = CliRunner()

KV_KEYS = [
    "base_evidence_content_id",
    "other_evidence_content_id",
    "base_decision",
    "other_decision",
    "base_earliest_nonfinite",
    "other_earliest_nonfinite",
    "changed",
    "verdict",
    "outcome",
    "first_divergence_stage",
    "same_evidence",
    "same_bundle",
]


def nan_in(stage_tensor: str, index: tuple[int, ...] = (0, 0)) -> dict[str, Any]:
    return with_value(finite_tensors(), stage_tensor, index, float("nan"))


def forward_hold() -> dict[str, Any]:
    """NaN in the first forward tensor; later stages NOT_RUN."""
    tensors = nan_in("act/l0")
    return {"input": tensors["input"], "forward": tensors["forward"]}


def loss_hold() -> dict[str, Any]:
    tensors = with_value(finite_tensors(), "loss", (), float("inf"))
    return {stage: tensors[stage] for stage in ("input", "forward", "loss")}


def kv(comparison: Comparison | ComparisonRejected) -> dict[str, str]:
    lines = run_renderer("kv", comparison).splitlines()
    return dict(line.split("=", 1) for line in lines)


def run_renderer(fmt: str, result: Comparison | ComparisonRejected) -> str:
    import io

    out = io.StringIO()
    RENDERERS[fmt].diff(result, out)
    return out.getvalue()


def cli(*args: str) -> Any:
    return runner.invoke(app, ["diff", *args], prog_name="nanrunbook")


# ------------------------------------------------------------------ verdicts


def test_reproduced_bit_identical(tmp_path: Path) -> None:
    base = write_bundle(tmp_path / "a", forward_hold())
    other = write_bundle(tmp_path / "b", forward_hold())
    result = diff_bundles(base, other)
    assert (result.verdict, result.outcome, result.changes) == ("REPRODUCED", None, ())
    assert result.first_divergence is None
    assert "not bit for bit" not in run_renderer("text", result)
    assert all(t.status == "identical" and t.delta is None for t in result.tensors)
    assert result.exit_code() == 0 and result.exit_code(require_fixed=True) == 1
    lines = run_renderer("kv", result).splitlines()
    assert [line.split("=", 1)[0] for line in lines] == KV_KEYS
    assert lines[2:] == [
        "base_decision=HOLD",
        "other_decision=HOLD",
        "base_earliest_nonfinite=forward",
        "other_earliest_nonfinite=forward",
        "changed=none",
        "verdict=REPRODUCED",
        "outcome=none",
        "first_divergence_stage=none",
        "same_evidence=true",  # written alike, as a deterministic replay is
        "same_bundle=false",
    ]
    assert result.same_evidence and not result.same_bundle
    assert "note: both sides are the same evidence" in run_renderer("text", result)
    assert lines[0] == f"base_evidence_content_id={load(base)['evidence_content_id']}"
    assert lines[1] == f"other_evidence_content_id={load(other)['evidence_content_id']}"


def test_one_bundle_on_both_sides_is_a_usage_error_in_every_format(tmp_path: Path) -> None:
    """``diff X X``, however spelled, compares nothing: exit 2 (the call's mistake;
    3 would say a bundle was rejected), and every format says so."""
    bundle = write_bundle(tmp_path / "a", forward_hold())
    (tmp_path / "link").symlink_to(bundle)
    for other in (bundle, Path(f"{bundle}/"), tmp_path / "." / "a", tmp_path / "link"):
        result = diff_bundles(bundle, other)
        assert result.same_bundle and result.same_evidence
        assert result.exit_code() == 2 and result.exit_code(require_fixed=True) == 2
    for options in ([], ["--require-fixed"]):
        text = cli(str(bundle), str(tmp_path / "link"), *options)
        assert text.exit_code == 2
        assert text.stdout.startswith("nanrunbook diff: SAME BUNDLE - base and other are one")
        assert "REPRODUCED" not in text.stdout
        assert "Nothing was compared (exit 2)" in text.stdout
        assert max(map(len, text.stdout.splitlines())) <= 80
    as_kv = cli(str(bundle), str(bundle), "-f", "kv")
    assert as_kv.exit_code == 2
    assert as_kv.stdout.splitlines()[-2:] == ["same_evidence=true", "same_bundle=true"]
    as_json = cli(str(bundle), str(bundle), "-f", "json")
    assert as_json.exit_code == 2
    document = json.loads(as_json.stdout)
    assert (document["same_evidence"], document["same_bundle"]) == (True, True)


def test_a_copy_is_the_same_evidence_but_not_the_same_bundle(tmp_path: Path) -> None:
    """A copy cannot be told from a replay that came out bit for bit (neither can
    the bundle): REPRODUCED stands, exit 0, and the report says one evidence."""
    import shutil

    bundle = write_bundle(tmp_path / "a", forward_hold())
    shutil.copytree(bundle, tmp_path / "copy")
    done = cli(str(bundle), str(tmp_path / "copy"), "-f", "kv")
    assert done.exit_code == 0
    assert "verdict=REPRODUCED" in done.stdout.splitlines()
    assert done.stdout.splitlines()[-2:] == ["same_evidence=true", "same_bundle=false"]
    other = write_bundle(tmp_path / "b", loss_hold())
    assert not diff_bundles(bundle, other).same_evidence


def test_not_reproduced_says_the_decision_differs(tmp_path: Path) -> None:
    result = diff_bundles(
        write_bundle(tmp_path / "a", forward_hold()), write_bundle(tmp_path / "b")
    )
    assert (result.verdict, result.not_reproduced, result.outcome) == (
        "NOT_REPRODUCED",
        "decision",
        None,
    )
    assert result.exit_code() == 1
    assert kv(result)["first_divergence_stage"] == "forward"
    assert "the decision differs" in run_renderer("text", result)


def test_not_reproduced_says_the_earliest_stage_differs(tmp_path: Path) -> None:
    result = diff_bundles(
        write_bundle(tmp_path / "a", forward_hold()), write_bundle(tmp_path / "b", loss_hold())
    )
    assert (result.verdict, result.not_reproduced) == ("NOT_REPRODUCED", "earliest_nonfinite_stage")
    assert (kv(result)["base_earliest_nonfinite"], kv(result)["other_earliest_nonfinite"]) == (
        "forward",
        "loss",
    )
    assert result.exit_code() == 1
    assert "the earliest non-finite stage differs" in run_renderer("text", result)


PRECISION_BF16 = {"precision": {"id": "bf16", "compute_dtype": "BF16"}}


@pytest.mark.parametrize(
    ("base", "other", "outcome", "exit_gate"),
    [
        (forward_hold, None, "FIXED", 0),
        (None, forward_hold, "BROKE", 1),
        (forward_hold, loss_hold, "MOVED", 1),
        (forward_hold, forward_hold, "UNCHANGED", 1),
        (None, None, "UNCHANGED", 1),
    ],
    ids=["fixed", "broke", "moved", "unchanged-hold", "unchanged-continue"],
)
def test_one_mechanism_changed_outcomes(
    tmp_path: Path, base: Any, other: Any, outcome: str, exit_gate: int
) -> None:
    a = write_bundle(tmp_path / "a", base() if base else None, changes=PRECISION_BF16)
    b = write_bundle(tmp_path / "b", other() if other else None)
    result = diff_bundles(a, b)
    assert (result.verdict, result.outcome, result.changed) == (
        "ONE_MECHANISM_CHANGED",
        outcome,
        ("precision",),
    )
    assert result.exit_code() == 0
    assert result.exit_code(require_fixed=True) == exit_gate
    assert result.recovered is (outcome == "FIXED")
    values = kv(result)
    assert (values["changed"], values["verdict"], values["outcome"]) == (
        "precision",
        "ONE_MECHANISM_CHANGED",
        outcome,
    )
    change = result.changes[0]
    assert change.fields == ("id", "compute_dtype")
    assert (change.base["compute_dtype"], change.other["compute_dtype"]) == ("BF16", "F32")


def test_confounded_names_every_change_and_attributes_nothing(tmp_path: Path) -> None:
    a = write_bundle(
        tmp_path / "a",
        forward_hold(),
        changes={**PRECISION_BF16, "optimizer": {"lr": 0.01}, "data": {"id": "data-v2"}},
    )
    b = write_bundle(tmp_path / "b")
    result = diff_bundles(a, b)
    assert (result.verdict, result.outcome) == ("CONFOUNDED", None)
    assert result.changed == ("data", "optimizer", "precision")  # spec order
    assert result.exit_code() == 1 and result.exit_code(require_fixed=True) == 1
    assert kv(result)["changed"] == "data,optimizer,precision"
    assert kv(result)["outcome"] == "none"
    text = run_renderer("text", result)
    for item in ("data", "optimizer", "precision"):
        assert f"Changed mechanism: {item}" in text
    assert "no attribution" in text
    assert "lr  0.01 -> 0.001" in text


# ---------------------------------------------------------------- mechanisms


def test_scaler_outcome_fields_are_results_not_mechanisms(tmp_path: Path) -> None:
    """found_inf, step_skipped and scale_after differ (the step overflowed in one
    replay only): no mechanism differs, so the replay did not reproduce."""
    overflow = {**DYNAMIC_SCALER, "found_inf": True, "step_skipped": True, "scale_after": 32768}
    tensors = with_value(finite_tensors(), "grad/w", (0, 0), float("inf"))
    base = {stage: tensors[stage] for stage in ("input", "forward", "loss", "backward")}
    a = write_bundle(tmp_path / "a", base, changes={"scaler": overflow})
    b = write_bundle(tmp_path / "b", changes={"scaler": DYNAMIC_SCALER})
    result = diff_bundles(a, b)
    assert result.changes == ()
    assert (result.verdict, result.not_reproduced) == ("NOT_REPRODUCED", "decision")

    grown = {**DYNAMIC_SCALER, "growth_factor": 4.0, "scale_after": 65536}
    c = write_bundle(tmp_path / "c", changes={"scaler": grown})
    result = diff_bundles(b, c)
    assert result.changed == ("scaler",) and result.changes[0].fields == ("growth_factor",)


def test_numbers_compare_by_value_and_new_fields_count(tmp_path: Path) -> None:
    a = write_bundle(tmp_path / "a", changes={"optimizer": {"lr": 1}})
    b = write_bundle(tmp_path / "b", changes={"optimizer": {"lr": 1.0}})
    assert load(a)["binding"]["optimizer"]["lr"] == 1 and isinstance(
        load(b)["binding"]["optimizer"]["lr"], float
    )
    assert diff_bundles(a, b).verdict == "REPRODUCED"
    c = write_bundle(tmp_path / "c", changes={"optimizer": {"lr": 1, "warmup": "none"}})
    result = diff_bundles(a, c)
    assert result.changed == ("optimizer",)
    assert result.changes[0].fields == ("warmup",)
    assert "warmup  (absent) -> none" in run_renderer("text", result)


def test_identities_are_reported_not_counted(tmp_path: Path) -> None:
    a = write_bundle(tmp_path / "a", step=101)
    b = write_bundle(tmp_path / "b", step=102, run_id="run-other")
    result = diff_bundles(a, b)
    assert result.verdict == "REPRODUCED"
    assert (result.same_run, result.same_step) == (False, False)
    document = diff_document(result)
    assert (document["same_run"], document["same_step"]) == (False, False)
    assert (document["base"]["run"], document["other"]["run"]) == (
        {"run_id": "run-diff", "step": 101},
        {"run_id": "run-other", "step": 102},
    )
    assert "different runs" in run_renderer("text", result)
    c = write_bundle(tmp_path / "c", step=102)
    assert "different steps" in run_renderer("text", diff_bundles(a, c))


# ------------------------------------------------------------------ tensors


def test_first_divergence_is_the_first_differing_tensor_in_capture_order(tmp_path: Path) -> None:
    tensors = finite_tensors()
    changed = with_value(tensors, "grad/w", (1, 2), 9.0)
    changed = with_value(changed, "act/l1", (0, 1), 3.0)
    a = write_bundle(tmp_path / "a", tensors)
    b = write_bundle(tmp_path / "b", changed)
    result = diff_bundles(a, b)
    first = result.first_divergence
    assert first is not None and (first.name, first.base_stage) == ("act/l1", "forward")
    assert [t.name for t in result.tensors if t.differs] == ["act/l1", "grad/w"]
    assert kv(result)["first_divergence_stage"] == "forward"
    assert result.verdict == "REPRODUCED"
    assert "both answer the same, though not bit for bit" in run_renderer("text", result)
    before = float(tensors["forward"][1][1][0, 1])
    delta = first.delta
    assert delta is not None
    assert (delta.elements, delta.differing) == (8, 1)
    assert delta.max_abs_diff == abs(float(np.float32(3.0)) - before)
    assert delta.max_rel_diff == abs(before / 3.0 - 1.0)
    forward = result.stages[1]
    assert (forward.identical, forward.differing) == (1, 1)
    document = diff_document(result)
    assert document["first_divergence_stage"] == "forward"
    assert document["first_divergence"]["differing"] == 1


def test_nan_and_inf_that_appear_and_disappear(tmp_path: Path) -> None:
    tensors = finite_tensors()
    base = with_value(tensors, "act/l0", (0, 0), float("nan"))
    base = with_value(base, "act/l0", (0, 1), float("inf"))
    other = with_value(tensors, "act/l0", (1, 0), float("nan"))
    other = with_value(other, "act/l0", (1, 1), float("-inf"))
    other = with_value(other, "act/l0", (1, 2), float("-inf"))
    other = with_value(other, "act/l0", (2, 2), 100.0)
    result = diff_bundles(write_bundle(tmp_path / "a", base), write_bundle(tmp_path / "b", other))
    delta = result.first_divergence.delta  # type: ignore[union-attr]
    assert delta is not None
    assert (delta.nan_appeared, delta.nan_disappeared) == (1, 1)
    assert (delta.inf_appeared, delta.inf_disappeared) == (2, 1)
    assert delta.differing == 6
    finite_before = float(tensors["forward"][0][1][2, 2])
    assert delta.max_abs_diff == abs(100.0 - finite_before)
    text = run_renderer("text", result)
    assert "NaN appeared in 1" in text and "inf disappeared in 1" in text


def test_dtype_shape_one_sided_and_summary_tensors(tmp_path: Path) -> None:
    tensors = finite_tensors()
    other = finite_tensors()
    other["forward"][0] = ("act/l0", tensors["forward"][0][1].astype("<f2"))
    other["forward"][1] = ("act/l1", tensors["forward"][1][1].reshape(2, 4))
    other["backward"].append(("grad/b", np.zeros(3, "<f4")))
    other["optimizer"] = []
    del other["optimizer"]
    result = diff_bundles(
        write_bundle(tmp_path / "a", tensors, summaries=("loss",)),
        write_bundle(tmp_path / "b", _with_optimizer(other)),
    )
    status = {t.name: t.status for t in result.tensors}
    assert status["act/l0"] == "dtype_differs" and status["act/l1"] == "shape_differs"
    assert status["loss"] == "not_compared" and status["batch/x"] == "identical"
    assert [(t.name, t.stage) for t in result.other_only] == [
        ("grad/b", "backward"),
        ("update/w2", "optimizer"),
    ]
    assert [(t.name, t.stage) for t in result.base_only] == [("update/w", "optimizer")]
    assert result.first_divergence is not None and result.first_divergence.name == "act/l0"
    assert result.first_divergence.delta is None
    optimizer = result.stages[4]
    assert (optimizer.base_only, optimizer.other_only) == (1, 1)
    assert (result.stages[2].not_compared, result.stages[3].other_only) == (1, 1)
    document = diff_document(result)
    assert document["first_divergence"]["elements"] is None
    assert document["base_only"] == [{"name": "update/w", "stage": "optimizer"}]
    text = run_renderer("text", result)
    assert "dtype F32 -> F16" in text and "shape [4, 2] -> [2, 4]" in text
    assert "Only in base (1): update/w (optimizer)" in text


def _with_optimizer(tensors: dict[str, Any]) -> dict[str, Any]:
    tensors["optimizer"] = [("update/w2", np.ones((3, 8), "<f4"))]
    return tensors


def test_digests_that_match_are_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = finite_tensors()
    a = write_bundle(tmp_path / "a", tensors)
    b = write_bundle(tmp_path / "b", with_value(tensors, "grad/w", (0, 0), 1.5))
    compared: list[list[str]] = []
    real = diff_module.compare_tensors

    def spy(pairs: Any, **kwargs: Any) -> Any:
        compared.append([p.base.name for p in pairs])
        return real(pairs, **kwargs)

    monkeypatch.setattr(diff_module, "compare_tensors", spy)
    diff_bundles(a, b)
    assert compared == [["grad/w"]]


def test_a_file_changed_after_its_check_rejects_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = finite_tensors()
    a = write_bundle(tmp_path / "a", tensors)
    b = write_bundle(tmp_path / "b", with_value(tensors, "loss", (), 0.25))
    real = diff_module.check_bundle

    def check_then_tamper(path: Any, **kwargs: Any) -> Any:
        report = real(path, **kwargs)
        if Path(path) == b:  # same length, other bytes: the digest no longer holds
            data = bytearray((b / "tensors.safetensors").read_bytes())
            position = data.rindex(np.array(0.25, "<f4").tobytes())
            data[position : position + 4] = np.array(0.75, "<f4").tobytes()
            (b / "tensors.safetensors").write_bytes(bytes(data))
        return report

    monkeypatch.setattr(diff_module, "check_bundle", check_then_tamper)
    with pytest.raises(ComparisonRejected) as caught:
        diff_bundles(a, b)
    assert caught.value.codes == ("DIGEST_MISMATCH",)
    assert caught.value.violations[0].where == "other/$.stages[2].tensors[0].sha256"
    assert caught.value.sides == ("other",)


# ------------------------------------------------------------------ rejected


def test_a_rejected_side_names_itself_and_each_code(tmp_path: Path) -> None:
    good = write_bundle(tmp_path / "good")
    bad = write_bundle(tmp_path / "bad")
    manifest = load(bad)
    manifest["stages"][1]["counts"]["finite"] -= 1
    manifest["stages"][1]["counts"]["nan"] += 1
    save(bad, manifest)
    with pytest.raises(ComparisonRejected) as caught:
        diff_bundles(good, bad)
    error = caught.value
    assert error.sides == ("other",) and error.exit_code == 3
    assert error.codes == ("COUNTS_RECOUNT_MISMATCH",)
    assert [v.where for v in error.violations] == ["other/$.stages[1].counts"]
    assert run_renderer("kv", error).splitlines() == [
        "verdict=REJECTED",
        "rejected=other",
        "violations=1",
        "violation=COUNTS_RECOUNT_MISMATCH other/$.stages[1].counts",
    ]
    document = diff_rejection_document(error)
    assert document["violations"][0]["side"] == "other"
    assert (document["verdict"], document["exit_code"], document["rejected"]) == (
        "REJECTED",
        3,
        ["other"],
    )

    with pytest.raises(ComparisonRejected) as both:
        diff_bundles(tmp_path / "missing", bad)
    assert both.value.sides == ("base", "other")
    assert both.value.codes == ("BUNDLE_NOT_FOUND", "COUNTS_RECOUNT_MISMATCH")
    text = run_renderer("text", both.value)
    assert text.startswith("nanrunbook diff: REJECTED - base and other rejected, 2 violations")
    assert "BUNDLE_NOT_FOUND base/" in " ".join(text.split())  # wrapped at 80 columns


# ---------------------------------------------------------------------- CLI


def test_cli_exit_codes_and_formats(tmp_path: Path) -> None:
    hold = write_bundle(tmp_path / "hold", forward_hold(), changes=PRECISION_BF16)
    hold_again = write_bundle(tmp_path / "hold-again", forward_hold(), changes=PRECISION_BF16)
    fixed = write_bundle(tmp_path / "fixed")
    unchanged = write_bundle(tmp_path / "unchanged", forward_hold())
    confounded = write_bundle(tmp_path / "confounded", changes={"data": {"id": "data-v9"}})
    cases = [
        ((hold, hold_again), [], 0, "REPRODUCED"),
        ((hold, fixed), [], 0, "ONE_MECHANISM_CHANGED"),
        ((hold, fixed), ["--require-fixed"], 0, "ONE_MECHANISM_CHANGED"),
        ((hold, unchanged), [], 0, "ONE_MECHANISM_CHANGED"),
        ((hold, unchanged), ["--require-fixed"], 1, "ONE_MECHANISM_CHANGED"),
        ((hold, hold_again), ["--require-fixed"], 1, "REPRODUCED"),
        ((hold, confounded), [], 1, "CONFOUNDED"),
        ((unchanged, fixed), [], 1, "NOT_REPRODUCED"),
        ((hold, tmp_path / "nowhere"), [], 3, "REJECTED"),
        ((hold, tmp_path / "nowhere"), ["--require-fixed"], 3, "REJECTED"),
    ]
    for (a, b), options, code, verdict in cases:
        result = cli(str(a), str(b), "--format", "kv", *options)
        assert result.exit_code == code, (a, b, options, result.output)
        assert f"verdict={verdict}\n" in result.stdout
    as_json = cli(str(hold), str(fixed), "-f", "json")
    document = json.loads(as_json.stdout)
    assert (document["verdict"], document["outcome"], document["recovered"]) == (
        "ONE_MECHANISM_CHANGED",
        "FIXED",
        True,
    )
    text = cli(str(hold), str(fixed))
    assert text.exit_code == 0
    assert text.stdout.startswith("nanrunbook diff: ONE_MECHANISM_CHANGED precision: FIXED")
    assert "compute_dtype  BF16 -> F32" in text.stdout


def test_cli_usage_errors(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "a")
    assert cli(str(bundle)).exit_code == 2  # OTHER missing
    assert cli(str(bundle), "").exit_code == 2  # an unset variable
    assert cli(str(bundle), str(bundle), "--format", "yaml").exit_code == 2
    assert cli(str(bundle), str(bundle), "--max-stage-tensors", "0").exit_code == 2


def test_library_exports() -> None:
    assert nanrunbook.diff_bundles is diff_bundles
    assert nanrunbook.Comparison is Comparison
    assert issubclass(nanrunbook.ComparisonRejected, nanrunbook.EvidenceRejected)
    assert nanrunbook.diff_document is diff_document


def test_json_has_no_infinity_even_for_an_f64_overflow(tmp_path: Path) -> None:
    tensors = finite_tensors()
    tensors["forward"].append(("act/f64", np.array([1.5e308, 1.0], "<f8")))
    other = finite_tensors()
    other["forward"].append(("act/f64", np.array([-1.5e308, 1.0], "<f8")))
    result = diff_bundles(
        write_bundle(tmp_path / "a", tensors), write_bundle(tmp_path / "b", other)
    )
    delta = result.first_divergence.delta  # type: ignore[union-attr]
    assert delta is not None and delta.max_abs_diff == math.inf and delta.max_rel_diff == 2.0
    document = json.loads(run_renderer("json", result))
    assert document["first_divergence"]["max_abs_diff"] == "inf"


def _documented(name: str) -> set[str]:
    from tests.test_docs import MAN1, subsections, tags

    return {word for tag in tags(subsections(MAN1, "JSON REPORT")[name]) for word in tag.split()}


def test_the_man_page_documents_every_json_key(tmp_path: Path) -> None:
    tensors = finite_tensors()
    a = write_bundle(tmp_path / "a", tensors)
    b = write_bundle(tmp_path / "b", with_value(tensors, "act/l0", (0, 0), 2.0))
    document = diff_document(diff_bundles(a, b))
    assert _documented("Comparison (diff, exit 0, 1 or 2)") == set(document)
    assert document["tensors"] and document["first_divergence"] is not None
    for tensor in document["tensors"]:
        assert _documented("Comparison tensor objects") == set(tensor)
    for stage in document["stages"]:
        assert _documented("Comparison stage objects") == set(stage)
    with pytest.raises(ComparisonRejected) as caught:
        diff_bundles(a, tmp_path / "missing")
    rejection = diff_rejection_document(caught.value)
    assert _documented("Rejected comparison (diff, exit 3)") == set(rejection)
    for violation in rejection["violations"]:
        assert set(violation) == {"side", "code", "where", "message"}

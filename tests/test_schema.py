"""``nanrunbook schema``: a JSON Schema of manifest.json that agrees with ``check``.

The schema must accept every manifest ``check`` accepts, reject every manifest
that earns a code it claims to express (SCHEMA_CODES), and is shown, case by
case, to leave the contract-only rules to ``check``.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

from nanrunbook import EvidenceRejected, check_bundle
from nanrunbook.capture import BundleWriter
from nanrunbook.cli import app
from nanrunbook.codes import CODES
from nanrunbook.manifest.content_id import evidence_content_id
from nanrunbook.manifest.schema import PARTIAL_CODES, SCHEMA_CODES, manifest_schema

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_bytes())
VALIDATOR = Draft202012Validator(manifest_schema())

Manifest = dict[str, Any]


def schema_errors(manifest: Any) -> list[str]:
    return [error.message for error in VALIDATOR.iter_errors(manifest)]


def fixture_manifest(name: str) -> Manifest:
    # A generic validator sees what a standard JSON parser makes of the bytes.
    loaded: Manifest = json.loads((FIXTURES / name / "manifest.json").read_bytes())
    return loaded


def test_schema_is_a_valid_2020_12_schema() -> None:
    schema = manifest_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


def test_claimed_codes_are_real_codes() -> None:
    assert set(SCHEMA_CODES) <= set(CODES)
    assert set(PARTIAL_CODES) <= set(SCHEMA_CODES)


def test_cli_prints_the_schema() -> None:
    result = CliRunner().invoke(app, ["schema"], prog_name="nanrunbook")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == manifest_schema()


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if not e["codes"]))
def test_valid_fixtures_validate(name: str) -> None:
    assert schema_errors(fixture_manifest(name)) == []


def _schema_level(codes: list[str]) -> bool:
    return bool(set(codes) & (SCHEMA_CODES - set(PARTIAL_CODES)))


@pytest.mark.parametrize(
    "name", sorted(n for n, e in EXPECTED.items() if e["codes"] and _schema_level(e["codes"]))
)
def test_schema_level_rejection_fixtures_fail(name: str) -> None:
    assert schema_errors(fixture_manifest(name)), name


@pytest.mark.parametrize(
    "name",
    sorted(n for n, e in EXPECTED.items() if e["codes"] and not set(e["codes"]) & SCHEMA_CODES),
)
def test_contract_only_rejection_fixtures_pass_the_schema(name: str) -> None:
    """The schema does not replace the check: these need relations, data or ids."""
    assert schema_errors(fixture_manifest(name)) == [], name


def test_fixture_split_is_as_documented() -> None:
    # The man page (nanrunbook-bundle(5), SCHEMA) names the schema-level fixtures.
    schema_level = {n for n, e in EXPECTED.items() if _schema_level(e["codes"])}
    assert {
        "rejected-files",
        "rejected-identity",
        "rejected-last-known-good",
        "rejected-scaler",
        "rejected-schema-types",
        "rejected-transitions",
    } <= schema_level


def test_lexical_rules_are_beyond_json_schema() -> None:
    """Duplicate keys, NaN and an unsafe integer in a detail: a standard parser and
    the schema let all three through; check rejects them."""
    raw = (FIXTURES / "rejected-json-lexical" / "manifest.json").read_text()
    assert "NaN" in raw
    assert schema_errors(json.loads(raw)) == []
    assert set(EXPECTED["rejected-json-lexical"]["codes"]) >= {
        "JSON_DUPLICATE_KEY",
        "JSON_NONFINITE_NUMBER",
    }


# --------------------------------------------------------------- mutation tables


def _stage(index: int) -> Callable[[Manifest], Manifest]:
    def get(m: Manifest) -> Manifest:
        stage: Manifest = m["stages"][index]
        return stage

    return get


def _not_run(stage: Manifest) -> None:
    for key in ("resolution", "tensors", "counts", "finite_max_abs"):
        stage.pop(key, None)
    stage["status"] = "NOT_RUN"
    stage["reason"] = "did not run"


def _set(path: str, value: Any) -> Callable[[Manifest], None]:
    def edit(m: Manifest) -> None:
        *parents, last = path.split(".")
        node: Any = m
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _delete(path: str) -> Callable[[Manifest], None]:
    def edit(m: Manifest) -> None:
        *parents, last = path.split(".")
        node: Any = m
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return edit


def _swap_stages(m: Manifest) -> None:
    m["stages"][1], m["stages"][2] = m["stages"][2], m["stages"][1]


def _input_not_run(m: Manifest) -> None:
    _not_run(m["stages"][0])


def _backward_not_run(m: Manifest) -> None:
    _not_run(m["stages"][3])


def _drop_stage(m: Manifest) -> None:
    m["stages"].pop()


def _dynamic(m: Manifest) -> None:
    m["binding"]["scaler"] = {
        "id": "gradscaler",
        "mode": "dynamic",
        "scale": 1024,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "found_inf": False,
        "step_skipped": False,
        "scale_after": 1024,
    }


def _then(*edits: Callable[[Manifest], None]) -> Callable[[Manifest], None]:
    def edit(m: Manifest) -> None:
        for e in edits:
            e(m)

    return edit


# (code, fixture, edit, reseal): each edit earns ``code`` from check.
SCHEMA_REJECTS: list[tuple[str, str, Callable[[Manifest], None], bool]] = [
    ("FIELD_MISSING", "continue-all-finite", _delete("run.run_id"), True),
    ("FIELD_MISSING", "continue-all-finite", _delete("binding.precision.compute_dtype"), True),
    ("FIELD_MISSING", "continue-all-finite", _delete("stages.3.gradients"), True),
    ("FIELD_MISSING", "hold-input", _delete("stages.2.reason"), True),
    ("FIELD_MISSING", "continue-all-finite", _delete("stages.0.tensors.0.sha256"), True),
    (
        "FIELD_MISSING",
        "continue-all-finite",
        _then(_dynamic, _delete("binding.scaler.found_inf")),
        True,
    ),
    ("FIELD_UNKNOWN", "continue-all-finite", _set("stages.1.comment", "x"), True),
    ("FIELD_UNKNOWN", "continue-all-finite", _set("stages.1.tensors.0.bytes", 4), True),
    ("FIELD_UNKNOWN", "continue-all-finite", _set("binding.extra_item", {"id": "x"}), True),
    ("FIELD_TYPE", "continue-all-finite", _set("stages.0.counts.nan", False), True),
    ("FIELD_TYPE", "continue-all-finite", _set("binding.optimizer.betas", [0.9, 0.99]), True),
    ("FIELD_TYPE", "continue-all-finite", _set("binding.optimizer.fused", True), True),
    ("FIELD_TYPE", "continue-all-finite", _set("incident_owner", ["a", "b"]), True),
    ("FIELD_OUT_OF_RANGE", "continue-all-finite", _set("run.step", -1), True),
    ("FIELD_OUT_OF_RANGE", "continue-all-finite", _set("binding.topology.world_size", 0), True),
    ("VALUE_NOT_ALLOWED", "continue-all-finite", _set("binding.objective.reduction", "avg"), True),
    ("VALUE_NOT_ALLOWED", "continue-all-finite", _set("stages.0.status", "SKIPPED"), True),
    ("VALUE_NOT_ALLOWED", "continue-all-finite", _set("stages.3.gradients", "raw"), True),
    ("IDENTIFIER_INVALID", "continue-all-finite", _set("incident_owner", "ml oncall"), True),
    ("IDENTIFIER_INVALID", "continue-all-finite", _set("binding.model.id", ""), True),
    ("IDENTIFIER_INVALID", "continue-all-finite", _set("stages.0.owner", "-lead"), True),
    ("FORMAT_UNSUPPORTED", "continue-all-finite", _set("format", "nanrunbook-bundle/2"), True),
    (
        "CONTRACT_VERSION_UNSUPPORTED",
        "continue-all-finite",
        _set("contract_version", "training-incident-v2"),
        True,
    ),
    (
        "EVIDENCE_CONTENT_ID_INVALID",
        "continue-all-finite",
        _set("evidence_content_id", "sha256:0123"),
        False,
    ),
    ("DIGEST_INVALID", "continue-all-finite", _set("stages.0.tensors.0.sha256", "AB" * 32), True),
    ("DTYPE_UNKNOWN", "continue-all-finite", _set("binding.precision.param_dtype", "FP32"), True),
    ("DTYPE_UNKNOWN", "continue-all-finite", _set("stages.0.tensors.0.dtype", "F128"), True),
    ("SHAPE_INVALID", "continue-all-finite", _set("stages.0.tensors.0.shape", [-8, 8]), True),
    (
        "LAST_KNOWN_GOOD_INCOMPLETE",
        "continue-all-finite",
        _set("last_known_good.verified_together", ["model", "optimizer"]),
        True,
    ),
    ("STAGES_NOT_FIVE", "continue-all-finite", _drop_stage, True),
    ("STAGE_FIELD_NOT_ALLOWED", "continue-all-finite", _set("stages.0.gradients", "scaled"), True),
    ("STAGE_FIELD_NOT_ALLOWED", "hold-input", _set("stages.2.counts", {}), True),
    (
        "ENTRY_FIELD_NOT_ALLOWED",
        "hold-optimizer-summary",
        _set("stages.4.tensors.0.file", "tensors.safetensors"),
        True,
    ),
    ("TENSORS_EMPTY", "continue-all-finite", _set("stages.0.tensors", []), True),
    (
        "SCALER_FIELD_NOT_ALLOWED",
        "continue-all-finite",
        _set("binding.scaler.found_inf", False),
        True,
    ),
    ("STAGE_ORDER", "continue-all-finite", _swap_stages, True),
    ("TRANSITION_INPUT_NOT_OBSERVED", "continue-all-finite", _input_not_run, True),
    ("TRANSITION_OBSERVED_AFTER_NOT_RUN", "continue-all-finite", _backward_not_run, True),
    ("FILE_PATH_UNSAFE", "continue-all-finite", _set("stages.0.tensors.0.file", "a\\b"), True),
    ("FILE_PATH_UNSAFE", "continue-all-finite", _set("stages.0.tensors.0.file", ""), True),
    ("FILE_PATH_UNSAFE", "continue-all-finite", _set("stages.0.tensors.0.file", "a/../b"), True),
    ("FILE_PATH_UNSAFE", "continue-all-finite", _set("stages.0.tensors.0.file", "/t"), True),
    ("SCALER_SCALE_NOT_ONE", "continue-all-finite", _set("binding.scaler.scale", 2), True),
    (
        "SCALER_SCALE_UNSAFE",
        "continue-all-finite",
        _then(_set("binding.scaler.mode", "static"), _set("binding.scaler.scale", 3)),
        True,
    ),
    (
        "SCALER_SCALE_UNSAFE",
        "continue-all-finite",
        _then(_set("binding.scaler.mode", "static"), _set("binding.scaler.scale", 2.0**25)),
        True,
    ),
    (
        "SCALER_FACTOR_INVALID",
        "continue-all-finite",
        _then(_dynamic, _set("binding.scaler.backoff_factor", 1.0)),
        True,
    ),
    ("FINITE_MAX_ABS_INVALID", "continue-all-finite", _set("stages.0.finite_max_abs", -1.0), True),
    # Partly expressed codes, in the cases the schema does express.
    (
        "TEXT_INVALID",
        "continue-all-finite",
        _set("stages.0.tensor_set.probe_source", "x" * 1025),
        True,
    ),
    ("TENSOR_NAME_INVALID", "continue-all-finite", _set("stages.0.tensors.0.name", ""), True),
    (
        "JSON_CONTROL_CHARACTER",
        "continue-all-finite",
        _set("stages.0.tensors.0.probe", "a\x07"),
        True,
    ),
    ("JSON_CONTROL_CHARACTER", "continue-all-finite", _set("binding.model.x\ty", 1), True),
    ("JSON_INTEGER_OUT_OF_RANGE", "continue-all-finite", _set("run.step", 2**53), False),
]

# Rejected by check, accepted by the schema: relations, sums, uniqueness, lexical
# forms and printability beyond control characters are the contract's alone.
CONTRACT_ONLY: list[tuple[str, str, Callable[[Manifest], None], bool]] = [
    (
        "TELEMETRY_ID_DUPLICATE",
        "continue-all-finite",
        _set("stages.1.telemetry_id", "tel-1842-input"),
        True,
    ),
    (
        "TENSOR_SET_ID_DUPLICATE",
        "continue-all-finite",
        _set("stages.1.tensor_set.id", "ts-1842-input"),
        True,
    ),
    (
        "TENSOR_NAME_DUPLICATE",
        "continue-all-finite",
        _set("stages.1.tensors.0.name", "batch/features"),
        True,
    ),
    (
        "LAST_KNOWN_GOOD_NOT_BEFORE_RUN",
        "continue-all-finite",
        _set("last_known_good.step", 1842),
        True,
    ),
    ("TOPOLOGY_INVALID", "continue-all-finite", _set("binding.topology.rank", 1), True),
    ("COUNTS_NOT_RECONCILED", "continue-all-finite", _set("stages.0.counts.finite", 0), True),
    (
        "COUNTS_ELEMENTS_MISMATCH",
        "continue-all-finite",
        _set("stages.0.tensors.0.shape", [8, 9]),
        True,
    ),
    (
        "GRADIENTS_SCALED_WITHOUT_SCALER",
        "continue-all-finite",
        _set("stages.3.gradients", "scaled"),
        True,
    ),
    (
        "SCALER_TRANSITION_INVALID",
        "continue-all-finite",
        _then(_dynamic, _set("binding.scaler.scale_after", 4096)),
        True,
    ),
    (
        "TRANSITION_NOT_RUN_WITHOUT_NONFINITE",
        "continue-all-finite",
        _then(_backward_not_run, lambda m: _not_run(m["stages"][4])),
        True,
    ),
    (
        "FINITE_MAX_ABS_EXCESSIVE",
        "continue-all-finite",
        _set("stages.0.finite_max_abs", 1e39),
        True,
    ),
    (
        "EVIDENCE_CONTENT_ID_MISMATCH",
        "continue-all-finite",
        _set("incident_owner", "someone-else"),
        False,
    ),
    ("FIELD_TYPE", "continue-all-finite", _set("run.step", 1842.0), True),
    (
        "TEXT_INVALID",
        "continue-all-finite",
        _set("stages.0.tensors.0.probe", "grad \u202egnp.exe"),
        True,
    ),
    (
        "TEXT_INVALID",
        "continue-all-finite",
        _set("stages.0.tensor_set.probe_source", "a\u00a0b"),
        True,
    ),
    (
        "TENSOR_NAME_INVALID",
        "continue-all-finite",
        _set("stages.0.tensors.0.name", "w\u200b"),
        True,
    ),
    (
        "JSON_INTEGER_OUT_OF_RANGE",
        "continue-all-finite",
        _set("binding.model.parameters", 2**60),
        False,
    ),
]


def _bundle(tmp_path: Path, fixture: str, edit: Callable[[Manifest], None], reseal: bool) -> Path:
    bundle = tmp_path / "bundle"
    shutil.copytree(FIXTURES / fixture, bundle)
    manifest = json.loads((bundle / "manifest.json").read_bytes())
    edit(manifest)
    if reseal:
        manifest["evidence_content_id"] = evidence_content_id(manifest)
    (bundle / "manifest.json").write_bytes(orjson.dumps(manifest))
    return bundle


def _check_codes(bundle: Path) -> set[str]:
    with pytest.raises(EvidenceRejected) as caught:
        check_bundle(bundle)
    return set(caught.value.codes)


def _ids(table: list[tuple[str, str, Callable[[Manifest], None], bool]]) -> list[str]:
    return [f"{code}-{index}" for index, (code, *_) in enumerate(table)]


@pytest.mark.parametrize(
    ("code", "fixture", "edit", "reseal"), SCHEMA_REJECTS, ids=_ids(SCHEMA_REJECTS)
)
def test_schema_rejects_what_it_claims(
    tmp_path: Path, code: str, fixture: str, edit: Callable[[Manifest], None], reseal: bool
) -> None:
    bundle = _bundle(tmp_path, fixture, edit, reseal)
    assert code in _check_codes(bundle)
    assert schema_errors(json.loads((bundle / "manifest.json").read_bytes())), code


@pytest.mark.parametrize(
    ("code", "fixture", "edit", "reseal"), CONTRACT_ONLY, ids=_ids(CONTRACT_ONLY)
)
def test_contract_only_rules_pass_the_schema(
    tmp_path: Path, code: str, fixture: str, edit: Callable[[Manifest], None], reseal: bool
) -> None:
    bundle = _bundle(tmp_path, fixture, edit, reseal)
    assert code in _check_codes(bundle)
    assert schema_errors(json.loads((bundle / "manifest.json").read_bytes())) == [], code


def test_every_fully_expressed_code_has_a_case() -> None:
    covered = {code for code, *_ in SCHEMA_REJECTS}
    assert covered == set(SCHEMA_CODES)


def test_partial_codes_have_a_case_the_schema_misses() -> None:
    missed = {code for code, *_ in CONTRACT_ONLY}
    assert set(PARTIAL_CODES) - {"JSON_CONTROL_CHARACTER"} <= missed


# --------------------------------------------------- manifests check accepts


def _scaled_dynamic_writer(found_inf: bool) -> BundleWriter:
    writer = BundleWriter(
        run_id="run-schema",
        step=7,
        incident_owner="ml-oncall",
        binding={
            "model": {"id": "m", "note": "détails é", "layers": 2, "lr": 1e-3},
            "checkpoint": {"id": "c"},
            "data": {"id": "d"},
            "batch": {"id": "b"},
            "loader_cursor": {"id": "l"},
            "objective": {"id": "o", "reduction": "sum"},
            "optimizer": {"id": "opt"},
            "scheduler": {"id": "s"},
            "scaler": {
                "id": "gs",
                "mode": "dynamic",
                "scale": 2.0**-24 if found_inf else 2**24,
                "growth_factor": 2,
                "backoff_factor": 0.5,
                "found_inf": found_inf,
                "step_skipped": found_inf,
                "scale_after": 2.0**-25 if found_inf else 2**24,
            },
            "random_state": {"id": "r"},
            "environment": {"id": "e"},
            "topology": {"id": "t", "world_size": 4, "rank": 3},
            "precision": {"id": "p", "param_dtype": "BF16", "compute_dtype": "F8_E4M3"},
        },
        last_known_good={
            "checkpoint_id": "c",
            "step": 0,
            "verified_together": ["data_position", "scaler", "scheduler", "optimizer", "model"],
        },
    )
    writer.observe(
        "input", [("x", np.zeros((0, 3), dtype="float32"), "")], owner="o", probe_source=""
    )
    writer.observe(
        "forward", [("h", np.arange(3, dtype="int64"), "p")], owner="o", probe_source="p"
    )
    writer.observe("loss", [("l", np.float32(1.5), "p")], owner="o", probe_source="p")
    grad = np.array([1.0, np.inf if found_inf else 2.0], dtype="float16")
    writer.observe(
        "backward",
        [("g", grad, "p")],
        owner="o",
        probe_source="p",
        gradients="scaled",
    )
    if found_inf:
        writer.not_run("optimizer", owner="o", reason="skipped")
    else:
        writer.observe(
            "optimizer", [("u", np.ones(2, dtype="float64"), "p")], owner="o", probe_source="p"
        )
    return writer


@pytest.mark.parametrize("found_inf", [False, True])
def test_edge_manifests_check_accepts_also_validate(tmp_path: Path, found_inf: bool) -> None:
    """Empty free text, zero-element tensors, extreme safe scales, integer-only stages,
    detail fields of every allowed kind, any order of verified_together, reason on OBSERVED."""
    writer = _scaled_dynamic_writer(found_inf)
    bundle = writer.write(tmp_path / "bundle")
    manifest = json.loads((bundle / "manifest.json").read_bytes())
    manifest["stages"][0]["reason"] = "an OBSERVED stage may say why"
    manifest["evidence_content_id"] = evidence_content_id(manifest)
    (bundle / "manifest.json").write_bytes(orjson.dumps(manifest))
    check_bundle(bundle)
    assert schema_errors(manifest) == []
    assert schema_errors(copy.deepcopy(manifest) | {"format": "x"})

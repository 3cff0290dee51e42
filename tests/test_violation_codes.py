"""Every violation code, produced end to end by check_bundle on a broken bundle.

Each case starts from a valid fixture and breaks one rule; the test asserts the
code appears among the violations (a rule may imply others) and that the
evidence is rejected, never judged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bundlekit import copy_fixture, load, read_tensor_file, save, write_tensor_file

from nanrunbook import Caps, EvidenceRejected, check_bundle
from nanrunbook.capture import _state_manifest, recovery
from nanrunbook.codes import CAPSULE_CODES, CODES
from nanrunbook.errors import quote
from nanrunbook.verdict import incident_set, merge

Case = Callable[[Path, pytest.MonkeyPatch], "tuple[Path, Caps | None]"]
CASES: dict[str, Case] = {}


def case(code: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        assert code not in CASES, code
        CASES[code] = fn
        return fn

    return register


def edited(
    tmp: Path,
    change: Callable[[dict[str, Any]], None],
    *,
    fixture: str = "continue-all-finite",
    reseal: bool = True,
) -> Path:
    bundle = copy_fixture(tmp, fixture)
    manifest = load(bundle)
    change(manifest)
    save(bundle, manifest, reseal=reseal)
    return bundle


def raw_manifest(tmp: Path, text: bytes) -> Path:
    bundle = copy_fixture(tmp)
    (bundle / "manifest.json").write_bytes(text)
    return bundle


def text_edit(tmp: Path, old: str, new: str) -> Path:
    bundle = copy_fixture(tmp)
    text = (bundle / "manifest.json").read_text()
    assert old in text
    (bundle / "manifest.json").write_text(text.replace(old, new, 1))
    return bundle


def header_edit(tmp: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    bundle = copy_fixture(tmp)
    header, data = read_tensor_file(bundle)
    change(header)
    write_tensor_file(bundle, header, data)
    return bundle


def scaler(**fields: Any) -> dict[str, Any]:
    base = {
        "id": "gradscaler",
        "mode": "dynamic",
        "scale": 1024,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "found_inf": False,
        "step_skipped": False,
        "scale_after": 1024,
    }
    base.update(fields)
    return base


def stage(m: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in m["stages"] if s["stage"] == name)


def not_run(record: dict[str, Any], reason: str = "did not run") -> None:
    for key in ("resolution", "tensors", "counts", "finite_max_abs"):
        record.pop(key, None)
    record.update(status="NOT_RUN", reason=reason)


# ---- bundle and manifest file ------------------------------------------------


@case("BUNDLE_NOT_FOUND")
def _(tmp, mp):
    return tmp / "absent", None


@case("BUNDLE_NOT_DIRECTORY")
def _(tmp, mp):
    path = tmp / "file"
    path.write_text("{}")
    return path, None


@case("MANIFEST_MISSING")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    (bundle / "manifest.json").unlink()
    return bundle, None


@case("MANIFEST_UNREADABLE")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").mkdir()
    return bundle, None


@case("MANIFEST_TOO_LARGE")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    os.truncate(bundle / "manifest.json", 16 * 1024 * 1024 + 1)
    return bundle, None


@case("MANIFEST_NOT_UTF8")
def _(tmp, mp):
    return raw_manifest(tmp, b'{"format": "\xff"}'), None


@case("MANIFEST_INVALID_JSON")
def _(tmp, mp):
    return raw_manifest(tmp, b'{"format": '), None


@case("MANIFEST_TOO_DEEP")
def _(tmp, mp):
    return raw_manifest(tmp, b'{"x": ' + b"[" * 40 + b"]" * 40 + b"}"), None


@case("MANIFEST_NOT_OBJECT")
def _(tmp, mp):
    return raw_manifest(tmp, b"[]"), None


@case("JSON_DUPLICATE_KEY")
def _(tmp, mp):
    return text_edit(tmp, '"step": 1842', '"step": 1842, "step": 1842'), None


@case("JSON_NONFINITE_NUMBER")
def _(tmp, mp):
    return text_edit(tmp, '"step": 1842', '"step": Infinity'), None


@case("JSON_INTEGER_OUT_OF_RANGE")
def _(tmp, mp):
    return text_edit(tmp, '"step": 1842', '"step": 9007199254740992'), None


@case("JSON_CONTROL_CHARACTER")
def _(tmp, mp):
    return text_edit(tmp, '"probe": "batch', '"probe": "\\u001b[31mbatch'), None


@case("JSON_LONE_SURROGATE")
def _(tmp, mp):
    return text_edit(tmp, '"probe": "batch', '"probe": "\\ud800batch'), None


# ---- fields -------------------------------------------------------------------


@case("FIELD_MISSING")
def _(tmp, mp):
    return edited(tmp, lambda m: m.pop("incident_owner")), None


@case("FIELD_UNKNOWN")
def _(tmp, mp):
    return edited(tmp, lambda m: m["run"].update(attempt=2)), None


@case("FIELD_TYPE")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"]["topology"].update(world_size=True)), None


@case("FIELD_OUT_OF_RANGE")
def _(tmp, mp):
    return edited(tmp, lambda m: m["run"].update(step=-1)), None


@case("VALUE_NOT_ALLOWED")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"]["objective"].update(reduction="avg")), None


@case("IDENTIFIER_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["run"].update(run_id="run 1")), None


@case("TEXT_INVALID")
def _(tmp, mp):
    return edited(
        tmp, lambda m: m["stages"][0]["tensor_set"].update(probe_source="loader\u202eevil")
    ), None


@case("TENSOR_NAME_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["tensors"][0].update(name="x" * 257)), None


# ---- manifest ------------------------------------------------------------------


@case("FORMAT_UNSUPPORTED")
def _(tmp, mp):
    return edited(tmp, lambda m: m.update(format="nanrunbook-bundle/2")), None


@case("CONTRACT_VERSION_UNSUPPORTED")
def _(tmp, mp):
    return edited(tmp, lambda m: m.update(contract_version="training-incident-v2")), None


@case("EVIDENCE_CONTENT_ID_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m.update(evidence_content_id="sha256:abc"), reseal=False), None


@case("DIGEST_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["tensors"][0].update(sha256="AB" * 32)), None


@case("DTYPE_UNKNOWN")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"]["precision"].update(param_dtype="float32")), None


@case("SHAPE_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["tensors"][0].update(shape=[8, 8.0])), None


@case("LAST_KNOWN_GOOD_INCOMPLETE")
def _(tmp, mp):
    return edited(tmp, lambda m: m["last_known_good"]["verified_together"].remove("scaler")), None


@case("TOPOLOGY_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"]["topology"].update(world_size=2, rank=2)), None


@case("STAGES_NOT_FIVE")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"].pop()), None


@case("STAGE_FIELD_NOT_ALLOWED")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][1].update(gradients="unscaled")), None


@case("ENTRY_FIELD_NOT_ALLOWED")
def _(tmp, mp):
    return edited(
        tmp,
        lambda m: stage(m, "optimizer")["tensors"][0].update(file="tensors.safetensors"),
        fixture="hold-optimizer-summary",
    ), None


@case("TENSORS_EMPTY")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0].update(tensors=[])), None


@case("SCALER_FIELD_NOT_ALLOWED")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"]["scaler"].update(found_inf=False)), None


# ---- rules ------------------------------------------------------------------------


@case("LAST_KNOWN_GOOD_NOT_BEFORE_RUN")
def _(tmp, mp):
    return edited(tmp, lambda m: m["last_known_good"].update(step=1842)), None


@case("STAGE_ORDER")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"].reverse()), None


@case("TRANSITION_INPUT_NOT_OBSERVED")
def _(tmp, mp):
    def change(m: dict[str, Any]) -> None:
        for record in m["stages"]:
            not_run(record)

    return edited(tmp, change), None


@case("TRANSITION_NOT_RUN_WITHOUT_NONFINITE")
def _(tmp, mp):
    return edited(tmp, lambda m: not_run(stage(m, "optimizer"))), None


@case("TRANSITION_OBSERVED_AFTER_NOT_RUN")
def _(tmp, mp):
    def change(m: dict[str, Any]) -> None:
        optimizer = stage(m, "optimizer")
        optimizer.pop("reason")
        optimizer.update(
            status="OBSERVED",
            resolution="summary",
            tensors=[{"name": "opt/state", "dtype": "F32", "shape": [4], "probe": "state"}],
            counts={"elements": 4, "finite": 4, "nan": 0, "posinf": 0, "neginf": 0},
        )

    return edited(tmp, change, fixture="hold-loss"), None


@case("TELEMETRY_ID_DUPLICATE")
def _(tmp, mp):
    return edited(
        tmp, lambda m: m["stages"][1].update(telemetry_id=m["stages"][0]["telemetry_id"])
    ), None


@case("TENSOR_SET_ID_DUPLICATE")
def _(tmp, mp):
    return edited(
        tmp, lambda m: m["stages"][2]["tensor_set"].update(id=m["stages"][0]["tensor_set"]["id"])
    ), None


@case("TENSOR_NAME_DUPLICATE")
def _(tmp, mp):
    return edited(
        tmp,
        lambda m: m["stages"][2]["tensors"][0].update(name=m["stages"][0]["tensors"][0]["name"]),
    ), None


@case("COUNTS_NOT_RECONCILED")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["counts"].update(nan=1)), None


@case("COUNTS_ELEMENTS_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["counts"].update(elements=73, finite=73)), None


@case("SUMMARY_SUB_RESOLUTION")
def _(tmp, mp):
    return edited(
        tmp,
        lambda m: stage(m, "optimizer")["counts"].update(elements=10, finite=7),
        fixture="hold-optimizer-summary",
    ), None


@case("FINITE_MAX_ABS_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0].update(finite_max_abs=-1.0)), None


@case("FINITE_MAX_ABS_EXCESSIVE")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0].update(finite_max_abs=4e38)), None


@case("FINITE_MAX_ABS_NULL_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0].update(finite_max_abs=None)), None


@case("GRADIENTS_SCALED_WITHOUT_SCALER")
def _(tmp, mp):
    return edited(tmp, lambda m: stage(m, "backward").update(gradients="scaled")), None


@case("SCALER_SCALE_NOT_ONE")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"]["scaler"].update(scale=2)), None


@case("SCALER_SCALE_UNSAFE")
def _(tmp, mp):
    return edited(
        tmp, lambda m: m["binding"].update(scaler=scaler(scale=2.0**25, scale_after=2.0**25))
    ), None


@case("SCALER_FACTOR_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"].update(scaler=scaler(backoff_factor=1.0))), None


@case("SCALER_TRANSITION_INVALID")
def _(tmp, mp):
    return edited(tmp, lambda m: m["binding"].update(scaler=scaler(scale_after=4096))), None


@case("SCALER_FOUND_INF_MISMATCH")
def _(tmp, mp):
    return edited(
        tmp,
        lambda m: m["binding"].update(
            scaler=scaler(found_inf=True, step_skipped=True, scale_after=512.0)
        ),
    ), None


@case("CAP_STAGE_TENSORS")
def _(tmp, mp):
    return copy_fixture(tmp), Caps(max_stage_tensors=1)


@case("CAP_STAGE_ELEMENTS")
def _(tmp, mp):
    return copy_fixture(tmp), Caps(max_stage_elements=100)


@case("CAP_BUNDLE_ELEMENTS")
def _(tmp, mp):
    return copy_fixture(tmp), Caps(max_bundle_elements=500)


# ---- tensor files ----------------------------------------------------------------


@case("FILE_PATH_UNSAFE")
def _(tmp, mp):
    return edited(
        tmp, lambda m: m["stages"][0]["tensors"][0].update(file="../tensors.safetensors")
    ), None


@case("FILE_MISSING")
def _(tmp, mp):
    return edited(
        tmp, lambda m: m["stages"][0]["tensors"][0].update(file="other.safetensors")
    ), None


@case("FILE_OUTSIDE_BUNDLE")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    (tmp / "outside.safetensors").write_bytes((bundle / "tensors.safetensors").read_bytes())
    (bundle / "tensors.safetensors").unlink()
    (bundle / "tensors.safetensors").symlink_to(tmp / "outside.safetensors")
    return bundle, None


@case("FILE_NOT_REGULAR")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    (bundle / "tensors.safetensors").unlink()
    os.mkfifo(bundle / "tensors.safetensors")
    return bundle, None


@case("FILE_UNREADABLE")
def _(tmp, mp):
    import nanrunbook.tensors.safetensors as tensorfile

    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith("tensors.safetensors"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    mp.setattr(tensorfile.os, "open", refuse)
    return copy_fixture(tmp), None


@case("HEADER_LENGTH_INVALID")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    data = bytearray((bundle / "tensors.safetensors").read_bytes())
    data[:8] = b"\xff" * 8
    (bundle / "tensors.safetensors").write_bytes(bytes(data))
    return bundle, None


@case("HEADER_NOT_UTF8")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    header, data = read_tensor_file(bundle)
    text = json.dumps(header).encode().replace(b'"loss"', b'"lo\xffss"')
    write_tensor_file(bundle, text, data)
    return bundle, None


@case("HEADER_INVALID_JSON")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    header, data = read_tensor_file(bundle)
    write_tensor_file(bundle, json.dumps(header).encode() + b"\n", data)
    return bundle, None


@case("HEADER_DUPLICATE_NAME")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    header, data = read_tensor_file(bundle)
    loss = json.dumps(header["loss"]).encode()
    text = json.dumps(header).encode()[:-1] + b', "loss": ' + loss + b"}"
    write_tensor_file(bundle, text, data)
    return bundle, None


@case("HEADER_FIELD_UNKNOWN")
def _(tmp, mp):
    return header_edit(tmp, lambda h: h["loss"].update(offset=0)), None


@case("HEADER_FIELD_INVALID")
def _(tmp, mp):
    return header_edit(tmp, lambda h: h.update(__metadata__={"step": 1842})), None


@case("HEADER_DTYPE_UNKNOWN")
def _(tmp, mp):
    return header_edit(tmp, lambda h: h["loss"].update(dtype="F128")), None


@case("HEADER_LENGTH_MISMATCH")
def _(tmp, mp):
    return header_edit(tmp, lambda h: h["loss"].update(shape=[2])), None


@case("HEADER_SUBBYTE_ALIGNMENT")
def _(tmp, mp):
    return header_edit(tmp, lambda h: h["loss"].update(dtype="F4", shape=[7])), None


@case("HEADER_OFFSETS_INVALID")
def _(tmp, mp):
    def change(h: dict[str, Any]) -> None:
        begin, end = h["loss"]["data_offsets"]
        h["loss"]["data_offsets"] = [begin + 4, end + 4]

    return header_edit(tmp, change), None


@case("FILE_TRUNCATED")
def _(tmp, mp):
    bundle = copy_fixture(tmp)
    path = bundle / "tensors.safetensors"
    os.truncate(path, path.stat().st_size - 5)
    return bundle, None


# ---- binding and recount ------------------------------------------------------------


@case("TENSOR_NOT_IN_FILE")
def _(tmp, mp):
    return edited(tmp, lambda m: stage(m, "loss")["tensors"][0].update(name="loss/renamed")), None


@case("TENSOR_UNBOUND")
def _(tmp, mp):
    def change(m: dict[str, Any]) -> None:
        forward = stage(m, "forward")
        dropped = forward["tensors"].pop()
        elements = 1
        for dim in dropped["shape"]:
            elements *= dim
        forward["counts"]["elements"] -= elements
        forward["counts"]["finite"] -= elements

    return edited(tmp, change), None


@case("TENSOR_DTYPE_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: stage(m, "loss")["tensors"][0].update(dtype="C64")), None


@case("TENSOR_SHAPE_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["tensors"][0].update(shape=[64])), None


@case("DIGEST_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: stage(m, "loss")["tensors"][0].update(sha256="0" * 64)), None


@case("COUNTS_RECOUNT_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: m["stages"][0]["counts"].update(finite=71, posinf=1)), None


@case("FINITE_MAX_ABS_RECOUNT_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: stage(m, "loss").update(finite_max_abs=1.5)), None


@case("FILE_CHANGED")
def _(tmp, mp):
    import nanrunbook.tensors.verify as bundle_module
    from nanrunbook.tensors.scan import ShortRead

    def shrunk(*args: Any, **kwargs: Any) -> Any:
        raise ShortRead(0, 4, 0)

    mp.setattr(bundle_module, "scan_range", shrunk)
    return copy_fixture(tmp), None


@case("EVIDENCE_CONTENT_ID_MISMATCH")
def _(tmp, mp):
    return edited(tmp, lambda m: m.update(incident_owner="someone-else"), reseal=False), None


# Covered where they can arise, outside check_bundle: RECORD_INCONSISTENT by
# test_check.py (decide() on altered records), seal codes by test_seal.py, the
# incident-set and merge codes by test_incident_set.py.
ELSEWHERE = {"RECORD_INCONSISTENT"} | set(incident_set.CODES) | set(merge.CODES)
ELSEWHERE |= set(_state_manifest.CODES)  # state directories: test_state_dir.py
ELSEWHERE |= set(CAPSULE_CODES)  # capsules: test_capsule.py
ELSEWHERE |= set(recovery.CODES)  # recovery points: test_recovery.py


@pytest.mark.parametrize("code", sorted(CASES))
def test_code_is_emitted(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle, caps = CASES[code](tmp_path, monkeypatch)
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle, caps=caps)
    assert code in info.value.codes, info.value.violations
    for violation in info.value.violations:
        assert violation.code in CODES
        assert "\n" not in violation.message and violation.message
        # issue 10: a message never repeats its own where (the file it names) as a
        # prefix or quoted ("tensors.safetensors: 'tensors.safetensors': tensor ...")
        assert not violation.message.startswith(violation.where), violation
        assert quote(violation.where) not in violation.message, violation


def test_every_code_has_a_case() -> None:
    seal_codes = {c for c in CODES if c.startswith("SEAL_")}
    assert set(CODES) - seal_codes - ELSEWHERE == set(CASES)


def test_every_code_is_tested_somewhere() -> None:
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    missing = [code for code in CODES if f'"{code}"' not in tests]
    assert missing == []


def test_a_tensor_file_cut_short_is_one_violation(tmp_path: Path) -> None:
    """Issue 10 item 7: every tensor of the file lost data, one violation says why."""
    bundle = copy_fixture(tmp_path)
    path = bundle / "tensors.safetensors"
    size = path.stat().st_size
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    os.truncate(path, header_end)  # every tensor's data gone
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    (violation,) = info.value.violations
    assert (violation.code, violation.where) == ("FILE_TRUNCATED", "tensors.safetensors")
    assert f"has {header_end} bytes but its header's byte ranges need {size}" in violation.message


def test_a_malformed_content_id_is_reported_once(tmp_path: Path) -> None:
    bundle = edited(tmp_path, lambda m: m.update(evidence_content_id="sha256:abc"), reseal=False)
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert info.value.codes == ("EVIDENCE_CONTENT_ID_INVALID",)


@pytest.mark.parametrize("suffix", ["/", "/."])
def test_a_file_path_naming_a_directory_is_not_a_file(tmp_path: Path, suffix: str) -> None:
    def change(m: dict[str, Any]) -> None:
        for record in m["stages"]:
            for tensor in record["tensors"]:
                tensor["file"] += suffix

    with pytest.raises(EvidenceRejected) as info:
        check_bundle(edited(tmp_path, change))
    assert set(info.value.codes) == {"FILE_NOT_REGULAR"}


def test_a_bundle_path_with_control_characters_is_quoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a short path: a long one is cut, with an ellipsis
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(Path("no\x1b[31mbundle\u202e"))
    (violation,) = info.value.violations
    assert violation.code == "BUNDLE_NOT_FOUND"
    assert violation.where.isprintable() and violation.where.isascii()


# ARCHITECTURE.md: the shared vocabulary at the top level imports nothing above it.
VOCABULARY = ("errors", "records", "dtypes", "contract", "codes", "warning_codes", "exits")
VOCABULARY += ("strictjson",)


@pytest.mark.parametrize("name", VOCABULARY)
def test_the_shared_vocabulary_imports_nothing_above_it(name: str) -> None:
    """In a fresh interpreter the module loads no module of a package below the
    top (manifest, tensors, verdict, capture, ...): the catalogue of codes too."""
    script = (
        "import json, sys\n"
        f"import nanrunbook.{name}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('nanrunbook.'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    below = [m for m in json.loads(done.stdout) if m.count(".") > 1 or _is_package(m)]
    assert below == []


def _is_package(module: str) -> bool:
    return (Path(__file__).parents[1] / module.replace(".", "/") / "__init__.py").exists()

"""``nanrunbook seal``: fills and verifies digests of a foreign manifest, then checks it."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bundlekit import FIXTURES, copy_fixture, load, read_tensor_file, save, write_tensor_file

import nanrunbook.capture.atomic
import nanrunbook.capture.seal as seal_module
from nanrunbook import EvidenceRejected, check_bundle
from nanrunbook.capture.seal import seal_bundle
from nanrunbook.cli.seal import seal_and_judge as seal_command
from nanrunbook.codes import CODES
from nanrunbook.manifest.content_id import evidence_content_id

EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
VALID = sorted(name for name, e in EXPECTED.items() if e["exit"] != 3)
CLI = [sys.executable, "-m", "nanrunbook"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def unsealed(tmp: Path, fixture: str = "continue-all-finite") -> Path:
    """A fixture as another tool would write it: no tensor digests, no content id."""
    bundle = copy_fixture(tmp, fixture)
    manifest = load(bundle)
    for stage in manifest["stages"]:
        for entry in stage.get("tensors", []):
            entry.pop("sha256", None)
    del manifest["evidence_content_id"]
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=4))
    return bundle


def keys_in_order(value: Any, path: str = "$") -> list[tuple[str, list[str]]]:
    """Every object's key order, depth first."""
    found: list[tuple[str, list[str]]] = []
    if isinstance(value, dict):
        found.append((path, list(value)))
        for key, item in value.items():
            found.extend(keys_in_order(item, f"{path}.{key}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(keys_in_order(item, f"{path}[{index}]"))
    return found


def seal_cli(bundle: Path, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = seal_command(
        bundle,
        force="--force" in args,
        format="kv" if "kv" in args else "text",
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


# ---- filling -------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALID)
def test_seal_fills_what_the_writer_would_have_written(name: str, tmp_path: Path) -> None:
    bundle = unsealed(tmp_path, name)
    result = seal_bundle(bundle)
    assert result.written and result.content_id == "filled"
    complete = sum(
        len(s["tensors"])
        for s in load(FIXTURES / name)["stages"]
        if s.get("resolution") == "complete"
    )
    assert (result.filled, result.verified, result.replaced) == (complete, 0, 0)
    sealed = load(bundle)
    assert sealed == load(FIXTURES / name)  # every digest and the content id, exactly
    # sha256 lands where the writer puts it; the content id after evidence_id (spec order).
    fixture = load(FIXTURES / name)
    assert keys_in_order(sealed)[1:] == keys_in_order(fixture)[1:]
    assert list(sealed) == [
        "format",
        "contract_version",
        "evidence_id",
        "evidence_content_id",
        *(
            k
            for k in fixture
            if k not in ("format", "contract_version", "evidence_id", "evidence_content_id")
        ),
    ]
    code, out, err = seal_cli(bundle, "kv")  # a second seal verifies and changes nothing
    assert code == EXPECTED[name]["exit"]
    assert f"earliest_nonfinite={EXPECTED[name]['earliest_nonfinite_stage'] or 'none'}" in out
    assert "nothing to change" in err


def test_summary_entries_get_no_digest(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path, "hold-optimizer-summary")
    seal_bundle(bundle)
    summary = next(s for s in load(bundle)["stages"] if s.get("resolution") == "summary")
    assert all("sha256" not in entry and "file" not in entry for entry in summary["tensors"])
    assert check_bundle(bundle).decision.earliest_nonfinite_stage == "optimizer"


def test_verified_bundle_is_not_rewritten(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path, "hold-backward-dynamic-skip")
    before = os.stat(bundle / "manifest.json")
    raw = (bundle / "manifest.json").read_bytes()
    result = seal_bundle(bundle)
    assert not result.written and result.content_id == "verified" and result.verified == 7
    after = os.stat(bundle / "manifest.json")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert (bundle / "manifest.json").read_bytes() == raw


def test_producer_key_order_is_kept(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path)
    manifest = load(bundle)

    def reverse(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: reverse(v) for k, v in reversed(list(value.items()))}
        if isinstance(value, list):
            return [reverse(v) for v in value]
        return value

    producer = reverse(manifest)
    (bundle / "manifest.json").write_text(json.dumps(producer))  # compact, no newline
    seal_bundle(bundle)
    raw = (bundle / "manifest.json").read_bytes()
    assert b"\n" not in raw  # a compact manifest stays compact
    sealed = json.loads(raw)
    assert sealed == load(FIXTURES / "continue-all-finite")  # same content
    assert list(sealed)[-1] == "format"
    assert list(sealed).index("evidence_content_id") == list(sealed).index("evidence_id") + 1
    for (path, keys), (_, original) in zip(
        keys_in_order(sealed), keys_in_order(producer), strict=True
    ):
        added = {"sha256", "evidence_content_id"}
        assert [k for k in keys if k not in added] == original, path
    check_bundle(bundle)


def test_trailing_newline_is_kept(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path)
    path = bundle / "manifest.json"
    path.write_bytes(path.read_bytes() + b"\n")
    seal_bundle(bundle)
    assert path.read_bytes().endswith(b"}\n")
    check_bundle(bundle)


def test_content_id_of_the_manifest_as_given_is_resealed(tmp_path: Path) -> None:
    """A producer that sealed its manifest before digests existed: the id sealed
    what was there, so adding the digests reseals it; nothing differs."""
    bundle = unsealed(tmp_path)
    manifest = load(bundle)
    manifest["evidence_content_id"] = evidence_content_id(manifest)
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    result = seal_bundle(bundle)
    assert result.content_id == "resealed"
    assert load(bundle) == load(FIXTURES / "continue-all-finite")


# ---- refusing --------------------------------------------------------------------------


def test_differing_digest_refused_then_forced(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path, "hold-input")
    manifest = load(bundle)
    true_digest = manifest["stages"][0]["tensors"][0]["sha256"]
    manifest["stages"][0]["tensors"][0]["sha256"] = "0" * 64
    save(bundle, manifest)  # a consistent content id over a wrong digest
    raw = (bundle / "manifest.json").read_bytes()

    code, out, err = seal_cli(bundle)
    assert code == 3 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(
        "nanrunbook: seal refused: SEAL_VALUE_DIFFERS $.stages[0].tensors[0].sha256"
    )
    assert (bundle / "manifest.json").read_bytes() == raw

    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_VALUE_DIFFERS",)

    code, out, err = seal_cli(bundle, "--force", "kv")
    assert code == 1 and "earliest_nonfinite=input" in out
    assert "1 replaced" in err
    assert load(bundle)["stages"][0]["tensors"][0]["sha256"] == true_digest


def test_differing_content_id_refused_then_forced(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    manifest = load(bundle)
    manifest["incident_owner"] = "another-owner"
    save(bundle, manifest, reseal=False)  # edited after sealing
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_VALUE_DIFFERS",)
    assert info.value.violations[0].where == "$.evidence_content_id"
    result = seal_bundle(bundle, force=True)
    assert result.content_id == "replaced" and result.written
    assert check_bundle(bundle).manifest.incident_owner == "another-owner"


def test_every_differing_value_is_listed(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    manifest = load(bundle)
    for stage in manifest["stages"][:2]:
        stage["tensors"][0]["sha256"] = "f" * 64
    save(bundle, manifest, reseal=False)
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert [v.where for v in info.value.violations] == [
        "$.stages[0].tensors[0].sha256",
        "$.stages[1].tensors[0].sha256",
        "$.evidence_content_id",
    ]


@pytest.mark.parametrize(
    ("text_edit", "code"),
    [
        (
            lambda t: t.replace('"step": 1842', '"step": 1842, "step": 1843', 1),
            "JSON_DUPLICATE_KEY",
        ),
        (
            lambda t: t.replace('"finite_max_abs": 2.0', '"finite_max_abs": NaN', 1),
            "JSON_NONFINITE_NUMBER",
        ),
        (
            lambda t: t.replace('"size": 8', '"size": 90071992547409930', 1),
            "JSON_INTEGER_OUT_OF_RANGE",
        ),
        (lambda t: t + "]", "MANIFEST_INVALID_JSON"),
    ],
)
def test_strict_parser_refuses_before_anything(tmp_path: Path, text_edit: Any, code: str) -> None:
    bundle = unsealed(tmp_path)
    path = bundle / "manifest.json"
    text = json.dumps(load(bundle), indent=2)
    edited = text_edit(text)
    assert edited != text
    path.write_text(edited)
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert code in info.value.codes
    assert path.read_text() == edited


def test_missing_tensor_file(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path)
    (bundle / "tensors.safetensors").unlink()
    raw = (bundle / "manifest.json").read_bytes()
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_TENSOR_UNREADABLE",)
    assert "FILE_MISSING" in info.value.violations[0].message
    assert (bundle / "manifest.json").read_bytes() == raw


def test_tensor_absent_from_its_file(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path)
    manifest = load(bundle)
    manifest["stages"][2]["tensors"][0]["name"] = "loss-renamed"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_TENSOR_UNREADABLE",)
    assert info.value.violations[0].where == "$.stages[2].tensors[0]"


def test_symlink_out_of_the_bundle_is_not_followed(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path)
    outside = tmp_path / "outside.safetensors"
    (bundle / "tensors.safetensors").rename(outside)
    (bundle / "tensors.safetensors").symlink_to(outside)
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_TENSOR_UNREADABLE",)
    assert "FILE_OUTSIDE_BUNDLE" in info.value.violations[0].message


def test_malformed_header_is_refused(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path)
    header, data = read_tensor_file(bundle)
    header["loss"]["extra"] = 1
    write_tensor_file(bundle, header, data)
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_TENSOR_UNREADABLE",)
    assert "HEADER_FIELD_UNKNOWN" in info.value.violations[0].message


def test_manifest_changed_while_sealing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = unsealed(tmp_path)
    real = seal_module.read_manifest_bytes
    calls = []

    def changing(path: Path) -> bytes:
        calls.append(path)
        raw = real(path)
        return raw if len(calls) == 1 else raw + b" "

    monkeypatch.setattr(seal_module, "read_manifest_bytes", changing)
    with pytest.raises(EvidenceRejected) as info:
        seal_bundle(bundle)
    assert info.value.codes == ("SEAL_MANIFEST_CHANGED",)


def test_failed_rewrite_leaves_the_manifest_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = unsealed(tmp_path)
    raw = (bundle / "manifest.json").read_bytes()
    names = sorted(p.name for p in bundle.iterdir())

    def no_space(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nanrunbook.capture.atomic.os, "replace", no_space)
    with pytest.raises(OSError):
        seal_bundle(bundle)
    assert (bundle / "manifest.json").read_bytes() == raw
    assert sorted(p.name for p in bundle.iterdir()) == names


def test_seal_then_check_rejects_what_seal_does_not_own(tmp_path: Path) -> None:
    """Seal fills digests; the check still judges every other rule (exit 3)."""
    bundle = unsealed(tmp_path)
    manifest = load(bundle)
    manifest["stages"][0]["counts"]["finite"] -= 1
    manifest["stages"][0]["counts"]["nan"] += 1
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = seal_cli(bundle, "kv")
    assert code == 3
    assert "decision=REJECTED" in out and "violation=COUNTS_RECOUNT_MISMATCH" in out
    complete = sum(len(s["tensors"]) for s in manifest["stages"])
    assert f"{complete} tensor digests filled" in err


def test_seal_codes_are_catalogued() -> None:
    assert set(seal_module.CODES) <= set(CODES)
    assert set(seal_module.CODES) == {
        "SEAL_VALUE_DIFFERS",
        "SEAL_TENSOR_UNREADABLE",
        "SEAL_MANIFEST_CHANGED",
    }


# ---- the command ------------------------------------------------------------------------


def test_cli_seal_exit_codes_and_streams(tmp_path: Path) -> None:
    bundle = unsealed(tmp_path, "hold-backward-dynamic-skip")
    done = run("seal", str(bundle), "--format", "kv")
    assert done.returncode == 1, done.stderr
    assert "earliest_nonfinite=backward" in done.stdout
    assert done.stderr.startswith("nanrunbook: sealed ") and done.stderr.count("\n") == 1
    assert run("check", str(bundle)).returncode == 1

    continuing = unsealed(tmp_path / "c")
    assert run("seal", str(continuing)).returncode == 0

    refused = run("seal", str(tmp_path / "missing"))
    assert refused.returncode == 3 and refused.stdout == ""
    assert refused.stderr.startswith("nanrunbook: seal refused: BUNDLE_NOT_FOUND")
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr


def test_cli_seal_help_has_an_example() -> None:
    done = run("seal", "--help")
    assert done.returncode == 0
    assert "Example: nanrunbook seal" in done.stdout and "--force" in done.stdout


# ---- the header bound is check's ------------------------------------------------------


def pad_header(bundle: Path, length: int) -> None:
    """Rewrite the tensor file with its header padded by spaces to ``length`` bytes."""
    header, data = read_tensor_file(bundle)
    text = json.dumps(header).encode()
    raw = struct.pack("<Q", length) + text + b" " * (length - len(text)) + data
    (bundle / "tensors.safetensors").write_bytes(raw)


def bound_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        entry
        for stage in manifest["stages"]
        if stage["status"] == "OBSERVED" and stage.get("resolution") == "complete"
        for entry in stage["tensors"]
    ]


@pytest.mark.parametrize("spellings", [False, True])
@pytest.mark.parametrize("over", [0, 8])
def test_seal_bounds_headers_as_check_does(tmp_path: Path, over: int, spellings: bool) -> None:
    """Spec section 1: 4 MiB + 4 KiB per entry the manifest binds to the file, for
    every command; two spellings of one path bind to one file."""
    sealed_bundle = copy_fixture(tmp_path / "sealed")
    bundle = unsealed(tmp_path / "unsealed")
    for target in (sealed_bundle, bundle):
        manifest = load(target)
        entries = bound_entries(manifest)
        assert len(entries) > 1 and all(e["file"] == "tensors.safetensors" for e in entries)
        if spellings:
            entries[0]["file"] = "./tensors.safetensors"
            save(target, manifest, reseal="evidence_content_id" in manifest)
        pad_header(target, 4 * 1024 * 1024 + 4096 * len(entries) + over)
    if over:
        with pytest.raises(EvidenceRejected) as refused:
            seal_bundle(bundle)
        assert refused.value.codes == ("SEAL_TENSOR_UNREADABLE",)
        assert "HEADER_LENGTH_INVALID" in refused.value.violations[0].message
        assert not any("sha256" in entry for entry in bound_entries(load(bundle)))
        with pytest.raises(EvidenceRejected) as rejected:
            check_bundle(sealed_bundle)
        assert rejected.value.codes == ("HEADER_LENGTH_INVALID",)
    else:
        seal_bundle(bundle)
        for target in (bundle, sealed_bundle):
            assert check_bundle(target).decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"


# ---- what a refusal and a forced seal say (found in independent testing) ------------


def wrong_digest(tmp_path: Path) -> Path:
    bundle = copy_fixture(tmp_path, "hold-input")
    manifest = load(bundle)
    manifest["stages"][0]["tensors"][0]["sha256"] = "0" * 64
    save(bundle, manifest)
    return bundle


def test_refusal_names_force_and_kv_gets_a_decision(tmp_path: Path) -> None:
    bundle = wrong_digest(tmp_path)
    done = run("seal", str(bundle), "--format", "kv")
    assert done.returncode == 3
    assert "--force" in done.stderr and done.stderr.count("\n") == 1
    lines = done.stdout.splitlines()
    assert lines[2:4] == ["decision=REJECTED", "violations=1"]
    assert lines[4] == "violation=SEAL_VALUE_DIFFERS $.stages[0].tensors[0].sha256"
    as_json = json.loads(run("seal", str(bundle), "--format", "json").stdout)
    assert as_json["decision"] == "REJECTED" and as_json["exit_code"] == 3


def test_forced_seal_says_loudly_what_it_overwrote(tmp_path: Path) -> None:
    bundle = wrong_digest(tmp_path)
    done = run("seal", str(bundle), "--force", "--format", "kv")
    assert done.returncode == 1
    assert "original evidence did not verify" in done.stderr
    assert f"$.stages[0].tensors[0].sha256: recorded '{'0' * 64}'" in done.stderr


def test_differing_content_id_is_shown_whole(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    manifest = load(bundle)
    manifest["incident_owner"] = "another-owner"
    save(bundle, manifest, reseal=False)
    declared = manifest["evidence_content_id"]
    done = run("seal", str(bundle))
    assert done.returncode == 3
    assert declared in done.stderr and "\\u2026" not in done.stderr

"""The contract document's bounds are the bounds the checks enforce.

Changing an enforced constant where it is defined changes the contract
document and so ``contract_content_id``; and each bound the document states
is the one a check applies at its edge.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from bundlekit import copy_fixture, load, save

from nanrunbook import EvidenceRejected, access, check_bundle, contract, strictjson
from nanrunbook.contract import contract_content_id, contract_document
from nanrunbook.strictjson import load_manifest_bytes

# (module, constant, bounds key): every bound the document states, at its home.
HOMES = [
    (access, "MANIFEST_MAX_BYTES", "manifest_max_bytes"),
    (strictjson, "MAX_DEPTH", "manifest_max_depth"),
    (strictjson, "MAX_SAFE_INTEGER", "safe_integer_max"),
    (contract, "IDENTIFIER_PATTERN", "identifier_pattern"),
    (contract, "MAX_FREE_TEXT", "free_text_max_chars"),
    (contract, "MAX_TENSOR_NAME", "tensor_name_max_chars"),
    (contract, "TENSOR_HEADER_MAX_BYTES", "tensor_header_max_bytes"),
    (contract, "SCALE_MIN_EXPONENT", "scale_min_exponent"),
    (contract, "SCALE_MAX_EXPONENT", "scale_max_exponent"),
]


def test_every_bound_of_the_document_has_a_home_here() -> None:
    assert {key for _, _, key in HOMES} == set(contract_document()["bounds"])


@pytest.mark.parametrize(("module", "name", "key"), HOMES, ids=[h[2] for h in HOMES])
def test_changing_an_enforced_bound_changes_the_contract_id(
    module: Any, name: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before_id = contract_content_id()
    before = contract_document()["bounds"][key]
    changed = "x" + before if isinstance(before, str) else before - 1
    monkeypatch.setattr(module, name, changed)
    after = contract_document()["bounds"][key]
    assert after != before
    assert contract_content_id() != before_id


def test_a_changed_depth_bound_is_enforced_and_stated(monkeypatch: pytest.MonkeyPatch) -> None:
    text = b'{"a": ' + b"[" * 19 + b"]" * 19 + b"}"  # 20 levels
    assert load_manifest_bytes(text)
    monkeypatch.setattr(strictjson, "MAX_DEPTH", 19)
    assert contract_document()["bounds"]["manifest_max_depth"] == 19
    with pytest.raises(EvidenceRejected) as info:
        load_manifest_bytes(text)
    assert info.value.codes == ("MANIFEST_TOO_DEEP",)


def _bundle(tmp: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    bundle = copy_fixture(tmp)
    manifest = load(bundle)
    change(manifest)
    try:
        save(bundle, manifest)
    except rfc8785.CanonicalizationError:  # past the safe integers: no id to seal
        save(bundle, manifest, reseal=False)
    return bundle


def _codes(bundle: Path) -> list[str]:
    try:
        check_bundle(bundle)
    except EvidenceRejected as err:
        return list(err.codes)
    return []


def _set_probe(text: str) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["stages"][0]["tensors"][0].update(probe=text)


def _set_name(text: str) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        m["stages"][0]["tensors"][0]["name"] = text

    return change


def _set_owner(text: str) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.update(incident_owner=text)


def _set_scale(exponent: int) -> Callable[[dict[str, Any]], None]:
    scale = 2.0**exponent
    return lambda m: m["binding"]["scaler"].update(mode="static", scale=scale)


def _set_step(value: int) -> Callable[[dict[str, Any]], None]:
    return lambda m: m["run"].update(step=value)


BOUNDS = contract_document()["bounds"]
# The pattern's own repeat bound: one leading character, then at most N more.
IDENTIFIER_MAX = 1 + int(re.search(r"\{0,(\d+)\}", BOUNDS["identifier_pattern"])[1])  # type: ignore[index]
# (what changes, the value at the bound, one past it, the code past it)
EDGES = [
    ("free text", _set_probe("p" * BOUNDS["free_text_max_chars"]),
     _set_probe("p" * (BOUNDS["free_text_max_chars"] + 1)), "TEXT_INVALID"),
    ("identifier", _set_owner("o" * IDENTIFIER_MAX), _set_owner("o" * (IDENTIFIER_MAX + 1)),
     "IDENTIFIER_INVALID"),
    ("scale high", _set_scale(BOUNDS["scale_max_exponent"]),
     _set_scale(BOUNDS["scale_max_exponent"] + 1), "SCALER_SCALE_UNSAFE"),
    ("scale low", _set_scale(BOUNDS["scale_min_exponent"]),
     _set_scale(BOUNDS["scale_min_exponent"] - 1), "SCALER_SCALE_UNSAFE"),
    ("safe integer", _set_step(BOUNDS["safe_integer_max"]),
     _set_step(BOUNDS["safe_integer_max"] + 1), "JSON_INTEGER_OUT_OF_RANGE"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "at", "past", "code"), EDGES, ids=[e[0] for e in EDGES])
def test_each_stated_bound_is_the_edge_the_check_enforces(
    tmp_path: Path,
    what: str,
    at: Callable[[dict[str, Any]], None],
    past: Callable[[dict[str, Any]], None],
    code: str,
) -> None:
    assert code not in _codes(_bundle(tmp_path / "at", at))
    assert code in _codes(_bundle(tmp_path / "past", past))


def test_the_tensor_name_bound_is_the_edge_the_check_enforces(tmp_path: Path) -> None:
    limit = BOUNDS["tensor_name_max_chars"]
    # A renamed entry no longer binds its file's tensor; only the name's own code matters.
    assert "TENSOR_NAME_INVALID" not in _codes(_bundle(tmp_path / "at", _set_name("n" * limit)))
    past = _codes(_bundle(tmp_path / "past", _set_name("n" * (limit + 1))))
    assert "TENSOR_NAME_INVALID" in past


def test_the_manifest_size_bound_is_the_edge_the_check_enforces(tmp_path: Path) -> None:
    limit = BOUNDS["manifest_max_bytes"]
    bundle = copy_fixture(tmp_path)
    text = json.dumps(load(bundle)).encode()
    (bundle / "manifest.json").write_bytes(text + b" " * (limit - len(text)))
    assert "MANIFEST_TOO_LARGE" not in _codes(bundle)
    (bundle / "manifest.json").write_bytes(text + b" " * (limit + 1 - len(text)))
    assert _codes(bundle) == ["MANIFEST_TOO_LARGE"]


@pytest.mark.parametrize("stated", [0, 1, 100])
def test_a_manifest_longer_than_its_stated_size_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stated: int
) -> None:
    """The manifest is read in one call of its stated size and a byte more: a file
    that grew after fstat is still read to its end, and bounded by the limit."""
    limit = BOUNDS["manifest_max_bytes"]
    bundle = copy_fixture(tmp_path)
    text = (bundle / "manifest.json").read_bytes()
    real_fstat = access.os.fstat

    class Shrunk:
        def __init__(self, fd: int) -> None:
            self.real = real_fstat(fd)

        def __getattr__(self, name: str) -> Any:
            return stated if name == "st_size" else getattr(self.real, name)

    monkeypatch.setattr(access.os, "fstat", Shrunk)
    assert access.read_manifest_bytes(bundle) == text
    (bundle / "manifest.json").write_bytes(text + b" " * (limit + 1 - len(text)))
    with pytest.raises(EvidenceRejected) as rejected:
        access.read_manifest_bytes(bundle)
    assert rejected.value.codes == ("MANIFEST_TOO_LARGE",)

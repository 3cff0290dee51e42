"""Test helpers: copy a fixture bundle, edit its manifest or tensor file, reseal."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import orjson

from nanrunbook.manifest.content_id import evidence_content_id

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TENSOR_FILE = "tensors.safetensors"


def copy_fixture(tmp_path: Path, name: str = "continue-all-finite") -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def load(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_bytes())


def save(bundle: Path, manifest: dict[str, Any], *, reseal: bool = True) -> None:
    if reseal:
        manifest["evidence_content_id"] = evidence_content_id(manifest)
    (bundle / "manifest.json").write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))


def read_tensor_file(bundle: Path, name: str = TENSOR_FILE) -> tuple[dict[str, Any], bytes]:
    raw = (bundle / name).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def header_bytes(header: dict[str, Any] | bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return text + b" " * (-len(text) % 8)


def write_tensor_file(
    bundle: Path, header: dict[str, Any] | bytes, data: bytes, name: str = TENSOR_FILE
) -> None:
    text = header_bytes(header)
    (bundle / name).write_bytes(struct.pack("<Q", len(text)) + text + data)

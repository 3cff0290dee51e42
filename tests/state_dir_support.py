"""Forging a state directory's manifest, for the tests that check it is refused."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson


def relist(point: Path, edit: Callable[[dict[str, Any]], Any] | None = None) -> None:
    """Rewrite the manifest as a forger would: digests that match the files
    (a link is left as listed), then ``edit`` applied to the manifest."""
    manifest = orjson.loads((point / "manifest.json").read_bytes())
    for name in list(manifest["files"]):
        full = point / name
        if full.is_file() and not full.is_symlink():
            data = full.read_bytes()
            manifest["files"][name] = {
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
            }
    if edit is not None:
        edit(manifest)
    (point / "manifest.json").write_bytes(orjson.dumps(manifest))

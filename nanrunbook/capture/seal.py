"""``nanrunbook seal``: fill and verify the digests of a manifest another tool wrote.

For every tensor entry of an OBSERVED ``complete`` stage that names a ``file``,
the tensor's bytes are hashed through the bundle's safe file access (the same
path resolution, header parser and bounded scanner ``check`` uses) and its
``sha256`` is filled in when missing, or verified when present. Then the
``evidence_content_id`` is filled in or verified. A value that is present and
differs is never replaced without ``force``: the seal refuses with
SEAL_VALUE_DIFFERS and writes nothing.

The manifest is parsed with the strict parser, edited in place (the producer's
key order is kept; a new key goes where the spec's field order puts it) and
rewritten atomically. ``check`` is the judge afterwards: seal fills what can be
computed and leaves every other rule to it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanrunbook.access import MANIFEST_NAME, open_in_bundle, read_manifest_bytes
from nanrunbook.capture.atomic import atomic_write
from nanrunbook.codes import SEAL_CODES as CODES
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.manifest.content_id import EVIDENCE_ID_KEY, EVIDENCE_ID_PREFIX, evidence_content_id
from nanrunbook.strictjson import child_path, load_manifest_bytes
from nanrunbook.tensors.safetensors import TensorFileHeader, read_header
from nanrunbook.tensors.scan import ShortRead, scan_range
from nanrunbook.tensors.verify import header_limit

__all__ = ["CODES", "Replacement", "SealResult", "seal_bundle"]


_TENSOR_KEY_ORDER = ("name", "file", "dtype", "shape", "sha256", "probe")
_TOP_KEY_ORDER = (
    "format",
    "contract_version",
    "evidence_id",
    EVIDENCE_ID_KEY,
    "run",
    "incident_owner",
    "binding",
    "last_known_good",
    "stages",
)


@dataclass(frozen=True, slots=True)
class Replacement:
    """A recorded value that ``--force`` overwrote: the evidence as given did not verify."""

    where: str  # JSON path
    recorded: str  # quoted: it comes from the untrusted manifest
    computed: str


@dataclass(slots=True)
class SealResult:
    """What the seal did: digests filled, verified and replaced; the content id's fate."""

    filled: int = 0
    verified: int = 0
    replaced: int = 0
    content_id: str = "verified"  # "filled", "verified", "resealed" or "replaced"
    written: bool = False
    replacements: list[Replacement] = field(default_factory=list)

    def summary(self, bundle: str) -> str:
        what = (
            f"{self.filled} tensor digests filled, {self.verified} verified"
            + (f", {self.replaced} replaced" if self.replaced else "")
            + f"; evidence_content_id {self.content_id}"
        )
        done = "manifest.json rewritten" if self.written else "nothing to change"
        return f"sealed {quote(bundle)}: {what}; {done}"


_CONTENT_ID = re.compile(re.escape(EVIDENCE_ID_PREFIX) + "[0-9a-f]{64}")


def _shown_id(declared: object) -> str:
    """A well-formed content id is safe text and shown whole; anything else quoted."""
    if isinstance(declared, str) and _CONTENT_ID.fullmatch(declared):
        return declared
    return quote(declared)


def _insert(mapping: dict[str, Any], key: str, value: Any, order: tuple[str, ...]) -> None:
    """Set ``mapping[key]`` in place, keeping existing keys where they are; a new
    key goes right after the nearest key before it in ``order`` that is present
    (first when none is)."""
    if key in mapping:
        mapping[key] = value
        return
    items = list(mapping.items())
    names = [name for name, _ in items]
    at = 0
    for previous in reversed(order[: order.index(key)]):
        if previous in mapping:
            at = names.index(previous) + 1
            break
    items.insert(at, (key, value))
    mapping.clear()
    mapping.update(items)


def _complete_entries(tree: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    """(JSON path, entry) of every tensor entry of an OBSERVED complete stage that
    names a file. Anything malformed is skipped here: check reports it."""
    stages = tree.get("stages")
    if not isinstance(stages, list):
        return
    for s_index, stage in enumerate(stages):
        if not isinstance(stage, dict):
            continue
        if stage.get("status") != "OBSERVED" or stage.get("resolution") != "complete":
            continue
        tensors = stage.get("tensors")
        if not isinstance(tensors, list):
            continue
        for t_index, entry in enumerate(tensors):
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("file"), str)
                and isinstance(entry.get("name"), str)
            ):
                yield f"$.stages[{s_index}].tensors[{t_index}]", entry


class _Files:
    """Tensor files opened once each through the bundle's safe access, their headers
    read within the bound ``check`` applies: one per tensor entry the manifest
    binds to the file, whatever spellings of its path the entries use."""

    def __init__(self, bundle: Path, entries: Iterable[dict[str, Any]]) -> None:
        self._open: dict[str, tuple[int, TensorFileHeader] | EvidenceRejected] = {}
        self._fds: list[int] = []
        bound: dict[str, int] = {}
        for entry in entries:
            bound[entry["file"]] = bound.get(entry["file"], 0) + 1
        try:
            self._read_headers(bundle, bound)
        except BaseException:
            self.close()
            raise

    def _read_headers(self, bundle: Path, bound: dict[str, int]) -> None:
        opened: dict[str, int] = {}
        per_file: dict[tuple[int, int], int] = {}
        for relpath, count in bound.items():
            try:
                fd = open_in_bundle(bundle, relpath)
            except EvidenceRejected as error:
                self._open[relpath] = error
                continue
            self._fds.append(fd)
            opened[relpath] = fd
            identity = _identity(fd)
            per_file[identity] = per_file.get(identity, 0) + count
        for relpath, fd in opened.items():
            limit = header_limit(per_file[_identity(fd)])
            try:
                self._open[relpath] = (fd, read_header(fd, relpath, max_header_len=limit))
            except EvidenceRejected as error:
                self._open[relpath] = error

    def header(self, relpath: str) -> tuple[int, TensorFileHeader]:
        known = self._open[relpath]
        if isinstance(known, EvidenceRejected):
            raise known
        return known

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _digest(files: _Files, entry: dict[str, Any], where: str) -> str:
    relpath: str = entry["file"]
    name: str = entry["name"]
    try:
        fd, header = files.header(relpath)
    except EvidenceRejected as error:
        first = error.violations[0]
        raise EvidenceRejected(
            [
                Violation(
                    "SEAL_TENSOR_UNREADABLE",
                    where,
                    f"cannot hash tensor {quote(name)}: {first.code} {first.message}",
                )
            ]
        ) from None
    found = header.entries.get(name)
    if found is None:
        raise EvidenceRejected(
            [
                Violation(
                    "SEAL_TENSOR_UNREADABLE",
                    where,
                    f"tensor file {quote(relpath)} holds no tensor named {quote(name)}",
                )
            ]
        )
    try:
        scanned = scan_range(fd, found.begin, found.end - found.begin, found.dtype)
    except (OSError, ShortRead) as error:
        raise EvidenceRejected(
            [
                Violation(
                    "SEAL_TENSOR_UNREADABLE",
                    where,
                    f"reading tensor {quote(name)} failed: {quote(error)}",
                )
            ]
        ) from None
    return scanned.sha256


def seal_bundle(bundle: str | os.PathLike[str], *, force: bool = False) -> SealResult:
    """Fill missing tensor digests and the evidence content id of ``bundle``'s
    manifest, verify the ones present, and rewrite manifest.json atomically.

    Raises EvidenceRejected (nothing written) when the manifest is not strict
    JSON, when a tensor to hash cannot be read (SEAL_TENSOR_UNREADABLE), when a
    present value differs and ``force`` is false (SEAL_VALUE_DIFFERS, every one
    listed), or when the manifest changes meanwhile (SEAL_MANIFEST_CHANGED).
    """
    path = Path(bundle)
    raw = read_manifest_bytes(path)
    tree = load_manifest_bytes(raw)
    result = SealResult()
    original_id = evidence_content_id(tree)
    differs = _seal_digests(path, tree, result, force=force)
    differs += _seal_content_id(tree, original_id, result, force=force)
    if differs:
        raise EvidenceRejected(differs)
    if result.filled or result.replaced or result.content_id != "verified":
        _rewrite(path, raw, tree)
        result.written = True
    return result


def _seal_digests(
    path: Path, tree: dict[str, Any], result: SealResult, *, force: bool
) -> list[Violation]:
    """Fill, verify or (forced) replace each complete-stage tensor's sha256 in
    ``tree``; the values that differ when not forced."""
    differs: list[Violation] = []
    entries = list(_complete_entries(tree))
    files = _Files(path, (entry for _, entry in entries))
    try:
        for where, entry in entries:
            actual = _digest(files, entry, where)
            if "sha256" not in entry:
                _insert(entry, "sha256", actual, _TENSOR_KEY_ORDER)
                result.filled += 1
            elif entry["sha256"] == actual:
                result.verified += 1
            elif force:
                result.replacements.append(
                    Replacement(f"{where}.sha256", quote(entry["sha256"]), actual)
                )
                entry["sha256"] = actual
                result.replaced += 1
            else:
                differs.append(
                    Violation(
                        "SEAL_VALUE_DIFFERS",
                        f"{where}.sha256",
                        f"declared {quote(entry['sha256'])}, the tensor's bytes hash to {actual}",
                    )
                )
    finally:
        files.close()
    return differs


def _seal_content_id(
    tree: dict[str, Any], original_id: str, result: SealResult, *, force: bool
) -> list[Violation]:
    """Fill, verify, reseal or (forced) replace the evidence content id of the
    digest-sealed ``tree``; the id when it differs and is not forced."""
    sealed_id = evidence_content_id(tree)
    declared = tree.get(EVIDENCE_ID_KEY)
    if EVIDENCE_ID_KEY not in tree:
        result.content_id = "filled"
    elif declared == sealed_id:
        result.content_id = "verified"
    elif declared == original_id:
        result.content_id = "resealed"  # it sealed the manifest as given; digests were added
    elif force:
        result.content_id = "replaced"
        result.replacements.append(
            Replacement(child_path("$", EVIDENCE_ID_KEY), _shown_id(declared), sealed_id)
        )
    else:
        return [
            Violation(
                "SEAL_VALUE_DIFFERS",
                child_path("$", EVIDENCE_ID_KEY),
                f"declared {_shown_id(declared)}, the manifest's content seals to {sealed_id}",
            )
        ]
    _insert(tree, EVIDENCE_ID_KEY, sealed_id, _TOP_KEY_ORDER)
    return []


def _rewrite(path: Path, raw: bytes, tree: dict[str, Any]) -> None:
    """Write ``tree`` over manifest.json atomically, in the original's layout
    (indented or compact, final newline kept), unless the file changed meanwhile."""
    import orjson

    indented = b"\n" in raw.strip()
    data = orjson.dumps(tree, option=orjson.OPT_INDENT_2 if indented else 0)
    if raw.endswith(b"\n"):
        data += b"\n"
    if read_manifest_bytes(path) != raw:
        raise EvidenceRejected(
            [
                Violation(
                    "SEAL_MANIFEST_CHANGED",
                    MANIFEST_NAME,
                    "manifest.json changed while it was sealed; nothing written",
                )
            ]
        )
    atomic_write(path / MANIFEST_NAME, data)

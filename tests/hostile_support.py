"""Helpers for the hostile-evidence suites (issue 5) and ``fuzz/measure_cases.py``.

* an in-memory model of a bundle (manifest tree + tensor files as tensor lists),
  serialised with a JSON writer that can also write duplicate keys;
  resealing (tensor digests, evidence content id) after a mutation;
* snapshots of a bundle directory (listing, types, modes, sizes, mtimes, hashes),
  taken without opening anything but regular files, to prove ``check`` wrote nothing;
* the CLI in a subprocess, with a timeout as a hang guard;
* the explicit hostile cases, each a function that builds a bundle directory,
  shared by ``tests/test_hostile_cases.py`` and ``fuzz/measure_cases.py``.

Nothing here imports nanrunbook's rule modules; the only nanrunbook name used is
``nanrunbook.manifest.content_id.evidence_content_id``, to reseal.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanrunbook.manifest.content_id import evidence_content_id

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TENSOR_FILE = "tensors.safetensors"
CLI = [sys.executable, "-m", "nanrunbook"]
HANG_GUARD_SECONDS = 60.0

VALID_FIXTURES = (
    "continue-all-finite",
    "hold-backward-dynamic-skip",
    "hold-forward-bf16",
    "hold-input",
    "hold-loss",
    "hold-optimizer-summary",
)

TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s+File \"", re.MULTILINE)
# The brief's shell-safety pattern for every ``--format kv`` line, and the one
# appended line it does not cover: ``warning=CODE STAGE#INDEX`` (issue 11), whose
# ``#`` follows a fixed stage name, never starts a word.
KV_LINE = re.compile(
    r"^[a-z_]+=[A-Za-z0-9._:@/+=,\[\]$?-]*( [A-Za-z0-9._:@/+=,\[\]$?-]+)?$"
    r"|^warning=[A-Z_]+ (input|forward|loss|backward|optimizer)#[0-9]+$"
)


# ---------------------------------------------------------------------- JSON writer


class Pairs(list[tuple[str, Any]]):
    """A JSON object written as these (key, value) pairs, repeated keys included."""


def dump_json(value: Any, *, indent: bool = False) -> str:
    """JSON text of a tree of dict/Pairs/list/str/int/float/bool/None.

    ``Raw`` leaves are written verbatim (NaN literals, deep nesting, odd numbers).
    """
    out: list[str] = []
    _dump(value, out, 0 if indent else None)
    return "".join(out)


@dataclass(frozen=True)
class Raw:
    """A verbatim JSON fragment in a tree."""

    text: str


def _dump(value: Any, out: list[str], level: int | None) -> None:
    nl = "" if level is None else "\n" + "  " * (level + 1)
    end = "" if level is None else "\n" + "  " * level
    child = None if level is None else level + 1
    if isinstance(value, Raw):
        out.append(value.text)
    elif isinstance(value, dict | Pairs):
        items = list(value.items()) if isinstance(value, dict) else list(value)
        if not items:
            out.append("{}")
            return
        out.append("{")
        for i, (key, item) in enumerate(items):
            out.append(("," if i else "") + nl + json.dumps(key) + ": ")
            _dump(item, out, child)
        out.append(end + "}")
    elif isinstance(value, list):
        if not value:
            out.append("[]")
            return
        out.append("[")
        for i, item in enumerate(value):
            out.append(("," if i else "") + nl)
            _dump(item, out, child)
        out.append(end + "]")
    elif isinstance(value, float):
        out.append(repr(value) if math.isfinite(value) else "NaN")
    else:
        out.append(json.dumps(value))


def plain(value: Any) -> Any:
    """The tree as plain dicts (first value of a repeated key), for hashing; None if it
    holds a Raw fragment."""
    if isinstance(value, Raw):
        raise ValueError("raw fragment")
    if isinstance(value, Pairs):
        result: dict[str, Any] = {}
        for key, item in value:
            result.setdefault(key, plain(item))
        return result
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def content_id_of(tree: Any) -> str | None:
    try:
        return evidence_content_id(plain(tree))
    except Exception:  # a lone surrogate, a Raw leaf, an int out of RFC 8785's range
        return None


# ------------------------------------------------------------------ safetensors model


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: list[int]
    data: bytes


@dataclass
class TensorFile:
    """A tensor file as tensors in data order; ``header_edit`` and ``raw_edit`` corrupt
    the serialised form."""

    tensors: list[Tensor]
    metadata: dict[str, Any] | None = None
    header_edit: Callable[[Any], Any] | None = None
    raw_edit: Callable[[bytes], bytes] | None = None
    pad: bytes = b" "

    def header(self) -> Any:
        header: dict[str, Any] = {}
        if self.metadata is not None:
            header["__metadata__"] = self.metadata
        offset = 0
        for t in self.tensors:
            header[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + len(t.data)],
            }
            offset += len(t.data)
        return self.header_edit(header) if self.header_edit else header

    def to_bytes(self) -> bytes:
        text = dump_json(self.header()).encode("utf-8", "surrogatepass")
        text += self.pad * (-len(text) % 8) if self.pad else b""
        raw = struct.pack("<Q", len(text)) + text + b"".join(t.data for t in self.tensors)
        return self.raw_edit(raw) if self.raw_edit else raw


def parse_tensor_file(raw: bytes) -> TensorFile:
    """A well-formed fixture tensor file into the model."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    metadata = header.pop("__metadata__", None)
    tensors = [
        Tensor(
            name, e["dtype"], list(e["shape"]), data[e["data_offsets"][0] : e["data_offsets"][1]]
        )
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"])
    ]
    return TensorFile(tensors, metadata)


# ----------------------------------------------------------------------- bundle model


@dataclass
class BundleModel:
    manifest: Any  # dict tree (Pairs/Raw allowed)
    files: dict[str, TensorFile] = field(default_factory=dict)
    manifest_raw_edit: Callable[[bytes], bytes] | None = None
    indent: bool = True

    @classmethod
    def from_fixture(cls, name: str) -> BundleModel:
        src = FIXTURES / name
        manifest = json.loads((src / "manifest.json").read_bytes())
        files = {
            p.name: parse_tensor_file(p.read_bytes())
            for p in sorted(src.iterdir())
            if p.suffix == ".safetensors"
        }
        return cls(manifest, files)

    def copy(self) -> BundleModel:
        return copy.deepcopy(self)

    def entries(self) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """(stage index, entry index, entry) of every well-formed tensor entry."""
        stages = self.manifest.get("stages") if isinstance(self.manifest, dict) else None
        if not isinstance(stages, list):
            return
        for s, stage in enumerate(stages):
            tensors = stage.get("tensors") if isinstance(stage, dict) else None
            if isinstance(tensors, list):
                for t, entry in enumerate(tensors):
                    if isinstance(entry, dict):
                        yield s, t, entry

    def find_tensor(self, name: str) -> tuple[TensorFile, Tensor] | None:
        for tf in self.files.values():
            for t in tf.tensors:
                if t.name == name:
                    return tf, t
        return None

    def reseal_digests(self) -> None:
        """Set each entry's sha256 to its tensor's data (when the tensor can be found)."""
        for _, _, entry in self.entries():
            name = entry.get("name")
            if not isinstance(name, str) or "sha256" not in entry:
                continue
            found = self.find_tensor(name)
            if found is not None:
                entry["sha256"] = hashlib.sha256(found[1].data).hexdigest()

    def reseal_content_id(self) -> None:
        if not isinstance(self.manifest, dict):
            return
        cid = content_id_of(self.manifest)
        if cid is not None:
            self.manifest["evidence_content_id"] = cid

    def manifest_bytes(self) -> bytes:
        raw = dump_json(self.manifest, indent=self.indent).encode("utf-8", "surrogatepass")
        return self.manifest_raw_edit(raw) if self.manifest_raw_edit else raw

    def write(self, target: Path) -> Path:
        target.mkdir(parents=True)
        (target / "manifest.json").write_bytes(self.manifest_bytes())
        for name, tf in self.files.items():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(tf.to_bytes())
        return target


def add_oddities(bundle: Path, outside: Path) -> None:
    """Entries a path mutation may point at: a FIFO, a directory, a symlink loop, symlinks
    out of the bundle (a device, a regular file) and an in-bundle alias of the tensor file.
    The manifest names none of them unless mutated, so they must be ignored."""
    os.mkfifo(bundle / "fifo")
    (bundle / "dir").mkdir()
    os.symlink("loop-b", bundle / "loop-a")
    os.symlink("loop-a", bundle / "loop-b")
    os.symlink("/dev/zero", bundle / "zero")
    os.symlink(outside, bundle / "outside")
    os.symlink(TENSOR_FILE, bundle / "alias.safetensors")


# ------------------------------------------------------------------------- snapshots


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root``: kind, mode, size, mtime, and content hash or link
    target. Only regular files are opened (never a FIFO or a device)."""
    result: dict[str, tuple[Any, ...]] = {}
    top = os.lstat(root)
    result["."] = ("dir", top.st_mode, top.st_mtime_ns)
    stack = [root]
    while stack:
        directory = stack.pop()
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            rel = os.path.relpath(entry.path, root)
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                result[rel] = ("link", os.readlink(entry.path))
            elif stat.S_ISDIR(info.st_mode):
                result[rel] = ("dir", info.st_mode, info.st_mtime_ns)
                stack.append(Path(entry.path))
            elif stat.S_ISREG(info.st_mode):
                digest = hashlib.sha256(Path(entry.path).read_bytes()).hexdigest()
                result[rel] = ("file", info.st_mode, info.st_size, info.st_mtime_ns, digest)
            else:
                result[rel] = ("special", info.st_mode, info.st_rdev)
    return result


# ------------------------------------------------------------------------------- CLI


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(
    bundle: Path | str,
    fmt: str = "text",
    *,
    timeout: float = HANG_GUARD_SECONDS,
    env: dict[str, str] | None = None,
) -> CliResult:
    """``nanrunbook check --format FMT BUNDLE`` in a subprocess; the timeout is a hang guard."""
    proc = subprocess.run(
        [*CLI, "check", "--format", fmt, str(bundle)],
        capture_output=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
        check=False,
    )
    return CliResult(
        proc.returncode,
        proc.stdout.decode("utf-8", "replace"),
        proc.stderr.decode("utf-8", "replace"),
    )


def run_cli_tty(
    bundle: Path | str, *, timeout: float = HANG_GUARD_SECONDS, env: dict[str, str] | None = None
) -> CliResult:
    """``nanrunbook check BUNDLE`` (text) with stdout on a pseudo-terminal, colour forced:
    what an on-call engineer sees. stderr is a pipe."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    base = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    proc = subprocess.Popen(
        [*CLI, "check", str(bundle)],
        stdout=slave,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**base, "FORCE_COLOR": "1", "TERM": "xterm-256color", "COLUMNS": "120", **(env or {})},
        cwd=ROOT,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        stderr = proc.stderr.read() if proc.stderr else b""
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
    return CliResult(
        code, b"".join(chunks).decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    )


# Select Graphic Rendition (colour, bold...) is the only escape the text format may use.
SGR = re.compile(r"\x1b\[[0-9;]*m")


def strip_sgr(text: str) -> str:
    return SGR.sub("", text)


def assert_clean_rejection(result: CliResult, fmt: str = "kv") -> list[str]:
    """Exit 3, no traceback, nothing on stderr, the format's shape; the violation codes."""
    assert result.code == 3, (result.code, result.stdout, result.stderr)
    assert not TRACEBACK.search(result.stdout + result.stderr), result
    assert result.stderr == "", result.stderr
    if fmt == "kv":
        lines = result.stdout.splitlines()
        for line in lines:
            assert KV_LINE.fullmatch(line), line
        assert "decision=REJECTED" in lines
        return [
            line.split("=", 1)[1].split(" ")[0] for line in lines if line.startswith("violation=")
        ]
    if fmt == "json":
        document = json.loads(result.stdout)
        return [v["code"] for v in document["violations"]]
    return []


# --------------------------------------------------------------------- explicit cases
#
# Each builder makes one hostile bundle under ``tmp`` and returns the path to check.
# They are shared by tests/test_hostile_cases.py (assertions) and
# fuzz/measure_cases.py (time and memory figures).


def base_model(fixture: str = "continue-all-finite") -> BundleModel:
    return BundleModel.from_fixture(fixture)


def sealed(model: BundleModel, tmp: Path, name: str = "bundle") -> Path:
    model.reseal_digests()
    model.reseal_content_id()
    return model.write(tmp / name)


def with_raw_tensor_file(tmp: Path, raw_edit: Callable[[bytes], bytes]) -> Path:
    model = base_model()
    model.files[TENSOR_FILE].raw_edit = raw_edit
    return sealed(model, tmp)


def _set_header_len(value: int) -> Callable[[bytes], bytes]:
    return lambda raw: struct.pack("<Q", value) + raw[8:]


def case_header_len_u64_max(tmp: Path) -> Path:
    return with_raw_tensor_file(tmp, _set_header_len(2**64 - 1))


def case_header_len_past_end(tmp: Path) -> Path:
    # one byte more than the file holds after the 8-byte length
    return with_raw_tensor_file(tmp, lambda raw: struct.pack("<Q", len(raw) - 8 + 1) + raw[8:])


WHITESPACE_HEADER_LEN = 100_000_000  # the format's own cap, so only the manifest's bound refuses it


def case_header_100mb_whitespace(tmp: Path) -> Path:
    bundle = sealed(base_model(), tmp)
    path = bundle / TENSOR_FILE
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", WHITESPACE_HEADER_LEN))
        block = b" " * (1 << 20)
        left = WHITESPACE_HEADER_LEN
        while left:
            out.write(block[: min(left, len(block))])
            left -= min(left, len(block))
    return bundle


DEPTH = 100_000


def case_manifest_nested_deep(tmp: Path) -> Path:
    model = base_model()
    model.manifest["binding"]["model"]["deep"] = Raw("[" * DEPTH + "]" * DEPTH)
    model.indent = False
    return model.write(tmp / "bundle")


def case_manifest_nested_deep_objects(tmp: Path) -> Path:
    model = base_model()
    model.manifest["binding"]["model"]["deep"] = Raw('{"a":' * DEPTH + "1" + "}" * DEPTH)
    model.indent = False
    return model.write(tmp / "bundle")


def case_header_nested_deep(tmp: Path) -> Path:
    model = base_model()

    def deep(header: Any) -> Any:
        header["__metadata__"] = Raw("[" * DEPTH + "]" * DEPTH)
        return header

    model.files[TENSOR_FILE].header_edit = deep
    return sealed(model, tmp)


MANY_TENSORS = 1_000_000


def _many_tensor_header(count: int) -> bytes:
    parts = [b'{"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % 0]
    parts.extend(
        b',"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(1, count)
    )
    parts.append(b"}")
    text = b"".join(parts)
    return text + b" " * (-len(text) % 8)


def case_header_million_tensors(tmp: Path) -> Path:
    header = _many_tensor_header(MANY_TENSORS)
    return with_raw_tensor_file(tmp, lambda raw: struct.pack("<Q", len(header)) + header)


def case_header_many_tensors_under_bound(tmp: Path) -> Path:
    """As many zero-length tensors as fit in the header bound a 10-entry file gets
    (HEADER_BASE_BYTES + HEADER_BYTES_PER_ENTRY per bound entry): the largest
    header that is parsed."""
    from nanrunbook.tensors.verify import HEADER_BASE_BYTES, HEADER_BYTES_PER_ENTRY

    bound = HEADER_BASE_BYTES + HEADER_BYTES_PER_ENTRY * 10
    count = bound // 56 - 1
    header = _many_tensor_header(count)
    while len(header) > bound:
        count -= 1000
        header = _many_tensor_header(count)
    return with_raw_tensor_file(tmp, lambda raw: struct.pack("<Q", len(header)) + header)


def _edit_entry(model: BundleModel, key: str, value: Any, stage: int = 0, tensor: int = 0) -> None:
    model.manifest["stages"][stage]["tensors"][tensor][key] = value


def case_manifest_shape_overflow(tmp: Path) -> Path:
    model = base_model()
    _edit_entry(model, "shape", [2**32, 2**32, 2])  # 2^65 elements
    return sealed(model, tmp)


def case_manifest_shape_huge_product(tmp: Path) -> Path:
    """A product of thousands of digits (and, unbounded, quadratic time to compute)."""
    model = base_model()
    _edit_entry(model, "shape", [2**53 - 1] * 100_000)
    model.indent = False
    return sealed(model, tmp)


def case_header_shape_overflow(tmp: Path) -> Path:
    model = base_model()

    def overflow(header: Any) -> Any:
        header["batch/features"]["shape"] = [2**63, 2**63]
        return header

    model.files[TENSOR_FILE].header_edit = overflow
    return sealed(model, tmp)


def case_manifest_negative_dim(tmp: Path) -> Path:
    model = base_model()
    _edit_entry(model, "shape", [-1, 8])
    return sealed(model, tmp)


def case_manifest_fractional_dim(tmp: Path) -> Path:
    model = base_model()
    _edit_entry(model, "shape", [8.5, 8])
    return sealed(model, tmp)


def case_header_negative_dim(tmp: Path) -> Path:
    model = base_model()

    def negative(header: Any) -> Any:
        header["batch/features"]["shape"] = [-8, -8]
        return header

    model.files[TENSOR_FILE].header_edit = negative
    return sealed(model, tmp)


def case_header_fractional_dim(tmp: Path) -> Path:
    model = base_model()

    def fractional(header: Any) -> Any:
        header["batch/features"]["shape"] = [8.0, 8]
        return header

    model.files[TENSOR_FILE].header_edit = fractional
    return sealed(model, tmp)


def _redirect_entries(model: BundleModel, target: str) -> None:
    """Point every entry of the input stage at ``target``."""
    for entry in model.manifest["stages"][0]["tensors"]:
        entry["file"] = target


def _special_file(tmp: Path, make: Callable[[Path], None], name: str = "special") -> Path:
    model = base_model()
    _redirect_entries(model, name)
    bundle = sealed(model, tmp)
    make(bundle / name)
    return bundle


def case_tensor_file_fifo(tmp: Path) -> Path:
    return _special_file(tmp, os.mkfifo)


def case_tensor_file_dev_zero_symlink(tmp: Path) -> Path:
    return _special_file(tmp, lambda p: os.symlink("/dev/zero", p))


def mknod_permitted(tmp: Path) -> bool:
    probe = tmp / "mknod-probe"
    try:
        os.mknod(probe, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except OSError:
        return False
    probe.unlink()
    return True


def case_tensor_file_device_node(tmp: Path) -> Path:
    """A character device (/dev/zero's numbers) inside the bundle; a FIFO where mknod of a
    device is not permitted."""
    permitted = mknod_permitted(tmp)

    def make(path: Path) -> None:
        if permitted:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        else:
            os.mkfifo(path)

    return _special_file(tmp, make)


def case_tensor_file_directory(tmp: Path) -> Path:
    return _special_file(tmp, lambda p: p.mkdir())


def case_tensor_file_symlink_loop(tmp: Path) -> Path:
    def make(path: Path) -> None:
        os.symlink(path.name + "-2", path)
        os.symlink(path.name, path.with_name(path.name + "-2"))

    return _special_file(tmp, make)


def case_tensor_file_symlink_out(tmp: Path) -> Path:
    """A symlink to a real, valid copy of the tensor file just outside the bundle."""
    outside = tmp / "outside.safetensors"

    def make(path: Path) -> None:
        shutil.copy(path.parent / TENSOR_FILE, outside)
        os.symlink(outside, path)

    return _special_file(tmp, make)


def case_tensor_file_symlink_out_relative(tmp: Path) -> Path:
    def make(path: Path) -> None:
        shutil.copy(path.parent / TENSOR_FILE, tmp / "outside.safetensors")
        os.symlink("../outside.safetensors", path)

    return _special_file(tmp, make)


def case_manifest_fifo(tmp: Path) -> Path:
    bundle = sealed(base_model(), tmp)
    (bundle / "manifest.json").unlink()
    os.mkfifo(bundle / "manifest.json")
    return bundle


def case_manifest_dev_zero_symlink(tmp: Path) -> Path:
    bundle = sealed(base_model(), tmp)
    (bundle / "manifest.json").unlink()
    os.symlink("/dev/zero", bundle / "manifest.json")
    return bundle


def case_bundle_is_file(tmp: Path) -> Path:
    path = tmp / "bundle"
    path.write_bytes((FIXTURES / "continue-all-finite" / "manifest.json").read_bytes())
    return path


def case_bundle_is_fifo(tmp: Path) -> Path:
    path = tmp / "bundle"
    os.mkfifo(path)
    return path


def case_manifest_not_utf8(tmp: Path) -> Path:
    model = base_model()
    model.manifest_raw_edit = lambda raw: raw.replace(b'"ml-oncall"', b'"ml-\xff\xfeoncall"')
    return sealed(model, tmp)


def case_manifest_bom(tmp: Path) -> Path:
    model = base_model()
    model.manifest_raw_edit = lambda raw: b"\xef\xbb\xbf" + raw
    return sealed(model, tmp)


def case_manifest_utf16(tmp: Path) -> Path:
    model = base_model()
    model.manifest_raw_edit = lambda raw: raw.decode().encode("utf-16")
    return sealed(model, tmp)


def case_manifest_too_large(tmp: Path) -> Path:
    model = base_model()
    model.manifest_raw_edit = lambda raw: raw + b" " * (16 * 1024 * 1024)
    return sealed(model, tmp)


def case_manifest_16mib_strings(tmp: Path) -> Path:
    """Just under 16 MiB of two-character strings: the most objects a manifest can make."""
    model = base_model()
    count = (16 * 1024 * 1024 - 8192) // 5
    model.manifest["binding"]["model"]["many"] = Raw("[" + ",".join(['"ab"'] * count) + "]")
    model.indent = False
    return model.write(tmp / "bundle")


HOSTILE_TEXT = (
    "[red]x[/red] [link=https://example.invalid]y[/link] $(rm -rf /) `id`; a && b | c > d"
)


def case_hostile_probe_texts(tmp: Path) -> Path:
    """Accepted evidence whose free text is rich markup and shell metacharacters."""
    model = base_model("hold-backward-dynamic-skip")
    for stage in model.manifest["stages"]:
        stage["tensor_set"]["probe_source"] = HOSTILE_TEXT
        for entry in stage.get("tensors", []):
            entry["probe"] = HOSTILE_TEXT
        if "reason" in stage:
            stage["reason"] = HOSTILE_TEXT
    return sealed(model, tmp)


def case_hostile_tensor_name(tmp: Path) -> Path:
    """Accepted evidence whose first non-finite tensor has markup in its name."""
    model = base_model("hold-backward-dynamic-skip")
    old = "grad/layers.0.weight"
    new = "[bold red]grad[/] $(id) `x`;"
    for _, _, entry in model.entries():
        if entry["name"] == old:
            entry["name"] = new
    found = model.find_tensor(old)
    assert found is not None
    found[1].name = new
    return sealed(model, tmp)


def case_bidi_in_free_text(tmp: Path) -> Path:
    model = base_model()
    model.manifest["stages"][0]["tensor_set"]["probe_source"] = "batch \u202egnp.exe"
    return sealed(model, tmp)


def case_bidi_in_tensor_name(tmp: Path) -> Path:
    model = base_model()
    _edit_entry(model, "name", "batch/\u202efeatures")
    found = model.find_tensor("batch/features")
    assert found is not None
    found[1].name = "batch/\u202efeatures"
    return sealed(model, tmp)


def case_control_in_identifier(tmp: Path) -> Path:
    model = base_model()
    model.manifest["incident_owner"] = "ml-oncall\x1b]8;;https://x\x07"
    return sealed(model, tmp)


def case_control_in_key(tmp: Path) -> Path:
    model = base_model()
    model.manifest["binding"]["model"]["\x1b[31mred"] = "x"
    return sealed(model, tmp)


def case_c1_control_in_text(tmp: Path) -> Path:
    model = base_model()
    model.manifest["stages"][0]["tensor_set"]["probe_source"] = "csi \x9b31m here"
    return sealed(model, tmp)


def case_markup_in_unknown_key(tmp: Path) -> Path:
    """Rejected evidence whose violation paths and messages carry markup from a key."""
    model = base_model()
    model.manifest["[red]x[/red] $(rm -rf /)"] = "`id`"
    return sealed(model, tmp)


CASES: dict[str, Callable[[Path], Path]] = {
    name[len("case_") :]: fn for name, fn in list(globals().items()) if name.startswith("case_")
}


def case_bidi_in_binding_detail(tmp: Path) -> Path:
    """Accepted: a binding detail is not free text, only control characters are refused
    there; it must still never reach the text or kv output raw."""
    model = base_model()
    model.manifest["binding"]["data"]["shard"] = "shard-\u202e3000"
    return sealed(model, tmp)


def case_bidi_markup_in_file_name(tmp: Path) -> Path:
    """A tensor file named with a bidi override and markup that holds an unbound tensor:
    the violation names the file."""
    model = base_model()
    name = "t\u202e[red]x.safetensors"
    model.files[name] = model.files.pop(TENSOR_FILE)
    for _, _, entry in model.entries():
        entry["file"] = name
    model.files[name].tensors.append(Tensor("extra", "U8", [0], b""))
    return sealed(model, tmp)


def case_scaler_without_scale(tmp: Path) -> Path:
    model = base_model("hold-backward-dynamic-skip")
    del model.manifest["binding"]["scaler"]["scale"]
    return sealed(model, tmp)


def case_scaler_without_mode(tmp: Path) -> Path:
    model = base_model("hold-backward-dynamic-skip")
    del model.manifest["binding"]["scaler"]["mode"]
    return sealed(model, tmp)


CASES.update(
    {
        name[len("case_") :]: fn
        for name, fn in list(globals().items())
        if name.startswith("case_") and name[len("case_") :] not in CASES
    }
)


def _retyped_summary(tmp: Path, dtype: str) -> Path:
    """hold-optimizer-summary (3 NaN declared in its summary stage) with the summary's
    tensors declared ``dtype``: an integer cannot hold NaN."""
    model = base_model("hold-optimizer-summary")
    stage = model.manifest["stages"][4]
    for entry in stage["tensors"]:
        entry["dtype"] = dtype
    stage.pop("finite_max_abs", None)
    return sealed(model, tmp)


def case_summary_nan_in_integer_tensors(tmp: Path) -> Path:
    return _retyped_summary(tmp, "I32")


def case_summary_infinity_in_e4m3_tensors(tmp: Path) -> Path:
    model = base_model("hold-optimizer-summary")
    stage = model.manifest["stages"][4]
    for entry in stage["tensors"]:
        entry["dtype"] = "F8_E4M3"
    counts = stage["counts"]
    counts["posinf"], counts["nan"] = counts["nan"], 0
    stage.pop("finite_max_abs", None)
    return sealed(model, tmp)


CASES.update(
    {
        name[len("case_") :]: fn
        for name, fn in list(globals().items())
        if name.startswith("case_") and name[len("case_") :] not in CASES
    }
)

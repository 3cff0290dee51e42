"""The shared state directory (capture/torch/_state_dir.py): DCP state, JSON
documents and a SHA-256 manifest written last, atomically; verified with every
violation, never unpickling; loaded only after verification, DCP's metadata
through a restricted unpickler."""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from state_dir_support import relist

from nanrunbook.capture import _state_manifest
from nanrunbook.capture.torch import _state_dir
from nanrunbook.capture.torch._dcp_reader import read_metadata
from nanrunbook.capture.torch._state_dir import (
    FORMATS,
    FileDigest,
    StateDirRejected,
    decode_value,
    encode_value,
    load_state_dir,
    verify_state_dir,
    write_state_dir,
)
from nanrunbook.codes import CODES

KIND = FORMATS["recovery_point"]


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


@pytest.fixture
def written(tmp_path: Path) -> Path:
    model, optimizer = _model_and_optimizer(0)
    target = tmp_path / "point"
    documents = {"rng": encode_value({"python": random.getstate()}), "cursor": {"batch": 7}}
    write_state_dir(
        target, kind_format=KIND, state=_state(model, optimizer), documents=documents,
        header={"step": 7},
    )  # fmt: skip
    return target


def _codes(path: Path, **kwargs: Any) -> list[str]:
    _, violations = verify_state_dir(path, kind_format=KIND, **kwargs)
    return [violation.code for violation in violations]


def test_every_code_is_in_the_catalogue() -> None:
    assert set(_state_manifest.CODES) <= set(CODES)


def test_a_written_directory_verifies_and_loads_bit_for_bit(written: Path) -> None:
    manifest, violations = verify_state_dir(written, kind_format=KIND)
    assert violations == ()
    assert manifest is not None and manifest.header == {"step": 7}
    assert set(manifest.files) == {
        "cursor.json",
        "rng.json",
        "state/.metadata",
        "state/__0_0.distcp",
    }
    saved_model, saved_optimizer = _model_and_optimizer(0)
    model, optimizer = _model_and_optimizer(1)
    state = _state(model, optimizer)
    _, documents = load_state_dir(written, kind_format=KIND, state=state)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for key, value in saved_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    for index, values in saved_optimizer.state_dict()["state"].items():
        for key, value in values.items():
            assert torch.equal(optimizer.state_dict()["state"][index][key], value)
    assert optimizer.param_groups[0]["lr"] == 1e-2
    assert documents["cursor"] == {"batch": 7}
    assert decode_value(documents["rng"])["python"] == random.getstate()
    assert list(written.parent.iterdir()) == [written]  # no temporary left beside it


def test_a_large_state_is_hashed_as_written_not_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 MiB of tensors: DCP writes two files on two threads, each hashed as its
    # bytes go by; only the small files (documents, DCP's metadata) are read.
    read_back: list[str] = []
    real_open = open

    def spying_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            read_back.append(Path(file).name)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(_state_dir, "open", spying_open, raising=False)
    state = {"a": torch.arange(2 << 20, dtype=torch.float32), "b": torch.ones(2 << 20)}
    manifest = write_state_dir(
        tmp_path / "p", kind_format=KIND, state=state, documents={"doc": 1}, header={}
    )
    data = sorted(name for name in manifest.files if name.endswith(".distcp"))
    assert data == ["state/__0_0.distcp", "state/__0_1.distcp"]
    assert not [name for name in read_back if name.endswith(".distcp")]
    for name, digest in manifest.files.items():
        raw = (tmp_path / "p" / name).read_bytes()
        assert digest == FileDigest(hashlib.sha256(raw).hexdigest(), len(raw)), name
    assert verify_state_dir(tmp_path / "p", kind_format=KIND)[1] == ()


def test_a_stream_that_seeks_is_read_back(tmp_path: Path) -> None:
    # Bytes hashed in write order are the file's only when nothing seeks.
    with open(tmp_path / "f", "wb") as handle:
        stream = _state_dir._HashingStream(handle)
        stream.write(b"abcd")
        stream.seek(0)
        stream.write(b"x")
        stream.close()
    assert stream.digest is None
    with open(tmp_path / "g", "wb") as handle:
        stream = _state_dir._HashingStream(handle)
        stream.write(memoryview(np.arange(3, dtype=np.int64)))
        stream.close()
    raw = (tmp_path / "g").read_bytes()
    assert stream.digest == FileDigest(hashlib.sha256(raw).hexdigest(), 24)


def test_an_existing_path_is_refused_and_kept(written: Path) -> None:
    before = (written / "manifest.json").read_bytes()
    with pytest.raises(FileExistsError):
        write_state_dir(
            written, kind_format=KIND, state={"x": torch.ones(2)}, documents={}, header={}
        )
    assert (written / "manifest.json").read_bytes() == before


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_manifest(manifest: Any) -> bytes:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_state_dir, "manifest_document", failing_manifest)
    with pytest.raises(OSError):
        write_state_dir(
            tmp_path / "p", kind_format=KIND, state={"x": torch.ones(2)}, documents={}, header={}
        )
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_is_written_last_and_the_state_folder_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    real_write, real_sync = _state_dir.write_synced, _state_dir.fsync_directory
    monkeypatch.setattr(
        _state_dir,
        "write_synced",
        lambda path, chunks: (order.append(path.name), real_write(path, chunks)),
    )
    monkeypatch.setattr(
        _state_dir,
        "fsync_directory",
        lambda path: (order.append(f"sync {path.name}"), real_sync(path)),
    )
    write_state_dir(
        tmp_path / "p", kind_format=KIND, state={"x": torch.ones(2)}, documents={"a": 1}, header={}
    )
    assert order == ["a.json", "sync state", "manifest.json"]


def test_every_violation_is_named_at_once(written: Path) -> None:
    data = written / "state" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    (written / "cursor.json").unlink()
    (written / "rng.json").write_bytes(b"{}")
    (written / "stray.bin").write_bytes(b"x")
    assert sorted(_codes(written)) == [
        "STATE_FILE_DIGEST_MISMATCH",
        "STATE_FILE_MISSING",
        "STATE_FILE_SIZE_MISMATCH",
        "STATE_FILE_UNLISTED",
    ]
    with pytest.raises(StateDirRejected) as info:
        load_state_dir(written, kind_format=KIND, state=None)
    assert len(info.value.violations) == 4
    assert all(line.startswith("STATE_") for line in info.value.lines())


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda p: (p / "manifest.json").unlink(), "STATE_MANIFEST_MISSING"),
        (lambda p: (p / "manifest.json").write_bytes(b'{"format": NaN}'), "STATE_MANIFEST_INVALID"),
        (
            lambda p: (p / "manifest.json").write_bytes(b'{"format": "nanrunbook-capsule-v1"}'),
            "STATE_FORMAT_UNKNOWN",
        ),
    ],
)
def test_a_manifest_that_is_not_one(written: Path, edit: Any, code: str) -> None:
    edit(written)
    assert _codes(written) == [code]


def test_a_path_that_is_not_a_directory(tmp_path: Path) -> None:
    assert _codes(tmp_path / "absent") == ["STATE_DIR_NOT_FOUND"]


def test_paths_outside_the_directory_are_unsafe(written: Path, tmp_path: Path) -> None:
    digest = {"sha256": "0" * 64, "size": 1}
    relist(written, lambda m: m["files"].update({"../outside": digest, "/etc/passwd": digest}))
    assert _codes(written) == ["STATE_PATH_UNSAFE", "STATE_PATH_UNSAFE"]


def test_a_symlink_out_is_refused_even_with_the_right_bytes(written: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_bytes((written / "cursor.json").read_bytes())
    (written / "cursor.json").unlink()
    (written / "cursor.json").symlink_to(outside)
    assert _codes(written) == ["STATE_FILE_SYMLINK"]
    state = written / "state"
    state.rename(tmp_path / "real-state")
    state.symlink_to(tmp_path / "real-state")
    assert sorted(_codes(written)) == ["STATE_FILE_SYMLINK"] * 3 + ["STATE_FILE_UNLISTED"]


def test_special_and_unreadable_files(written: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (written / "cursor.json").unlink()
    os.mkfifo(written / "cursor.json")
    real_open = os.open

    def failing_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith("rng.json"):
            raise OSError(5, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_state_manifest.os, "open", failing_open)
    assert sorted(_codes(written)) == ["STATE_FILE_NOT_REGULAR", "STATE_FILE_UNREADABLE"]


def test_state_without_dcp_metadata(written: Path) -> None:
    (written / "state" / ".metadata").unlink()
    relist(written, lambda m: m["files"].pop("state/.metadata"))
    assert _codes(written) == ["STATE_METADATA_MISSING"]


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_hostile_metadata_pickle_is_refused_and_runs_nothing(
    written: Path, tmp_path: Path, protocol: int
) -> None:
    marker = tmp_path / "ran"
    (written / "state" / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker), protocol))
    relist(written)  # the forger's digests match: only the pickle's contents betray it
    assert _codes(written) == ["STATE_METADATA_REFUSED"]
    model, optimizer = _model_and_optimizer(0)
    with pytest.raises(StateDirRejected) as info:
        load_state_dir(written, kind_format=KIND, state=_state(model, optimizer))
    assert info.value.codes == ("STATE_METADATA_REFUSED",)
    with pytest.raises(StateDirRejected):  # the restricted unpickler, reached directly
        read_metadata(written)
    assert not marker.exists()


def test_a_global_hidden_behind_the_memo_is_refused() -> None:
    # STACK_GLOBAL's strings fetched from the memo, as pickle itself writes them.
    hidden = pickle.dumps([torch.Size([2]), torch.Size([3]), os.system], protocol=4)
    assert _state_manifest.metadata_globals_refused(hidden) == ["posix.system"]
    assert _state_manifest.metadata_globals_refused(pickle.dumps(torch.Size([3]), 4)) == []


def test_the_loaded_state_must_match_keys_shapes_and_dtypes(written: Path) -> None:
    model, optimizer = _model_and_optimizer(0)
    state = _state(model, optimizer)
    state["model"]["0.weight"] = torch.zeros(3, 5)
    state["model"]["0.bias"] = torch.zeros(3, dtype=torch.float64)
    state["model"]["extra"] = torch.zeros(1)
    with pytest.raises(StateDirRejected) as info:
        load_state_dir(written, kind_format=KIND, state=state)
    assert info.value.codes == ("STATE_KEYS_DIFFER", "STATE_SHAPE_MISMATCH", "STATE_DTYPE_MISMATCH")
    assert torch.count_nonzero(state["model"]["0.weight"]) == 0  # nothing was loaded


def test_a_document_that_is_not_strict_json(written: Path) -> None:
    (written / "cursor.json").write_bytes(b'{"batch": NaN}')
    relist(written)
    assert _codes(written) == []
    with pytest.raises(StateDirRejected) as info:
        load_state_dir(written, kind_format=KIND, state=None)
    assert info.value.codes == ("STATE_DOCUMENT_INVALID",)


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(3, 2).to(torch.bfloat16),
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, 4),
        torch.get_rng_state(),
        np.random.get_state(),
        random.getstate(),
        {1: (2, 3), "$odd": [None, True]},
        [2**63 + 1, -(2**60), -0.0, float("inf"), -math.inf],
    ],
)
def test_encoded_values_come_back_exactly(value: Any) -> None:
    text = orjson.dumps(encode_value(value))
    back = decode_value(orjson.loads(text))
    _assert_same(back, value)


def test_an_unrecordable_value_is_named() -> None:
    with pytest.raises(TypeError, match=r"\$\.a\[1\]: a set"):
        encode_value({"a": [1, {2}]})


def test_nan_comes_back_as_nan() -> None:
    assert math.isnan(decode_value(orjson.loads(orjson.dumps(encode_value(float("nan"))))))


def _assert_same(back: Any, value: Any) -> None:
    assert type(back) is type(value)
    if isinstance(value, torch.Tensor):
        assert back.dtype == value.dtype and back.shape == value.shape
        assert torch.equal(back.view(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8))
    elif isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and np.array_equal(back, value)
    elif isinstance(value, tuple | list):
        assert len(back) == len(value)
        for a, b in zip(back, value, strict=True):
            _assert_same(a, b)
    elif isinstance(value, dict):
        assert list(back) == list(value)
        for key in value:
            _assert_same(back[key], value[key])
    elif isinstance(value, float):
        assert math.copysign(1.0, back) == math.copysign(1.0, value) and back == value
    else:
        assert back == value


def test_a_hostile_object_in_the_data_files_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    # A forger's point is consistent (the writer hashed what it wrote): only the
    # weights-only read of each stored object stands between it and a command.
    marker = tmp_path / "ran"
    target = tmp_path / "p"
    state = {"a": torch.ones(2), "b": _RunsACommand(marker)}
    write_state_dir(target, kind_format=KIND, state=state, documents={}, header={})
    assert _codes(target) == []  # its metadata names only DCP's records
    for load in (
        lambda: load_state_dir(target, kind_format=KIND, state={"a": torch.zeros(2), "b": None}),
        lambda: _state_dir.read_state_dir(target, kind_format=KIND),
    ):
        with pytest.raises(StateDirRejected) as info:
            load()
        assert info.value.codes == ("STATE_DATA_REFUSED",)
        assert "posix.system" in info.value.violations[0].message
    assert not marker.exists()

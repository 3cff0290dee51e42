"""The state directory's DCP reader (capture/torch/_dcp_reader.py): a plain
tensor record is read straight into its target, every other one DCP's own
way, and the result is bit for bit DCP's own load; a record that cannot be
read leaves every target as it was."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from nanrunbook.capture.torch import _dcp_reader
from nanrunbook.capture.torch._state_dir import (
    FORMATS,
    StateDirRejected,
    load_verified_state,
    outline_verified_state_dir,
    verify_state_dir,
    write_state_dir,
)

KIND = FORMATS["recovery_point"]


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(33, 7, generator=generator)
    return {
        "float32": floats,
        "bfloat16": floats.to(torch.bfloat16),
        "float16": floats.to(torch.float16),
        "float64": floats.double(),
        "float8": floats.to(torch.float8_e4m3fn),
        "int64": torch.arange(-50, 50),
        "int8": torch.arange(-100, 100, dtype=torch.int8),
        "bool": floats > 0,
        "complex": torch.complex(floats, -floats),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "transposed": floats.t(),  # saved with its strides: read DCP's way
        "values": {"lr": 0.25, "name": "adam"},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros(value.shape, dtype=value.dtype)
        else:
            out[key] = {name: None for name in value}
    return out


def _bits(state: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value.contiguous().reshape(-1).view(torch.uint8).clone()
        if isinstance(value, torch.Tensor)
        else value
        for key, value in state.items()
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    left, right = _bits(a), _bits(b)
    return left.keys() == right.keys() and all(
        torch.equal(x, right[k]) if isinstance(x, torch.Tensor) else x == right[k]
        for k, x in left.items()
    )


def test_every_dtype_reads_bit_for_bit_as_dcp_does_mostly_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state()
    write_state_dir(tmp_path / "d", kind_format=KIND, state=saved, documents={}, header={})
    ours, theirs = _zeros_like(saved), _zeros_like(saved)
    targets = {k: v.data_ptr() for k, v in ours.items() if isinstance(v, torch.Tensor)}
    held: list[str] = []
    real = _dcp_reader.RestrictedReader._load_record

    def counted(self: Any, handle: Any, item: Any, info: Any, target: Any) -> Any:
        held.append(item.storage_index.fqn)
        return real(self, handle, item, info, target)

    monkeypatch.setattr(_dcp_reader.RestrictedReader, "_load_record", counted)
    load_verified_state(tmp_path / "d", ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(theirs, storage_reader=FileSystemReader(tmp_path / "d" / "state"), no_dist=True)
    assert _same(ours, theirs)
    assert _same(ours, saved)
    assert held == ["transposed"]  # the one record not of its target's layout
    assert {k: v.data_ptr() for k, v in ours.items() if isinstance(v, torch.Tensor)} == targets


def test_an_outline_reads_every_dtype_into_the_live_tensors_bit_for_bit(tmp_path: Path) -> None:
    saved = _state()
    write_state_dir(tmp_path / "d", kind_format=KIND, state=saved, documents={}, header={})
    manifest, violations = verify_state_dir(tmp_path / "d", kind_format=KIND)
    assert manifest is not None and not violations
    outline = outline_verified_state_dir(tmp_path / "d", manifest)
    live = _zeros_like(saved)
    live["transposed"] = torch.zeros(33, 7).t()  # not contiguous: DCP's way, into it
    pointers = {k: v.data_ptr() for k, v in live.items() if isinstance(v, torch.Tensor)}
    read = outline.read({k: v for k, v in live.items() if isinstance(v, torch.Tensor)})
    assert _same({**read, "values": outline.saved()["values"]}, saved)
    assert [k for k in pointers if read[k] is not live[k]] == []  # the run's own tensors, in place
    assert {k: v.data_ptr() for k, v in live.items() if isinstance(v, torch.Tensor)} == pointers


def test_a_record_that_cannot_be_read_leaves_every_target_as_it_was(tmp_path: Path) -> None:
    # The plain records come first in the file; the transposed one, read DCP's
    # way, is broken: it is loaded before any plain record is written.
    saved = {"a": torch.ones(64), "b": torch.full((8, 4), 2.0).t()}
    write_state_dir(tmp_path / "d", kind_format=KIND, state=saved, documents={}, header={})
    metadata = _dcp_reader.read_metadata(tmp_path / "d")
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "b")
    path = tmp_path / "d" / "state" / info.relative_path
    raw = bytearray(path.read_bytes())
    record = bytes(raw[info.offset : info.offset + info.length])
    at = info.offset + record.index(b"_rebuild_tensor_v2")
    raw[at : at + 8] = b"_exploit"  # a global torch.load's weights-only refuses
    path.write_bytes(bytes(raw))
    live = {"a": torch.zeros(64), "b": torch.zeros(4, 8)}
    with pytest.raises(StateDirRejected) as info_:
        load_verified_state(tmp_path / "d", live)
    assert info_.value.codes == ("STATE_DATA_REFUSED",)
    assert torch.equal(live["a"], torch.zeros(64)) and torch.equal(live["b"], torch.zeros(4, 8))


def test_a_disk_that_fails_after_the_first_write_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {"a": torch.ones(64), "b": torch.full((32,), 2.0)}
    write_state_dir(tmp_path / "d", kind_format=KIND, state=saved, documents={}, header={})
    calls: list[int] = []
    real = os.preadv

    def failing(fd: int, buffers: Any, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(_dcp_reader.os, "preadv", failing)
    monkeypatch.setattr(_dcp_reader, "_READ_THREADS", 1)
    with pytest.raises(StateDirRejected) as info:
        load_verified_state(tmp_path / "d", {"a": torch.zeros(64), "b": torch.zeros(32)})
    assert info.value.codes == ("STATE_READ_INTERRUPTED",)
    assert "do not go on from it" in info.value.violations[0].message


def test_the_stored_zip_reading_finds_every_place_torchs_reader_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_state_dir(tmp_path / "d", kind_format=KIND, state=_state(), documents={}, header={})
    metadata = _dcp_reader.read_metadata(tmp_path / "d")
    ours = _dcp_reader.record_places(tmp_path / "d", metadata).found
    monkeypatch.setattr(_dcp_reader._StoredZip, "of", classmethod(lambda *_: None))
    torchs = _dcp_reader.record_places(tmp_path / "d", metadata).found
    assert ours == torchs
    assert sum(place is not None for place in ours.values()) == len(ours) - 1  # all but transposed


def test_a_damaged_record_is_read_dcps_way_or_not_at_all_never_a_crash(tmp_path: Path) -> None:
    # Every byte of a record's zip structure flipped in turn: the place is
    # found, or not (DCP's own reader then decides), and nothing escapes.
    write_state_dir(
        tmp_path / "d", kind_format=KIND, state={"a": torch.ones(16)}, documents={}, header={}
    )
    metadata = _dcp_reader.read_metadata(tmp_path / "d")
    [(index, info)] = list(metadata.storage_data.items())
    path = tmp_path / "d" / "state" / info.relative_path
    clean = path.read_bytes()
    found = 0
    for at in [*range(info.offset, info.offset + 200), *range(len(clean) - 700, len(clean))]:
        damaged = bytearray(clean)
        damaged[at] ^= 0xFF
        path.write_bytes(bytes(damaged))
        place = _dcp_reader.record_places(tmp_path / "d", metadata).found[index]
        found += place is not None
        if place is not None:
            assert (
                info.offset <= place.offset
                and place.offset + place.nbytes <= info.offset + info.length
            )
    assert 0 < found < 900

"""scan_range: one bounded pass computing SHA-256 and exact counts."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_tally import reference, reference_c64

from nanrunbook.tensors import scan as scan_module
from nanrunbook.tensors.counting import Tally
from nanrunbook.tensors.scan import CHUNK_SIZE, ShortRead, scan_range

PREFIX = b"\xffHEADER-AND-OTHER-TENSORS\x7f"
SUFFIX = b"\x00\x80TRAILING"


@contextmanager
def file_with(content: bytes) -> Iterator[int]:
    with tempfile.TemporaryFile() as handle:
        handle.write(content)
        handle.flush()
        yield handle.fileno()


f32_value = st.one_of(
    st.floats(width=32),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0]),
)
values_f32 = st.lists(f32_value, max_size=80)


@settings(max_examples=150, deadline=None)
@given(values=values_f32, buffer_size=st.integers(1, 70))
def test_small_buffers_match_reference(values: list[float], buffer_size: int) -> None:
    arr = np.array(values, dtype="<f4")
    data = arr.tobytes()
    with file_with(PREFIX + data + SUFFIX) as fd:
        if buffer_size < 4 and data:
            with pytest.raises(ValueError):
                scan_range(fd, len(PREFIX), len(data), "F32", buffer=bytearray(buffer_size))
            return
        got = scan_range(fd, len(PREFIX), len(data), "F32", buffer=bytearray(buffer_size))
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.tally == reference(arr)


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(st.tuples(f32_value, f32_value), max_size=40),
    buffer_units=st.integers(1, 5),
    slack=st.integers(0, 7),
)
def test_c64_with_small_buffers(
    pairs: list[tuple[float, float]], buffer_units: int, slack: int
) -> None:
    parts = np.array(pairs, dtype="<f4").reshape(-1, 2)
    data = parts.tobytes()
    buffer = bytearray(8 * buffer_units + slack)
    with file_with(PREFIX + data + SUFFIX) as fd:
        got = scan_range(fd, len(PREFIX), len(data), "C64", buffer=buffer)
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.tally == reference_c64(parts[:, 0], parts[:, 1])


def test_nan_straddles_chunk_boundary() -> None:
    nan = float("nan")
    arr = np.array([1.0, nan, nan, -4.0, np.inf, 0.5], dtype="<f4")
    data = arr.tobytes()
    with file_with(PREFIX + data) as fd:
        # 8-byte buffer: chunks [1, nan] [nan, -4] [inf, 0.5]
        got = scan_range(fd, len(PREFIX), len(data), "F32", buffer=bytearray(8))
    assert got.tally == Tally(6, 3, 2, 1, 0, 4.0)
    assert got.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    ("dtype", "raw", "expected"),
    [
        ("F8_E4M3", bytes([0x7E, 0x7F, 0xFF, 0x01, 0x80]), Tally(5, 3, 2, 0, 0, 448.0)),
        ("F4", bytes([0x17, 0xF0, 0x00]), Tally(6, 6, 0, 0, 0, 6.0)),
        ("F6_E2M3", bytes([0x3F, 0, 0, 0, 0, 0]), Tally(8, 8, 0, 0, 0, 7.5)),
        ("BF16", bytes.fromhex("803f c0ff 8040"), Tally(3, 2, 1, 0, 0, 4.0)),
        ("I64", bytes(range(24)), Tally(3, 3, 0, 0, 0, None)),
    ],
)
@pytest.mark.parametrize("buffer_size", [None, 3, 6, 7, 24])
def test_other_dtypes_any_buffer(
    dtype: str, raw: bytes, expected: Tally, buffer_size: int | None
) -> None:
    buffer = None if buffer_size is None else bytearray(buffer_size)
    align = {"BF16": 2, "F6_E2M3": 3, "I64": 8}.get(dtype, 1)
    with file_with(PREFIX + raw + SUFFIX) as fd:
        if buffer_size is not None and buffer_size < align:
            with pytest.raises(ValueError):
                scan_range(fd, len(PREFIX), len(raw), dtype, buffer=buffer)
            return
        got = scan_range(fd, len(PREFIX), len(raw), dtype, buffer=buffer)
    assert got.tally == expected
    assert got.sha256 == hashlib.sha256(raw).hexdigest()


def test_empty_range_and_scalar() -> None:
    with file_with(PREFIX) as fd:
        empty = scan_range(fd, len(PREFIX), 0, "F32")
        assert empty.tally == Tally(0, 0, 0, 0, 0, None)
        assert empty.sha256 == hashlib.sha256(b"").hexdigest()
        assert scan_range(fd, 10_000, 0, "BF16").tally.elements == 0
    scalar = np.array([np.nan], dtype="<f8").tobytes()
    with file_with(scalar) as fd:
        assert scan_range(fd, 0, 8, "F64").tally == Tally(1, 0, 1, 0, 0, None)


def test_default_chunk_boundary() -> None:
    assert CHUNK_SIZE % 24 == 0 and 0 < CHUNK_SIZE <= 4 * 1024 * 1024
    per_chunk = CHUNK_SIZE // 4
    arr = np.ones(per_chunk + 3, dtype="<f4")
    arr[per_chunk - 1] = np.nan  # last element of the first chunk
    arr[per_chunk] = -np.inf  # first element of the second
    arr[-1] = -9.0
    data = arr.tobytes()
    with file_with(PREFIX + data) as fd:
        got = scan_range(fd, len(PREFIX), len(data), "F32")
    assert got.tally == Tally(per_chunk + 3, per_chunk + 1, 1, 0, 1, 9.0)
    assert got.sha256 == hashlib.sha256(data).hexdigest()


def test_short_file() -> None:
    data = np.arange(10, dtype="<f4").tobytes()
    with file_with(PREFIX + data) as fd:
        with pytest.raises(ShortRead) as caught:
            scan_range(fd, len(PREFIX), len(data) + 4, "F32", buffer=bytearray(8))
        assert caught.value.got == len(data)
        with pytest.raises(ShortRead):
            scan_range(fd, len(PREFIX) + len(data) + 100, 4, "F32")


def test_rejects_bad_ranges() -> None:
    with file_with(bytes(64)) as fd:
        with pytest.raises(ValueError):
            scan_range(fd, 0, 6, "F32")  # not whole elements
        with pytest.raises(ValueError):
            scan_range(fd, -1, 4, "F32")
        with pytest.raises(ValueError):
            scan_range(fd, 0, -4, "F32")
        with pytest.raises(ValueError):
            scan_range(fd, 0, 4, "F33")


def test_reads_are_bounded_and_partial_reads_handled(monkeypatch: pytest.MonkeyPatch) -> None:
    arr = np.array([0.5, np.nan, -3.0, np.inf] * 25, dtype="<f4")
    data = arr.tobytes()
    asked: list[int] = []
    real_preadv = os.preadv

    def stingy_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        asked.append(sum(len(b) for b in buffers))
        # return at most 5 bytes: a legal short read that is not EOF
        return real_preadv(fd, [buffers[0][:5]], offset)

    monkeypatch.setattr(os, "preadv", stingy_preadv)
    with file_with(PREFIX + data) as fd:
        before = os.lseek(fd, 0, os.SEEK_CUR)
        got = scan_range(fd, len(PREFIX), len(data), "F32", buffer=bytearray(16))
        assert os.lseek(fd, 0, os.SEEK_CUR) == before
    assert max(asked) <= 16
    assert got.tally == reference(arr)
    assert got.sha256 == hashlib.sha256(data).hexdigest()


def test_pread_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    arr = np.array([1.0, -np.inf, 2.0], dtype="<f8")
    data = arr.tobytes()
    monkeypatch.delattr(os, "preadv")
    assert scan_module.os is os
    with file_with(PREFIX + data) as fd:
        got = scan_range(fd, len(PREFIX), len(data), "F64", buffer=bytearray(8))
    assert got.tally == Tally(3, 2, 0, 0, 1, 2.0)
    assert got.sha256 == hashlib.sha256(data).hexdigest()


def test_on_chunk_reports_each_chunk_and_can_stop_the_scan() -> None:
    data = np.arange(100, dtype="<f4").tobytes()
    seen: list[int] = []
    with file_with(PREFIX + data) as fd:
        got = scan_range(
            fd, len(PREFIX), len(data), "F32", buffer=bytearray(48), on_chunk=seen.append
        )
        assert got.sha256 == hashlib.sha256(data).hexdigest()
        assert seen == [48] * 8 + [16]

        def stop(nbytes: int) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            scan_range(fd, len(PREFIX), len(data), "F32", buffer=bytearray(48), on_chunk=stop)


def test_sequential_read_hint_on_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    hints: list[tuple[int, int, int]] = []

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        hints.append((offset, length, advice))
        raise OSError(22, "refused")  # a refused hint changes nothing

    monkeypatch.setattr(os, "posix_fadvise", advise)
    data = np.ones(10, dtype="<f4").tobytes()
    with file_with(PREFIX + data) as fd:
        got = scan_range(fd, len(PREFIX), len(data), "F32")
        scan_range(fd, len(PREFIX), 0, "F32")  # nothing to read, no hint
    assert got.tally == reference(np.ones(10, dtype="<f4"))
    assert hints == [(len(PREFIX), len(data), os.POSIX_FADV_SEQUENTIAL)]


@settings(max_examples=100, deadline=None)
@given(values=values_f32, buffer_size=st.integers(4, 70))
def test_overlapped_read_matches_reference(values: list[float], buffer_size: int) -> None:
    # With a spare buffer a helper thread reads and counts ahead while this one hashes.
    arr = np.array(values, dtype="<f4")
    data = arr.tobytes()
    chunks: list[int] = []
    with file_with(PREFIX + data + SUFFIX) as fd:
        got = scan_range(
            fd,
            len(PREFIX),
            len(data),
            "F32",
            buffer=bytearray(buffer_size),
            spare=bytearray(buffer_size),
            on_chunk=chunks.append,
        )
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.tally == reference(arr)
    assert sum(chunks) == len(data)


def helper_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name == "nanrunbook-read"]


def test_overlapped_short_read_and_stop() -> None:
    data = np.arange(100, dtype="<f4").tobytes()
    with file_with(PREFIX + data) as fd:
        with pytest.raises(ShortRead) as caught:
            scan_range(
                fd, len(PREFIX), len(data) + 8, "F32", buffer=bytearray(48), spare=bytearray(48)
            )
        assert caught.value.got == len(data)

        def stop(nbytes: int) -> None:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            scan_range(
                fd,
                len(PREFIX),
                len(data),
                "F32",
                buffer=bytearray(48),
                spare=bytearray(48),
                on_chunk=stop,
            )
    assert helper_threads() == []  # the helper is joined before the scan returns

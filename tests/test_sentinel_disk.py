"""Telemetry on a disk that fills up: the run goes on, the gap is recorded, a
hold still holds."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sentinel_support import (
    Regressor,
    Sentinel,
    facts,
    mse,
    params_finite,
    quiet_thresholds,
    regression_batch,
    run_loop,
    state_bits,
    telemetry,
)

from nanrunbook.capture.telemetry import TelemetryFile


class Disk:
    """os.write for the telemetry files only: ENOSPC while ``full``, and with
    ``partial`` the first write of a line stops half-way first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.partial = False
        self.refused = 0
        self._real = os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: Any) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else ""
        if self.full and target.endswith(".jsonl"):
            if self.partial and len(data) > 1:
                self.partial = False
                return self._real(fd, bytes(data)[: len(data) // 2])
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._real(fd, data)


def _train(tmp: Path, disk: Disk, full_at: set[int], nan_at: int | None = None) -> Any:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    sentinel = Sentinel(model, optimizer, mse, thresholds=quiet_thresholds(), **facts("disk", tmp))

    def step(i: int) -> torch.Tensor:
        disk.full = i in full_at
        batch = regression_batch(i)
        if i == nan_at:
            batch["x"][0, 0] = float("nan")
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        return loss

    ran = run_loop(step, 12, lambda: state_bits(model, optimizer))
    sentinel.close()
    before = ran.before.get(nan_at) if nan_at is not None else None
    return model, optimizer, sentinel, ran.hold, before


def test_a_full_disk_under_the_telemetry_does_not_end_a_healthy_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = Disk(monkeypatch)
    disk.partial = True
    with caplog.at_level(logging.WARNING, logger="nanrunbook.sentinel"):
        model, _, _, hold, _ = _train(tmp_path, disk, full_at={4, 5, 6, 7})
    assert hold is None and params_finite(model)
    lines = telemetry(tmp_path, "disk")  # every line whole: the half-written one was cut
    steps = [line["step"] for line in lines]
    missing = sorted(set(range(1, 13)) - set(steps))
    assert disk.refused == len(missing) >= 3 and steps == sorted(steps)
    assert missing == list(range(missing[0], missing[-1] + 1))  # one gap
    after = lines[steps.index(missing[-1] + 1)]
    [lost] = [w for w in after["warnings"] if w["code"] == "TELEMETRY_LINES_LOST"]
    assert f"{len(missing)} telemetry line(s)" in lost["message"]
    assert f"steps {missing[0]} to {missing[-1]}" in lost["message"]
    assert "No space left on device" in lost["message"]
    assert sum(w["code"] == "TELEMETRY_LINES_LOST" for line in lines for w in line["warnings"]) == 1
    cannot = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(cannot) == 1  # logged once for the gap


def test_a_disk_full_to_the_end_and_at_exit_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = Disk(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nanrunbook.sentinel"):
        _, _, sentinel, hold, _ = _train(tmp_path, disk, full_at=set(range(9, 13)))
    assert hold is None and sentinel.closed
    assert [line["step"] for line in telemetry(tmp_path, "disk")] == list(range(1, 8))
    assert any("never written" in r.getMessage() for r in caplog.records)


def test_a_hold_on_a_full_disk_still_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk(monkeypatch)
    model, optimizer, _, hold, before = _train(tmp_path, disk, full_at={5, 6}, nan_at=6)
    assert hold is not None and hold.step == 6 and hold.stage == "input"
    assert state_bits(model, optimizer) == before  # the held update changed nothing


def test_the_file_writes_again_and_keeps_no_partial_line(tmp_path: Path) -> None:
    """The writer alone: an error mid-line leaves the file as it was."""
    from nanrunbook.telemetry.record import GradientStats, TelemetryRecord

    def record(step: int) -> TelemetryRecord:
        return TelemetryRecord(
            "r", 0, 1, step, 1.0, 1.0, "finite", GradientStats(), None, None, None, False, False,
            (), None,
        )  # fmt: skip

    path = tmp_path / "t.jsonl"
    sink = TelemetryFile(path)
    sink.append(record(1))
    size = path.stat().st_size
    real = os.write
    calls = {"n": 0}

    def half_then_full(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real(fd, bytes(data)[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    os.write = half_then_full  # type: ignore[assignment]
    try:
        sink.append(record(2))
    finally:
        os.write = real
    assert path.stat().st_size == size and sink.lost is not None and sink.lost.lines == 1
    sink.append(record(3))
    sink.close()
    assert sink.lost is None
    import json

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 3]
    assert lines[1]["warnings"][0]["code"] == "TELEMETRY_LINES_LOST"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only; skipped where it cannot be mounted)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        timeout=30,
    )
    if done.returncode:
        pytest.skip(f"no tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_a_real_full_tmpfs_ends_nothing_and_the_gap_is_recorded(tiny_disk: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    sentinel = Sentinel(
        model, optimizer, mse, thresholds=quiet_thresholds(), **facts("tiny", tiny_disk)
    )
    filler = tiny_disk / "filler"

    def step(i: int) -> None:
        optimizer.zero_grad()
        sentinel.forward(regression_batch(i)).backward()
        optimizer.step()

    for i in range(1, 4):
        step(i)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to the last byte
        for size in (4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    for i in range(4, 16):  # more lines than the file's last page still holds
        step(i)
    filler.unlink()  # space returns
    for i in range(16, 19):
        step(i)
    sentinel.close()
    lines = telemetry(tiny_disk, "tiny")
    steps = [line["step"] for line in lines]
    assert steps[-1] == 18 and len(steps) < 18 and params_finite(model)
    lost = [w["message"] for line in lines for w in line["warnings"]]
    assert any(f"{18 - len(steps)} telemetry line(s)" in m for m in lost), lost

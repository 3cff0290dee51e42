"""watch --follow: a writer appends (in halves, as a writer mid-line would),
rotates and truncates the file while the follower reads it; every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import telemetry_runs

from nanrunbook.telemetry.follow import Follower, FollowNotice
from nanrunbook.telemetry.reader import BadLine
from nanrunbook.telemetry.record import TelemetryRecord

TIMEOUT = 90


@pytest.fixture(scope="module")
def lines(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """The blow-up run's telemetry lines, newline included."""
    path = tmp_path_factory.mktemp("blowup") / "blowup.jsonl"
    telemetry_runs.blowup(path)
    return path.read_bytes().splitlines(keepends=True)


def start(path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nanrunbook", "watch", str(path), "--follow", "-f", "kv", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell may start background jobs with SIGINT ignored: give it back.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_following(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    first = process.stdout.readline()  # flushed by the follower once the backlog is read
    assert first.startswith("event=following"), first
    return first


def finish(process: subprocess.Popen[str]) -> tuple[int, list[str], str]:
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out.splitlines(), err


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


def write_in_halves(path: Path, lines: list[bytes], pause: float = 0.12) -> None:
    for line in lines:
        middle = len(line) // 2
        append(path, line[:middle])
        time.sleep(pause)  # the follower polls while the line is half written
        append(path, line[middle:])


def test_follow_prints_events_as_they_come_and_waits_for_partial_lines(
    tmp_path: Path, lines: list[bytes]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(lines[:3]))
    process = start(path, "--stop-after-idle", "2")
    try:
        wait_following(process)
        write_in_halves(path, lines[3:])
    finally:
        code, out, err = finish(process)
    assert code == 1, err
    events = [line.split("=", 1)[1] for line in out if line.startswith("event=")]
    last_step = len(lines) - 1
    assert not any(e.startswith("bad_line") for e in events), events
    warnings = [e for e in events if e.startswith("warning")]
    # Each warning is said once, at its onset, however many steps it lasts: the
    # gradient norm's divergence (the loss's began in the backlog) and the
    # falling headroom.
    assert [w.split()[2] for w in warnings] == ["GRAD_NORM_DIVERGENCE", "HEADROOM_FALLING"]
    assert events[-2:] == [f"nonfinite {last_step} loss:posinf", f"hold {last_step}"]
    assert all(int(w.split()[1]) < last_step for w in warnings)
    assert f"records={len(lines)}" in out and "status=ALARM" in out
    assert "incomplete_line=none" in out and "bad_lines=0" in out


def test_follow_notices_rotation_and_reads_the_old_file_to_its_end(
    tmp_path: Path, lines: list[bytes]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(lines[:8]))
    process = start(path, "--stop-after-idle", "2")
    try:
        wait_following(process)
        os.rename(path, tmp_path / "t.jsonl.1")
        append(tmp_path / "t.jsonl.1", b"".join(lines[8:10]))  # the writer has not reopened yet
        time.sleep(0.5)
        write_in_halves(path, lines[10:])  # the writer's new file
    finally:
        code, out, err = finish(process)
    assert code == 1, err
    assert "event=rotated" in out
    assert f"records={len(lines)}" in out and "rotations=1" in out and "bad_lines=0" in out


def test_follow_notices_truncation(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(lines[:12]))
    process = start(path, "--stop-after-idle", "2")
    try:
        wait_following(process)
        with open(path, "r+b") as handle:
            handle.truncate(0)  # copytruncate, or a writer starting the file again
        time.sleep(0.5)
        write_in_halves(path, lines[12:16])
    finally:
        code, out, err = finish(process)
    assert code == 0, err
    assert "event=truncated" in out and "truncations=1" in out
    assert "records=16" in out and "status=WARNINGS" in out


def test_until_step_stops_the_follower(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(lines[:2]))
    process = start(path, "--until-step", "6")
    threading.Thread(target=write_in_halves, args=(path, lines[2:10], 0.05), daemon=True).start()
    code, out, err = finish(process)
    assert code == 0, err
    last = next(line for line in out if line.startswith("last_step="))
    assert 6 <= int(last.split("=")[1]) <= 9


def test_a_reader_that_goes_away_stops_the_follower(tmp_path: Path, lines: list[bytes]) -> None:
    """``watch --follow | head -1``: once the pipe is closed, the next event ends
    the follow, and the exit status is still the summary's."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(lines[:3]))
    process = start(path)
    wait_following(process)
    assert process.stdout is not None
    process.stdout.close()
    append(path, b"".join(lines[3:]))  # a warning and a hold: events to write
    assert process.wait(timeout=TIMEOUT) == 1
    assert process.stderr is not None and "Traceback" not in process.stderr.read()


def test_ctrl_c_exits_130_with_the_summary(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(lines[:5]))
    process = start(path)
    wait_following(process)
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process)
    assert code == 130
    assert err.strip() == "nanrunbook: interrupted"
    # The blow-up's loss rises 30x a step from its first steps: a warning already.
    assert "records=5" in out and "status=WARNINGS" in out


def test_following_a_missing_file_exits_3(tmp_path: Path) -> None:
    """Waited for, as tail -F does, no longer than --stop-after-idle allows."""
    process = start(tmp_path / "absent.jsonl", "--stop-after-idle", "1")
    code, out, err = finish(process)
    assert code == 3 and "no such file after waiting 1 s" in err and out == ["event=waiting"]


# --------------------------------------------- the follower itself, step by step


def records(items: list[TelemetryRecord | BadLine | FollowNotice]) -> list[int]:
    return [item.step for item in items if isinstance(item, TelemetryRecord)]


def notices(items: list[TelemetryRecord | BadLine | FollowNotice]) -> list[str]:
    return [item.kind for item in items if isinstance(item, FollowNotice)]


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[tuple[Path, Follower]]:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"")
    follower = Follower(path)
    yield path, follower
    follower.close()


def test_follower_hands_out_a_line_only_when_its_newline_is_written(
    follower: tuple[Path, Follower], lines: list[bytes]
) -> None:
    path, tail = follower
    append(path, lines[0] + lines[1][:30])
    assert records(tail.read_available()) == [0]
    assert tail.incomplete() is not None and tail.incomplete().line == 2  # type: ignore[union-attr]
    assert tail.read_available() == []
    append(path, lines[1][30:])
    assert records(tail.read_available()) == [1]
    assert tail.incomplete() is None


def test_follower_rotation_truncation_and_disappearance(
    follower: tuple[Path, Follower], lines: list[bytes]
) -> None:
    path, tail = follower
    append(path, b"".join(lines[:4]))
    assert records(tail.read_available()) == [0, 1, 2, 3]
    path.write_bytes(lines[4])  # truncated and rewritten shorter
    items = tail.read_available()
    assert notices(items) == ["truncated"]
    assert records(tail.read_available()) == [4]
    os.rename(path, path.with_suffix(".old"))
    append(path.with_suffix(".old"), lines[5])
    items = tail.read_available()
    assert records(items) == [5] and notices(items) == ["missing"]
    assert tail.read_available() == []  # said once
    path.write_bytes(lines[6])
    items = tail.read_available()
    assert notices(items) == ["rotated"]
    assert records(items + tail.read_available()) == [6]
    assert tail.lines == 1  # line numbers start again in the new file


def test_follow_waits_for_a_file_not_written_yet(tmp_path: Path, lines: list[bytes]) -> None:
    """As tail -F does: the run starts after the watcher."""
    path = tmp_path / "late.jsonl"
    process = start(path, "--wait-for-file", "60", "--until-step", str(len(lines) - 1))
    assert process.stdout is not None
    first = process.stdout.readline()
    assert first.startswith("event=waiting"), first
    path.write_bytes(b"".join(lines))
    code, out, err = finish(process)
    assert code == 1, err  # the blow-up run holds
    assert out[0].startswith("event=following") and f"records={len(lines)}" in out


def test_follow_gives_up_on_a_missing_file_after_its_bound(tmp_path: Path) -> None:
    started = time.monotonic()
    process = start(tmp_path / "never.jsonl", "--wait-for-file", "0.5")
    code, out, err = finish(process)
    assert code == 3 and out == ["event=waiting"]
    assert "never.jsonl: no such file after waiting 0.5 s for it" in err
    assert time.monotonic() - started < 30
    usage = subprocess.run(
        [sys.executable, "-m", "nanrunbook", "watch", "x.jsonl", "--wait-for-file", "1"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert usage.returncode == 2 and "--wait-for-file: it needs --follow" in usage.stderr

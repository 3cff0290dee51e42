"""Summarising a telemetry file once, or as it grows: readers and the summariser joined."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from nanrunbook.telemetry._job import JobFollower, job_files, merged
from nanrunbook.telemetry.follow import Follower, FollowNotice
from nanrunbook.telemetry.reader import (
    BadLine,
    IncompleteLine,
    TelemetryReader,
    TelemetryUnreadable,
    parse_line,
)
from nanrunbook.telemetry.record import COMMON_LINE, CommonLine, TelemetryRecord
from nanrunbook.telemetry.summary import DEFAULT_WINDOW, Summariser, WatchEvent, WatchSummary

__all__ = [
    "FollowInterrupted",
    "consume",
    "count_lines",
    "follow",
    "summarise_file",
    "summarise_job",
]


class FollowInterrupted(KeyboardInterrupt):
    """Ctrl-C while following; ``summary`` is everything read until then."""

    def __init__(self, summary: WatchSummary) -> None:
        super().__init__()
        self.summary = summary


def summarise_file(
    path: Path | str, *, since: int | None = None, window: int = DEFAULT_WINDOW
) -> WatchSummary:
    """The summary of the whole file as it is now, streamed in bounded memory.
    Raises TelemetryUnreadable when the path cannot be read at all."""
    summariser = Summariser(str(path), since=since, window=window)
    reader = TelemetryReader(path)
    for pieces in reader.batches():
        count_lines(summariser, pieces)
    ending = reader.ending()
    if isinstance(ending, IncompleteLine):
        summariser.add_incomplete(ending)
    elif ending is not None:
        consume(summariser, ending)
    return summariser.summary(lines=reader.lines)


def summarise_job(
    paths: Sequence[Path], *, since: int | None = None, window: int = DEFAULT_WINDOW
) -> WatchSummary:
    """The summary of a job's telemetry: ``paths`` (files, or a run directory
    standing for its ``telemetry*.jsonl`` files) read as one stream merged by
    step, record by record. One file is :func:`summarise_file`'s. Raises
    TelemetryUnreadable when a path cannot be read."""
    files = job_files(paths)
    if len(files) == 1:
        return summarise_file(files[0], since=since, window=window)
    label = str(paths[0]) if len(paths) == 1 else ", ".join(map(str, paths))
    names = tuple(str(f) for f in files)
    summariser = Summariser(label, since=since, window=window, files=names)
    readers = [TelemetryReader(f) for f in files]
    for item in merged(readers):
        if isinstance(item, IncompleteLine):
            summariser.add_incomplete(item)
        else:
            consume(summariser, item)
    return summariser.summary(lines=sum(r.lines for r in readers))


def count_lines(summariser: Summariser, pieces: list[tuple[int, bytes] | BadLine]) -> None:
    """Count whole lines quietly. Runs of uneventful lines (:data:`COMMON_LINE`
    decodes them) are counted the fast way, a run at once where
    :meth:`Summariser.add_lines` can, else line by line (:meth:`~Summariser.add_line`);
    every other line is parsed and judged as :func:`parse_line` does, so that
    its record, or its bad line, is the same."""
    decode, refused = COMMON_LINE.decode, msgspec.DecodeError
    run: list[CommonLine] = []
    start = 0  # of the run in pieces
    for piece in pieces:
        if type(piece) is tuple:
            try:
                run.append(decode(piece[1]))
                continue
            except refused:
                pass
        if run:
            _count_run(summariser, run, pieces, start)
        start += len(run) + 1
        run = []
        _count_strictly(summariser, piece)
    if run:
        _count_run(summariser, run, pieces, start)


def _count_run(
    summariser: Summariser, run: list[CommonLine], pieces: list[Any], start: int
) -> None:
    """``run`` decoded from ``pieces[start:]``, one line each. What keeps a run
    from being plain sits mostly at its start (the streak a skipped step left,
    the backoff after it): a few lines one by one, then the rest at once."""
    last_raw = pieces[start + len(run) - 1][1]
    for done, line in enumerate(run):
        if done <= _RETRIES and summariser.add_lines(run[done:], last_raw):
            return
        if not summariser.add_line(line, pieces[start + done][1]):
            _count_strictly(summariser, pieces[start + done])


_RETRIES = 3


def _count_strictly(summariser: Summariser, piece: tuple[int, bytes] | BadLine) -> None:
    if isinstance(piece, BadLine):
        summariser.add_bad(piece)
        return
    parsed = parse_line(*piece)
    if parsed is not None:
        consume(summariser, parsed)


Item = TelemetryRecord | BadLine | FollowNotice


def consume(summariser: Summariser, item: Item) -> list[WatchEvent]:
    """Count one item; the events a live watcher says about it."""
    if isinstance(item, TelemetryRecord):
        return summariser.add(item)
    if isinstance(item, BadLine):
        return [summariser.add_bad(item)]
    return [summariser.notice(item.kind, item.message)]


def follow(
    summariser: Summariser,
    on_event: Callable[[WatchEvent], bool | None],
    *,
    poll_interval: float = 0.1,
    stop_after_idle: float | None = None,
    until_step: int | None = None,
    wait_for_file: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    paths: Sequence[Path] | None = None,
) -> WatchSummary:
    """Summarise ``summariser.path`` as it grows, calling ``on_event`` for what
    happens after the lines already there (those are counted quietly, then one
    ``following`` event says where reading stands). Returns when a record at or
    past ``until_step`` has been read, after ``stop_after_idle`` seconds without
    a new line, when ``on_event`` returns False (its reader went away), or
    never: Ctrl-C raises FollowInterrupted, which carries the summary of
    everything read. A file that does not exist yet is waited for, as
    ``tail -F`` does, for at most ``wait_for_file`` seconds (then
    TelemetryUnreadable). With ``paths`` (a job's files, or its run directory)
    every file is followed, merged by step."""

    def opened() -> Follower | JobFollower:
        given = Path(summariser.path)
        if paths is None and not given.is_dir():
            return Follower(given)
        return JobFollower(paths or [given])  # a run directory that appeared while waited for

    try:
        follower = _when_it_exists(
            summariser, opened, on_event, wait_for_file, poll_interval, clock, sleep
        )
    except KeyboardInterrupt:
        raise FollowInterrupted(summariser.summary(lines=0)) from None
    try:
        stop = False
        for item in follower.read_available():
            consume(summariser, item)
            stop = stop or _reached(item, until_step)
        following = summariser.notice("following", _following(follower, summariser))
        stop = on_event(following) is False or stop
        idle_since = clock()
        while not stop:
            if stop_after_idle is not None and clock() - idle_since >= stop_after_idle:
                break
            sleep(poll_interval)
            items = follower.read_available()
            if items:
                idle_since = clock()
            for item in items:
                for event in consume(summariser, item):
                    stop = on_event(event) is False or stop
                stop = stop or _reached(item, until_step)
    except KeyboardInterrupt:
        _ending(summariser, follower)
        raise FollowInterrupted(summariser.summary(lines=follower.lines)) from None
    finally:
        follower.close()
    _ending(summariser, follower)
    return summariser.summary(lines=follower.lines)


def _ending(summariser: Summariser, follower: Follower | JobFollower) -> None:
    summariser.add_incomplete(follower.incomplete())
    if isinstance(follower, JobFollower) and len(follower.followers) > 1:
        summariser.files = follower.files


def _when_it_exists(
    summariser: Summariser,
    opened: Callable[[], Follower | JobFollower],
    on_event: Callable[[WatchEvent], bool | None],
    bound: float,
    poll_interval: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> Follower | JobFollower:
    """``opened()`` once the files exist, within ``bound`` seconds (a run
    directory: once it holds a telemetry file)."""
    started = clock()
    said = False
    while True:
        try:
            return opened()
        except TelemetryUnreadable:
            given = Path(summariser.path)
            if not bound or (given.exists() and not given.is_dir()) or given.is_symlink():
                raise
            waited = clock() - started
            if waited >= bound:
                raise TelemetryUnreadable(
                    f"{summariser.path}: no such file after waiting {bound:g} s for it"
                ) from None
            if not said:
                missing = "holds no telemetry file" if given.is_dir() else "does not exist"
                message = (
                    f"{summariser.path} {missing} yet; waiting up to {bound:g} s for it"
                    " (--wait-for-file; Ctrl-C to stop)"
                )
                said = True
                if on_event(summariser.notice("waiting", message)) is False:
                    raise
        sleep(min(poll_interval, max(bound - waited, 0.0)))


def _reached(item: Item, until_step: int | None) -> bool:
    return until_step is not None and isinstance(item, TelemetryRecord) and item.step >= until_step


def _following(follower: Follower | JobFollower, summariser: Summariser) -> str:
    read = f"read {follower.lines} lines, {summariser.records} records of {follower.path}"
    return f"{read}; waiting for new lines (Ctrl-C to stop)"

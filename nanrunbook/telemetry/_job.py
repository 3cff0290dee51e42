"""A whole job's telemetry: every rank's file read as one stream, by step.

The sentinel of a job of several ranks writes one file per rank beside the
run's bundles (``incident/<run>/telemetry-rank-NNNNN.jsonl``). ``watch`` is
given that directory, or the files, and reads them together: once, merged by
(step, rank) so a step's records of every rank come together (each file in
its own order, which the merge keeps); followed, every file polled in turn
(a rank's file that appears later in the directory is picked up).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from nanrunbook.telemetry.follow import Follower, FollowNotice
from nanrunbook.telemetry.reader import (
    BadLine,
    IncompleteLine,
    TelemetryReader,
    TelemetryUnreadable,
    directory_meant,
)
from nanrunbook.telemetry.record import TelemetryRecord

__all__ = ["JobFollower", "job_files", "merged"]

PATTERN = "telemetry*.jsonl"  # the sentinel's names: telemetry.jsonl, telemetry-rank-NNNNN.jsonl

Item = TelemetryRecord | BadLine | FollowNotice


def job_files(paths: Sequence[Path]) -> tuple[Path, ...]:
    """The files to read for ``paths``: a directory stands for its telemetry
    files (sorted by name), a file for itself, each once. TelemetryUnreadable
    when a directory holds none (saying what it holds instead)."""
    files: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.glob(PATTERN) if p.is_file())
            if not found:
                raise TelemetryUnreadable(f"{path}: {directory_meant(path)}")
            files.update(dict.fromkeys(found))
        else:
            files[path] = None
    return tuple(files)


def _named(bad: BadLine, name: str) -> BadLine:
    return replace(bad, reason=f"{name}: {bad.reason}")


def _keyed(reader: TelemetryReader) -> Iterator[tuple[tuple[int, int, int], Item | IncompleteLine]]:
    """One file's items with their merge key: (step, rank) for a record; a bad
    or incomplete line keeps the place of the record before it."""
    key = (-1, -1)
    for order, item in enumerate(reader):
        if isinstance(item, TelemetryRecord):
            key = (item.step, item.rank)
        elif isinstance(item, BadLine):
            item = _named(item, reader.path.name)
        yield (*key, order), item


def merged(readers: Sequence[TelemetryReader]) -> Iterator[Item | IncompleteLine]:
    """Every item of ``readers``' files, merged by (step, rank), streamed."""
    for _, item in heapq.merge(*(_keyed(r) for r in readers), key=lambda pair: pair[0]):
        yield item


class JobFollower:
    """Follows several files as one (the interface of :class:`Follower`): what
    each has appended since the last call, merged by step; a directory's
    telemetry files that appear later are followed from their first line."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.directories = [p for p in paths if p.is_dir()]
        self.path = paths[0] if len(paths) == 1 else Path(", ".join(map(str, paths)))
        self.followers = [Follower(p) for p in job_files(paths)]
        self._named = {f.path for f in self.followers}

    @property
    def lines(self) -> int:
        return sum(f.lines for f in self.followers)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(str(f.path) for f in self.followers)

    def incomplete(self) -> IncompleteLine | None:
        return next((i for f in self.followers if (i := f.incomplete()) is not None), None)

    def close(self) -> None:
        for follower in self.followers:
            follower.close()

    def read_available(self) -> list[Item]:
        notices: list[Item] = []
        for directory in self.directories:
            for path in sorted(directory.glob(PATTERN)):
                if path not in self._named and path.is_file():
                    try:
                        self.followers.append(Follower(path))
                    except TelemetryUnreadable:
                        continue  # not readable yet: looked at again next time
                    self._named.add(path)
                    notices.append(FollowNotice("following", f"{path} appeared: following it"))
        batches = []
        for follower in self.followers:
            name = follower.path.name
            items = [
                _named(item, name) if isinstance(item, BadLine) else item
                for item in follower.read_available()
            ]
            batches.append(items)
        records = heapq.merge(*batches, key=_step_of)
        return [*notices, *records]


def _step_of(item: Item) -> tuple[int, int]:
    # Notices and bad lines sort first: the merge keeps each file's own order.
    if isinstance(item, TelemetryRecord):
        return item.step, item.rank
    return -1, -1

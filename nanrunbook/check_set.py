"""``check_incident_set``: the members of an incident set judged in parallel, then
the set rules (spec section 11); ``check_path``: a bundle or a set, as found.

Members share one budget of scan workers, the number one bundle would use
(``workers``, default one per usable core): several members are checked at once,
each with a share of the workers, and a share goes back to the pool when its
member is done, so the work is split across members (each hashed on its own
core) and across tensors (a member alone, or the last ones, get several
workers). Each member is checked by :func:`~nanrunbook.check.judge_bundle`,
exactly as a bundle on its own.

Memory stays within the bound of one bundle: there are never more scan workers
than one bundle would have (so never more read buffers), and only one member at
a time reads and parses its manifest and tensor headers, the part whose memory
grows with a manifest's size; a member gives that turn up as its data read
begins (the ``start`` of its progress). Members being read keep their parsed
records until they are done. Without ``keep_reports`` a member's report is let
go as soon as it is judged (only its verdict and what it declares stay: what a
text or kv answer shows), so the peak memory of a set of thousands of members
does not grow with their reports.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from nanrunbook.access import MANIFEST_NAME, file_where, set_members, sets_below
from nanrunbook.check import judge_bundle
from nanrunbook.contract import Caps, contract_content_id
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.manifest.declared import NOTHING_DECLARED
from nanrunbook.tensors.scan import default_workers
from nanrunbook.tensors.verify import Progress
from nanrunbook.verdict.incident_set import IncidentSet, SetMember, judge_set
from nanrunbook.verdict.judgement import Judgement
from nanrunbook.verdict.precision import WarningThresholds
from nanrunbook.verdict.report import CheckedAlone

__all__ = ["check_incident_set", "check_path", "checked_alone", "is_incident_set"]


def is_incident_set(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an incident set: a directory without manifest.json
    holding at least one member bundle (a subdirectory with manifest.json)."""
    directory = Path(path)
    try:
        if not stat.S_ISDIR(os.stat(directory).st_mode):
            return False
        os.lstat(directory / MANIFEST_NAME)
    except FileNotFoundError:
        pass  # no manifest.json: a set if it has members
    except OSError:
        return False
    else:
        return False
    try:
        return bool(set_members(directory))
    except (OSError, EvidenceRejected):
        return False


def check_path(
    path: str | os.PathLike[str],
    *,
    caps: Caps | None = None,
    progress: Progress | None = None,
    workers: int | None = None,
    thresholds: WarningThresholds | None = None,
    keep_reports: bool = True,
) -> Judgement | IncidentSet:
    """What ``nanrunbook check`` answers for one path: the set's verdict when it is
    an incident set (see :func:`is_incident_set`), else the bundle's judgement."""
    if is_incident_set(path):
        return check_incident_set(
            path,
            caps=caps,
            progress=progress,
            workers=workers,
            thresholds=thresholds,
            keep_reports=keep_reports,
        )
    judgement = judge_bundle(
        path, caps=caps, progress=progress, workers=workers, thresholds=thresholds
    )
    return checked_alone(judgement, path)


def checked_alone(judgement: Judgement, path: str | os.PathLike[str]) -> Judgement:
    """``judgement`` of the bundle at ``path``, checked on its own: when its topology
    says it is one rank of several, its report names the set to check instead (the
    directory holding it) and carries SET_MEMBER_ALONE. Its verdict is unchanged."""
    report = judgement.report
    if report is None or report.manifest.binding.world_size <= 1:
        return judgement
    binding = report.manifest.binding
    holder = os.path.dirname(os.path.normpath(os.path.abspath(path)))
    given = os.path.dirname(os.path.normpath(path)) or "."
    set_path = given if os.path.abspath(given) == holder else holder
    alone = CheckedAlone(binding.rank, binding.world_size, set_path)
    return dataclasses.replace(judgement, report=dataclasses.replace(report, alone=alone))


def check_incident_set(
    path: str | os.PathLike[str],
    *,
    caps: Caps | None = None,
    progress: Progress | None = None,
    workers: int | None = None,
    thresholds: WarningThresholds | None = None,
    keep_reports: bool = True,
) -> IncidentSet:
    """Judge the incident set in the directory ``path`` (spec section 11).

    Every subdirectory holding a manifest.json is a member, checked as a bundle;
    the answer is an :class:`~nanrunbook.verdict.incident_set.IncidentSet`
    (HOLD, CONTINUE_BOUNDED_DIAGNOSTICS or REJECTED, with the origin ranks).
    Never writes. ``progress(n)``, if given, is called with byte counts as tensor
    data is read, from several threads in turn (never at once); if it has an
    ``extend`` method, that is called with each member's byte total as the
    member's read begins. Raises EvidenceRejected (BUNDLE_NOT_FOUND,
    BUNDLE_NOT_DIRECTORY) when ``path`` is not a directory. ``keep_reports``
    false: each member is kept as :meth:`SetMember.verdict_only`, its report let
    go as soon as it is judged.
    """
    caps = caps or Caps()
    directory = Path(path)
    content_id = contract_content_id(caps)
    try:
        entries = set_members(directory)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        return judge_set([], contract_content_id=content_id, path=str(directory), unlisted=reason)
    inside = [entry for entry in entries if not entry.outside]

    def member(name: str, judgement: Judgement) -> SetMember:
        judged = SetMember.of(file_where(name), judgement)
        return judged if keep_reports else judged.verdict_only()

    folded = _judge_members(
        [entry.path for entry in inside],
        caps,
        progress,
        workers,
        thresholds,
        lambda index, judgement: member(inside[index].name, judgement),
    )
    judged = dict(zip((entry.name for entry in inside), folded, strict=True))
    members = [
        judged.get(entry.name) or member(entry.name, _outside(entry.path, content_id))
        for entry in entries
    ]
    nested = [file_where(name) for name in sets_below(directory)]
    return judge_set(
        members, contract_content_id=content_id, path=str(directory), nested_sets=nested
    )


def _outside(path: Path, content_id: str) -> Judgement:
    message = f"member {quote(path.name)} resolves through a symlink outside the set; not read"
    error = EvidenceRejected([Violation("MANIFEST_UNREADABLE", MANIFEST_NAME, message)])
    return Judgement(str(path), content_id, NOTHING_DECLARED, None, error)


class _Stop(BaseException):
    """Raised in a member's thread, from its progress, when the caller stopped
    waiting (Ctrl-C). A BaseException, so that no scan records it as a tensor's
    failure and goes on: it unwinds the member's check at its next chunk."""


class _SharedProgress:
    """The caller's progress, fed by every member in turn (under a lock)."""

    def __init__(self, outer: Progress | None, cancel: threading.Event) -> None:
        self.outer = outer
        self.extend = getattr(outer, "extend", None)
        self.cancel = cancel
        self.lock = threading.Lock()


class _MemberProgress:
    """One member's progress: its data read beginning hands the manifest turn on
    and adds its bytes to the caller's total; each chunk read is passed on, or
    stops the member when the caller stopped waiting."""

    def __init__(self, shared: _SharedProgress, turn: _Turn) -> None:
        self._shared = shared
        self._turn = turn

    def start(self, total: int) -> None:
        self._turn.release()
        if callable(self._shared.extend):
            with self._shared.lock:
                self._shared.extend(total)

    def __call__(self, nbytes: int) -> None:
        if self._shared.cancel.is_set():
            raise _Stop
        if self._shared.outer is not None:
            with self._shared.lock:
                self._shared.outer(nbytes)


class _Turn:
    """One member at a time reads its manifest and headers: a lock, released once."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._held = False
        self._guard = threading.Lock()

    def acquire(self, cancel: threading.Event) -> bool:
        while not self._lock.acquire(timeout=0.25):
            if cancel.is_set():
                return False
        self._held = True
        return True

    def release(self) -> None:
        with self._guard:
            if self._held:
                self._held = False
                self._lock.release()


def _judge_members(
    paths: Sequence[Path],
    caps: Caps,
    progress: Progress | None,
    workers: int | None,
    thresholds: WarningThresholds | None,
    fold: Callable[[int, Judgement], SetMember],
) -> list[SetMember]:
    """Judge every member bundle, each judgement folded into its member as soon as
    it is made (``fold(index, judgement)``); the members in the order of ``paths``."""
    budget = max(1, workers if workers is not None else default_workers())
    results: list[SetMember | BaseException | None] = [None] * len(paths)
    cancel = threading.Event()
    shared = _SharedProgress(progress, cancel)
    manifest_turn = threading.Lock()
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()

    def run(index: int, share: int) -> None:
        turn = _Turn(manifest_turn)
        try:
            if turn.acquire(cancel):
                judgement = judge_bundle(
                    paths[index],
                    caps=caps,
                    progress=_MemberProgress(shared, turn),
                    workers=share,
                    thresholds=thresholds,
                )
                results[index] = fold(index, judgement)
        except BaseException as error:  # raised again in the caller's thread
            results[index] = error
        finally:
            turn.release()
            finished.put(index)

    pending = deque(range(len(paths)))
    running: dict[int, tuple[threading.Thread, int]] = {}
    free = budget
    try:
        while pending or running:
            while pending and free > 0:
                # Few members left: each gets more workers, to split its tensors.
                share = max(1, free // len(pending))
                index = pending.popleft()
                thread = threading.Thread(target=run, args=(index, share), daemon=True)
                running[index] = (thread, share)
                free -= share
                thread.start()
            try:
                done = finished.get(timeout=0.25)  # short waits: Ctrl-C is seen here
            except queue.Empty:
                continue
            free += running.pop(done)[1]
            failed = results[done]
            if isinstance(failed, BaseException):
                raise failed  # a defect or Ctrl-C: the others are stopped below
    except BaseException:
        cancel.set()
        for thread, _ in running.values():
            thread.join(timeout=1.0)
        raise
    return [_result(result) for result in results]


def _result(result: SetMember | BaseException | None) -> SetMember:
    if isinstance(result, BaseException):
        raise result
    if result is None:
        raise RuntimeError("a member was left without a verdict")
    return result

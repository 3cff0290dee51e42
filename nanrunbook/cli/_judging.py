"""Check a bundle and write its verdict: what the ``check``, ``seal`` and ``merge``
commands share.

The exit code is the verdict (0 CONTINUE, 1 HOLD, 3 rejected) even when the
reader of the output went away (``| head``, ``grep -q``): a CI gate reads the
code, not the text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from nanrunbook.contract import Caps
from nanrunbook.errors import EvidenceRejected

if TYPE_CHECKING:
    from nanrunbook.output.base import Renderer
    from nanrunbook.verdict.precision import WarningThresholds

__all__ = ["emit", "emit_rejection", "judge", "judge_many"]


def judge(
    bundle: Path,
    fmt: str,
    out: IO[str],
    *,
    caps: Caps | None = None,
    progress: bool = False,
    brief: bool = False,
    checklist: bool = False,
    thresholds: WarningThresholds | None = None,
    fail_on_warnings: bool = False,
) -> int:
    """Check ``bundle`` (a bundle, or an incident set of rank bundles), write the
    verdict in ``fmt`` to ``out``, and return the exit code. ``progress`` shows the
    read's bar on stderr at a terminal; it is erased before anything is written to
    ``out``. ``brief`` (text only) writes at most six lines; ``checklist`` (text only)
    every checklist step in full. ``fail_on_warnings``
    turns a CONTINUE with warnings into exit 5."""
    from nanrunbook.check_set import check_path
    from nanrunbook.output.progress import check_progress
    from nanrunbook.verdict.incident_set import IncidentSet

    with check_progress(progress) as bar:
        # Only a JSON answer prints a set's members' whole reports: otherwise each is let go.
        outcome = check_path(
            bundle, caps=caps, progress=bar, thresholds=thresholds, keep_reports=fmt == "json"
        )
    renderer = _renderer(fmt, brief, checklist=checklist)
    if isinstance(outcome, IncidentSet):
        emit(functools.partial(renderer.incident_set, outcome, out), out)
    else:
        emit(functools.partial(renderer.judgement, outcome, out), out)
    return outcome.exit_code_for(fail_on_warnings=fail_on_warnings)


def judge_many(
    paths: Sequence[Path],
    fmt: str,
    out: IO[str],
    *,
    caps: Caps | None = None,
    progress: bool = False,
    thresholds: WarningThresholds | None = None,
    fail_on_warnings: bool = False,
) -> int:
    """Check each path on its own, in order; write every verdict at once in ``fmt``
    and return the most severe exit code (3, then 1, then 5, then 0)."""
    from nanrunbook.check_set import check_path
    from nanrunbook.exits import most_severe
    from nanrunbook.output.progress import check_progress
    from nanrunbook.output.renderers import RENDERERS

    outcomes = []
    for path in paths:
        with check_progress(progress) as bar:
            outcomes.append(check_path(path, caps=caps, progress=bar, thresholds=thresholds))
    codes = (outcome.exit_code_for(fail_on_warnings=fail_on_warnings) for outcome in outcomes)
    code = most_severe(codes)
    emit(functools.partial(RENDERERS[fmt].many, outcomes, code, out), out)
    return code


def emit_rejection(
    error: EvidenceRejected,
    bundle: Path,
    fmt: str,
    out: IO[str],
    *,
    caps: Caps | None = None,
    brief: bool = False,
) -> int:
    """Write a rejection in ``fmt``; return its exit code."""
    from nanrunbook.contract import contract_content_id

    renderer = _renderer(fmt, brief)
    content_id = contract_content_id(caps)
    emit(functools.partial(renderer.rejection, error, str(bundle), content_id, out), out)
    return error.exit_code


def _renderer(fmt: str, brief: bool, *, checklist: bool = False) -> Renderer:
    from nanrunbook.output.renderers import RENDERERS

    if brief or checklist:
        from nanrunbook.output.text import TextRenderer

        assert fmt == "text", "--brief and --checklist are refused with other formats"
        return TextRenderer(brief=brief, checklist=checklist)
    return RENDERERS[fmt]


def emit(write: Callable[[], None], out: IO[str]) -> None:
    """Run ``write``; a reader that went away is not an error of the verdict (the
    program's own streams absorb it; this is for any other ``out``)."""
    from nanrunbook.cli._streams import silence

    try:
        write()
        out.flush()
    except BrokenPipeError:
        silence(out)

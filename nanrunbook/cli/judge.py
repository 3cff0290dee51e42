"""Check a bundle and write its verdict: what the ``check`` and ``seal`` commands share.

The exit code is the verdict (0 CONTINUE, 1 HOLD, 3 rejected) even when the
reader of the output went away (``| head``, ``grep -q``): a CI gate reads the
code, not the text.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from nanrunbook.contract import Caps
from nanrunbook.errors import EvidenceRejected

__all__ = ["emit", "emit_rejection", "judge", "silence"]


def judge(
    bundle: Path, fmt: str, out: IO[str], *, caps: Caps | None = None, progress: bool = False
) -> int:
    """Check ``bundle``, write the report or rejection in ``fmt`` to ``out``, and
    return the exit code. ``progress`` shows the read's bar on stderr at a terminal;
    it is erased before anything is written to ``out``."""
    from nanrunbook.check import check_bundle
    from nanrunbook.output.progress import check_progress
    from nanrunbook.output.renderers import RENDERERS

    try:
        with check_progress(progress) as bar:
            report = check_bundle(bundle, caps=caps, progress=bar)
    except EvidenceRejected as error:
        return emit_rejection(error, bundle, fmt, out, caps=caps)
    emit(functools.partial(RENDERERS[fmt].report, report, out), out)
    return report.exit_code


def emit_rejection(
    error: EvidenceRejected, bundle: Path, fmt: str, out: IO[str], *, caps: Caps | None = None
) -> int:
    """Write a rejection in ``fmt``; return its exit code."""
    from nanrunbook.contract import contract_content_id
    from nanrunbook.output.renderers import RENDERERS

    renderer = RENDERERS[fmt]
    content_id = contract_content_id(caps)
    emit(functools.partial(renderer.rejection, error, str(bundle), content_id, out), out)
    return error.exit_code


def emit(write: Callable[[], None], out: IO[str]) -> None:
    """Run ``write``; a reader that went away is not an error of the verdict."""
    try:
        write()
        out.flush()
    except BrokenPipeError:
        silence(out)


def silence(stream: IO[str]) -> None:
    """Point a closed pipe's stream at /dev/null so the interpreter's final flush
    stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)

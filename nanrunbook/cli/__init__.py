"""The ``nanrunbook`` command: a thin shell over the library API.

``app`` holds the shared pieces (guard, option types); each command lives in a
module of its own here and only parses its options, calls the library and hands
the result to the renderer named by ``--format``. Exit codes: nanrunbook.exits.
"""

from __future__ import annotations

import gc
import os

# Importing the commands makes tens of thousands of objects that live as long as
# the process (modules, classes, typer's tree): the cyclic collector would scan
# them again and again and free nothing (12 ms of start-up, measured). Paused
# while they are imported, then left as it was; main() pauses it for its run.
_collecting = gc.isenabled()
gc.disable()
# The command does no linear algebra: numpy's BLAS need not start a thread per core
# when numpy is imported (measured: a third of numpy's import time on a busy
# machine). Only this process's command line sets it, never the library, and a
# value the user set wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from nanrunbook.cli import (  # noqa: E402, F401  (each registers its commands)
    check,
    diff,
    documents,
    merge,
    prove,
    replay,
    seal,
    verify_recovery,
    watch,
)
from nanrunbook.cli.app import app, entry_point, main  # noqa: E402

if _collecting:
    gc.enable()

__all__ = ["app", "entry_point", "main"]

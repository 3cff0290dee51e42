"""The ``nanrunbook`` command: a thin shell over the library API.

``app`` holds the shared pieces (guard, option types); each command lives in a
module of its own here and only parses its options, calls the library and hands
the result to the renderer named by ``--format``. Exit codes: nanrunbook.exits.
"""

from __future__ import annotations

import os

# The command does no linear algebra: numpy's BLAS need not start a thread per core
# when numpy is imported (measured: a third of numpy's import time on a busy
# machine). Only this process's command line sets it, never the library, and a
# value the user set wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from nanrunbook.cli import (  # noqa: F401  (each registers its commands)
    check,
    diff,
    documents,
    merge,
    seal,
    watch,
)
from nanrunbook.cli.app import app, entry_point, main

__all__ = ["app", "entry_point", "main"]

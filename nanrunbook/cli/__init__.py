"""The ``nanrunbook`` command: a thin shell over the library API.

``app`` holds the shared pieces (guard, option types); each command lives in a
module of its own here and only parses its options, calls the library and hands
the result to the renderer named by ``--format``. Exit codes: nanrunbook.exits.
"""

from __future__ import annotations

from nanrunbook.cli import (  # noqa: F401  (each registers its commands)
    check,
    diff,
    documents,
    merge,
    seal,
    watch,
)
from nanrunbook.cli.app import app, entry_point

__all__ = ["app", "entry_point"]

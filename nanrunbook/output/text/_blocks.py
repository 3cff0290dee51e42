"""The text format's building blocks, shared by every record kind's module.

rich is imported inside each function, on first use, so ``kv`` and ``json``
never load it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import Violation
from nanrunbook.verdict.incident_set import REJECTED, SetViolation


@functools.cache
def verdict_console() -> Any:
    """rich's Console, except that a closed pipe raises BrokenPipeError: rich would
    exit 1, and the caller must keep the verdict's exit code. Built on first use so
    kv and json never import rich."""
    from rich.console import Console

    class VerdictConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return VerdictConsole


@functools.cache
def _trimmed() -> Any:
    """A wrapper that drops the spaces rich pads table and grid lines with: a line of
    the report ends where its text ends, in a log as at a terminal."""
    from rich.segment import Segment

    class Trimmed:
        def __init__(self, renderable: Any) -> None:
            self.renderable = renderable

        def __rich_console__(self, console: Any, options: Any) -> Any:
            for line in console.render_lines(self.renderable, options, pad=False):
                while line and not line[-1].control and not line[-1].text.rstrip():
                    line.pop()
                if line and not line[-1].control:
                    last = line.pop()
                    line.append(Segment(last.text.rstrip(), last.style, last.control))
                yield from line
                yield Segment.line()

    return Trimmed


def show(console: Any, renderable: Any = "") -> None:
    """Print ``renderable`` wrapped to the console's width, without trailing spaces."""
    if renderable == "":
        console.print()
    else:
        console.print(_trimmed()(renderable), soft_wrap=False)


_DIGEST = re.compile(r"\b([0-9a-f]{12})[0-9a-f]{52}\b")


def shorten_digests(text: str) -> str:
    """Every SHA-256 hex digest cut to its first 12 digits: content ids and digests
    are whole in json and kv; in text they would not fit 80 columns."""
    return _DIGEST.sub(r"\1...", text)


def indented(text: Any, left: int) -> Any:
    from rich.padding import Padding

    return Padding(text, (0, 0, 0, left))


def grid(rows: Sequence[tuple[Any, Any]], *, indent: int = 2, label_style: str = "dim") -> Any:
    """Label/value lines; a long value wraps under itself, not under its label."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style=label_style)
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(label, value if isinstance(value, Text) else Text(str(value)))
    return indented(grid, indent)


_BRIEF_LABEL_WIDTH = len("earliest non-finite stage")


def fact_line(label: str, value: str) -> Any:
    from rich.text import Text

    return Text.assemble((f"  {label:<{_BRIEF_LABEL_WIDTH}}  ", "dim"), value)


def show_violation(console: Any, code: str, where: str, message: str) -> None:
    """A violation as check shows one: its code and where, its message under them."""
    from rich.text import Text

    show(console, indented(Text.assemble((code, "yellow"), f" {where}"), 2))
    show(console, indented(Text(shorten_digests(message)), 4))


def print_unwrapped(console: Any, lines: list[Any]) -> None:
    """One printed line each, never wrapped: ``--brief`` promises a line count."""
    for line in lines:
        console.print(line)  # the console soft-wraps: a line stays one line


def short_id(content_id: str) -> str:
    """``sha256:5df540288221...``: a content id without the kind its label names."""
    return shorten_digests(content_id.split("@", 1)[-1])


def brief_violations(violations: Sequence[Violation] | Sequence[SetViolation]) -> list[Any]:
    """Up to four lines of codes and paths; the messages are in the full report."""
    from rich.text import Text

    shown = violations if len(violations) <= 4 else violations[:3]
    lines = [Text.assemble(("  " + v.code, "yellow"), f" {v.where}") for v in shown]
    if len(shown) < len(violations):
        lines.append(Text(f"  ... {len(violations) - len(shown)} more (without --brief)"))
    return lines


DECISION_STYLE = {
    REJECTED: "bold yellow",
    HOLD: "bold red",
    "CONTINUE_BOUNDED_DIAGNOSTICS": "bold green",
}

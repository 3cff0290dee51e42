"""The runbook's steps in full, section by section (``checklist``; ``check --checklist``)."""

from __future__ import annotations

from typing import Any

from nanrunbook.output.text._blocks import indented, shorten_digests, show
from nanrunbook.verdict.runbook import Section

__all__ = ["render_checklist", "sections_block"]


def render_checklist(console: Any, sections: tuple[Section, ...]) -> None:
    show(console, sections_block(sections, heading="nanrunbook replay checklist"))


def sections_block(sections: tuple[Section, ...], *, heading: str) -> Any:
    """Every step in full, section by section, numbered through."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(heading, style="bold underline")]
    count = 0
    digits = len(str(sum(len(section.steps) for section in sections)))
    for section in sections:
        parts.append(Text(section.title, style="bold"))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", no_wrap=True, min_width=digits + 1)
        grid.add_column(overflow="fold")
        for step in section.steps:
            count += 1
            detail = shorten_digests(step.detail)
            grid.add_row(f"{count}.", Text.assemble((step.title, "bold"), f": {detail}"))
        parts.append(indented(grid, 1))
    return Group(*parts)

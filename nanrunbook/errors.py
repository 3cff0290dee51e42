"""The one error type of nanrunbook, and the violations it carries.

Every rejection names all violations found, each with a stable code (listed in
``nanrunbook.codes``), the JSON path or bundle file it concerns, and a one-line
message. Messages never contain raw untrusted text: callers pass such text
through :func:`quote` first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nanrunbook.exits import Exit

__all__ = ["EvidenceRejected", "Violation", "quote"]

_MAX_QUOTED = 80


def quote(text: object) -> str:
    """Show untrusted text on one line, escaped, shortened: safe in any output."""
    shown = str(text)
    # ascii() escapes every control, bidi and non-ASCII character; the ellipsis
    # that marks a cut is added after, so it shows as itself, not as \u2026.
    if len(shown) > _MAX_QUOTED:
        quoted = ascii(shown[:_MAX_QUOTED])
        return quoted[:-1] + "…" + quoted[-1]
    return ascii(shown)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: stable ``code``, ``where`` (JSON path or file), ``message``."""

    code: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.code} {self.where}: {self.message}"


class EvidenceRejected(Exception):
    """The evidence cannot be judged; ``violations`` lists every reason found.

    The CLI maps it to exit code 3. It renders its own one-line summary, so a
    caller can show ``str(error)`` to a person as it is.
    """

    code = "EVIDENCE_REJECTED"
    exit_code = Exit.REJECTED

    def __init__(self, violations: Iterable[Violation]) -> None:
        self.violations: tuple[Violation, ...] = tuple(violations)
        if not self.violations:
            raise ValueError("EvidenceRejected needs at least one violation")
        super().__init__(self.message)

    @property
    def summary(self) -> str:
        """The first violation, and how many more there are."""
        more = len(self.violations) - 1
        return f"{self.violations[0]}" + (f" (and {more} more)" if more else "")

    @property
    def message(self) -> str:
        return f"evidence rejected: {self.summary}"

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(v.code for v in self.violations)

"""How the verdict side words the facts of one bundle: magnitudes, counts, shapes.

The checklist and the text report name the same numbers; wording them in one
place keeps "0.5" from reading as "5e-01" in one and "0.5" in the other.
"""

from __future__ import annotations

from nanrunbook.records import Counts, Scaler, StageFinding

__all__ = [
    "counts_phrase",
    "number",
    "reported_magnitude",
    "shape_text",
    "stages_before",
]

_ORDINAL_WORDS = ("zero", "one", "two", "three", "four")


def reported_magnitude(stage: StageFinding, stored: float | None, scaler: Scaler) -> float | None:
    """A stored magnitude as reported: scaled gradients are divided by the scale."""
    if stored is None or stage.record.gradients != "scaled":
        return stored
    return stored / scaler.scale


def number(value: float) -> str:
    """Six significant digits, exponents without padding: 65504, 0.5, 3.40282e38."""
    text = f"{value:.6g}"
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def counts_phrase(counts: Counts) -> str:
    """``1 NaN and 2 +inf of 128 elements``, or ``all 64 elements finite``."""
    kinds = [
        f"{n} {label}"
        for n, label in ((counts.nan, "NaN"), (counts.posinf, "+inf"), (counts.neginf, "-inf"))
        if n
    ]
    elements = f"{counts.elements} element{'s' if counts.elements != 1 else ''}"
    if not kinds:
        return f"all {elements} finite" if counts.elements != 1 else "1 element, finite"
    listed = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]
    return f"{listed} of {elements}"


def shape_text(shape: tuple[int, ...]) -> str:
    """``16x8``; a 0-d tensor is ``scalar``."""
    return "x".join(str(n) for n in shape) if shape else "scalar"


def stages_before(distance: int) -> str:
    """``one stage before``, ``two stages before``."""
    word = _ORDINAL_WORDS[distance] if distance < len(_ORDINAL_WORDS) else str(distance)
    return f"{word} stage{'s' if distance != 1 else ''} before"

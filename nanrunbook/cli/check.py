"""``nanrunbook check``: judge evidence and answer with the verdict's exit code."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from nanrunbook.cli.app import (
    DEFAULT_CAPS,
    CheckFormat,
    FormatOption,
    MaxBundleElements,
    MaxStageElements,
    MaxStageTensors,
    caps_from,
    command,
    guarded,
    path_argument,
)
from nanrunbook.verdict.precision import WarningThresholds

__all__ = ["check"]

BundlesArgument = Annotated[
    list[Path],
    path_argument(
        "BUNDLE", "Evidence bundle directories, or incident sets (directories of rank bundles)."
    ),
]

DEFAULT_THRESHOLDS = WarningThresholds()


def _number(text: str) -> float:
    """A threshold: a finite number, with an error a person can act on."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


def _dtype_list(text: str) -> frozenset[str]:
    """``F16,BF16``: dtype names, comma-separated (checked by WarningThresholds)."""
    return frozenset(name.strip() for name in str(text).split(",") if name.strip())


Brief = Annotated[
    bool,
    typer.Option(
        "--brief",
        help="Text format only: at most six lines (verdict, earliest stage, first tensor, "
        "action, warnings, bundle), never wrapped.",
    ),
]
FullChecklist = Annotated[
    bool,
    typer.Option(
        "--checklist",
        help="Text format only: every step of the checklist in full, section by section, "
        "instead of one line per step (the report then is longer than one screen).",
    ),
]
FailOnWarnings = Annotated[
    bool,
    typer.Option(
        "--fail-on-warnings",
        help="Exit 5 (not 0) when the verdict is CONTINUE but there are warnings. "
        "A HOLD stays 1, a rejection 3.",
    ),
]
NearMaxBits = Annotated[
    float,
    typer.Option(
        parser=_number,
        metavar="BITS",
        help="NEAR_DTYPE_MAX below this many bits of headroom (0 or more).",
    ),
]
UnderflowShare = Annotated[
    float,
    typer.Option(
        parser=_number,
        metavar="SHARE",
        help="GRADIENT_UNDERFLOW above this share of zero or subnormal gradients (0 to 1).",
    ),
]
UnderflowDtypes = Annotated[
    frozenset[str] | None,
    typer.Option(
        parser=_dtype_list,
        metavar="DTYPES",
        help="The gradient dtypes GRADIENT_UNDERFLOW looks at, comma-separated.",
        show_default="the floating dtypes of at most 16 bits",
    ),
]


def thresholds_from(
    near_max_bits: float, share: float, dtypes: frozenset[str] | None
) -> WarningThresholds:
    """The thresholds; a value out of range is a usage error (exit 2), in one line
    that names the option."""
    try:
        return WarningThresholds(
            near_max_bits, share, DEFAULT_THRESHOLDS.underflow_dtypes if dtypes is None else dtypes
        )
    except ValueError as error:
        # WarningThresholds names the field first: near_max_bits, underflow_share...
        field = str(error).split()[0].rstrip(":")
        raise typer.BadParameter(str(error), param_hint=f"'--{field.replace('_', '-')}'") from None


def _check_checklist(checklist: bool, format: CheckFormat, *, brief: bool, bundles: int) -> None:
    """--checklist lengthens one text report: with anything else it is a usage error."""
    if not checklist:
        return
    if format is not CheckFormat.text:
        reason = "it lengthens the text report; --format json holds the whole checklist already"
    elif brief:
        reason = "--brief shortens the report; --checklist lengthens it"
    elif bundles > 1:
        reason = "several paths are one line each; give one BUNDLE"
    else:
        return
    raise typer.BadParameter(reason, param_hint="'--checklist'")


@command("Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).")
@guarded
def check(
    bundles: BundlesArgument,
    format: FormatOption = CheckFormat.text,
    brief: Brief = False,
    checklist: FullChecklist = False,
    fail_on_warnings: FailOnWarnings = False,
    near_max_bits: NearMaxBits = DEFAULT_THRESHOLDS.near_max_bits,
    underflow_share: UnderflowShare = DEFAULT_THRESHOLDS.underflow_share,
    underflow_dtypes: UnderflowDtypes = None,
    max_stage_elements: MaxStageElements = DEFAULT_CAPS.max_stage_elements,
    max_bundle_elements: MaxBundleElements = DEFAULT_CAPS.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = DEFAULT_CAPS.max_stage_tensors,
) -> None:
    """Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).

    A directory without manifest.json whose subdirectories are bundles is an
    incident set, one bundle per rank of one step: it is judged as a set (HOLD on
    one accepted HOLD member, CONTINUE only with every rank present and accepted),
    naming the ranks the symptom showed on first. Several paths are judged each
    on its own, one line each, and the exit code is the most severe (3, then 1,
    then 5, then 0). A path that is not a bundle is rejected evidence (exit 3): no
    decision is made on missing evidence. Warnings never change the verdict;
    --fail-on-warnings turns a CONTINUE with warnings into exit 5 for CI.

    Example: nanrunbook check fixtures/hold-backward-dynamic-skip --format kv

    Example: nanrunbook check --brief fixtures/hold-backward-dynamic-skip

    Example: nanrunbook check --checklist fixtures/hold-backward-dynamic-skip

    Example: nanrunbook check --fail-on-warnings fixtures/continue-all-finite
    """
    from nanrunbook.cli._judging import judge, judge_many

    if brief and format is not CheckFormat.text:
        raise typer.BadParameter(
            f"--brief shortens the text format; --format {format.value} is already for scripts",
            param_hint="'--brief'",
        )
    _check_checklist(checklist, format, brief=brief, bundles=len(bundles))
    thresholds = thresholds_from(near_max_bits, underflow_share, underflow_dtypes)
    caps = caps_from(max_stage_elements, max_bundle_elements, max_stage_tensors)
    progress = format is CheckFormat.text  # a bar on stderr at a terminal, text only
    if len(bundles) == 1:
        code = judge(
            bundles[0],
            format.value,
            sys.stdout,
            caps=caps,
            progress=progress,
            brief=brief,
            checklist=checklist,
            thresholds=thresholds,
            fail_on_warnings=fail_on_warnings,
        )
    else:  # one line each already: --brief changes nothing
        code = judge_many(
            bundles,
            format.value,
            sys.stdout,
            caps=caps,
            progress=progress,
            thresholds=thresholds,
            fail_on_warnings=fail_on_warnings,
        )
    raise typer.Exit(code)

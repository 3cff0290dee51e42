"""``nanrunbook diff``: compare two bundles of one step, answer with an exit code a
CI job can gate on."""

from __future__ import annotations

import functools
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

__all__ = ["diff"]


BaseArgument = Annotated[
    Path, path_argument("BASE", "The bundle compared against (the replay as is).")
]
OtherArgument = Annotated[
    Path, path_argument("OTHER", "The bundle compared (the replay with one mechanism changed).")
]


@command("Compare two bundles of one step: which mechanism changed, and what it did.")
@guarded
def diff(
    base: BaseArgument,
    other: OtherArgument,
    format: FormatOption = CheckFormat.text,
    require_fixed: Annotated[
        bool,
        typer.Option(
            "--require-fixed",
            help="Recovery gate: exit 0 only when exactly one mechanism changed and it FIXED the step.",
        ),
    ] = False,
    max_stage_elements: MaxStageElements = DEFAULT_CAPS.max_stage_elements,
    max_bundle_elements: MaxBundleElements = DEFAULT_CAPS.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = DEFAULT_CAPS.max_stage_tensors,
) -> None:
    """Compare two bundles of one step: which mechanism changed, and what it did.

    Both bundles are checked first. Verdict: REPRODUCED, NOT_REPRODUCED,
    ONE_MECHANISM_CHANGED (outcome FIXED, BROKE, MOVED or UNCHANGED) or
    CONFOUNDED. Exit 0 when the comparison is attributable (REPRODUCED,
    ONE_MECHANISM_CHANGED), 1 when it is not, 3 when a bundle is rejected, 2
    when BASE and OTHER are one directory (nothing compared).

    Example: nanrunbook diff fixtures/hold-forward-bf16 fixtures/continue-all-finite --format kv
    """
    from nanrunbook.cli._judging import emit
    from nanrunbook.diff import ComparisonRejected, diff_bundles
    from nanrunbook.output.progress import check_progress
    from nanrunbook.output.renderers import RENDERERS

    caps = caps_from(max_stage_elements, max_bundle_elements, max_stage_tensors)
    renderer = RENDERERS[format.value]
    try:
        with check_progress(format is CheckFormat.text) as bar:
            comparison = diff_bundles(base, other, caps=caps, progress=bar)
    except ComparisonRejected as error:
        emit(functools.partial(renderer.diff, error, sys.stdout), sys.stdout)
        raise typer.Exit(error.exit_code) from None
    emit(functools.partial(renderer.diff, comparison, sys.stdout), sys.stdout)
    raise typer.Exit(comparison.exit_code(require_fixed=require_fixed))

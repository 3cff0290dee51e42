"""``nanrunbook check``: judge evidence and answer with the verdict's exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from nanrunbook.cli.app import (
    DEFAULT_CAPS,
    CheckFormat,
    MaxBundleElements,
    MaxStageElements,
    MaxStageTensors,
    caps_from,
    command,
    guarded,
    non_empty_path,
)

__all__ = ["check"]

BundlesArgument = Annotated[
    list[Path],
    typer.Argument(
        metavar="BUNDLE",
        parser=non_empty_path,
        help="Evidence bundle directories, or incident sets (directories of rank bundles).",
        show_default=False,
    ),
]


@command("Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).")
@guarded
def check(
    bundles: BundlesArgument,
    format: Annotated[
        CheckFormat, typer.Option("--format", "-f", help="Output format.")
    ] = CheckFormat.text,
    max_stage_elements: MaxStageElements = DEFAULT_CAPS.max_stage_elements,
    max_bundle_elements: MaxBundleElements = DEFAULT_CAPS.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = DEFAULT_CAPS.max_stage_tensors,
) -> None:
    """Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).

    A directory without manifest.json whose subdirectories are bundles is an
    incident set, one bundle per rank of one step: it is judged as a set (HOLD on
    one accepted HOLD member, CONTINUE only with every rank present and accepted),
    naming the ranks the symptom showed on first. Several paths are judged each
    on its own, and the exit code is the most severe (3, then 1, then 0). A path
    that is not a bundle is rejected evidence (exit 3): no decision is made on
    missing evidence.

    Example: nanrunbook check fixtures/hold-backward-dynamic-skip --format kv
    """
    from nanrunbook.cli.judge import judge, judge_many

    caps = caps_from(max_stage_elements, max_bundle_elements, max_stage_tensors)
    # A progress bar on stderr at a terminal, text format only.
    progress = format is CheckFormat.text
    if len(bundles) == 1:
        code = judge(bundles[0], format.value, sys.stdout, caps=caps, progress=progress)
    else:
        code = judge_many(bundles, format.value, sys.stdout, caps=caps, progress=progress)
    raise typer.Exit(code)

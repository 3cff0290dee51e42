"""``nanrunbook check``: judge evidence and answer with the verdict's exit code."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from nanrunbook.cli.app import (
    DEFAULT_CAPS,
    BundleArgument,
    CheckFormat,
    MaxBundleElements,
    MaxStageElements,
    MaxStageTensors,
    caps_from,
    command,
    guarded,
)

__all__ = ["check"]


@command("Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).")
@guarded
def check(
    bundle: BundleArgument,
    format: Annotated[
        CheckFormat, typer.Option("--format", "-f", help="Output format.")
    ] = CheckFormat.text,
    max_stage_elements: MaxStageElements = DEFAULT_CAPS.max_stage_elements,
    max_bundle_elements: MaxBundleElements = DEFAULT_CAPS.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = DEFAULT_CAPS.max_stage_tensors,
) -> None:
    """Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).

    A path that is not a bundle is rejected evidence (exit 3): no decision is made
    on missing evidence.

    Example: nanrunbook check fixtures/hold-backward-dynamic-skip --format kv
    """
    from nanrunbook.cli.judge import judge

    caps = caps_from(max_stage_elements, max_bundle_elements, max_stage_tensors)
    # A progress bar on stderr at a terminal, text format only.
    code = judge(bundle, format.value, sys.stdout, caps=caps, progress=format is CheckFormat.text)
    raise typer.Exit(code)

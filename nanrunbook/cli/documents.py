"""The commands that print documents rather than verdicts: ``contract``,
``checklist`` and ``schema``."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import Annotated

import typer

from nanrunbook.cli.app import (
    DEFAULT_CAPS,
    DocFormat,
    MaxBundleElements,
    MaxStageElements,
    MaxStageTensors,
    caps_from,
    command,
    guarded,
)

__all__ = ["checklist", "contract", "schema"]


class Stage(StrEnum):
    input = "input"
    forward = "forward"
    loss = "loss"
    backward = "backward"
    optimizer = "optimizer"


@command("Print the contract document in force and its content id.")
@guarded
def contract(
    format: Annotated[
        DocFormat, typer.Option("--format", "-f", help="Output format.")
    ] = DocFormat.json,
    max_stage_elements: MaxStageElements = DEFAULT_CAPS.max_stage_elements,
    max_bundle_elements: MaxBundleElements = DEFAULT_CAPS.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = DEFAULT_CAPS.max_stage_tensors,
) -> None:
    """Print the contract document in force and its content id.

    Example: nanrunbook contract --format text
    """
    from nanrunbook.contract import contract_content_id, contract_document
    from nanrunbook.output.renderers import RENDERERS

    caps = caps_from(max_stage_elements, max_bundle_elements, max_stage_tensors)
    RENDERERS[format.value].contract(contract_document(caps), contract_content_id(caps), sys.stdout)


@command(
    "Print the whole runbook: containment, mixed precision, replay, hardening, after CONTINUE."
)
@guarded
def checklist(
    stage: Annotated[
        Stage | None, typer.Option("--stage", "-s", help="Put this stage's specific steps first.")
    ] = None,
    format: Annotated[
        DocFormat, typer.Option("--format", "-f", help="Output format.")
    ] = DocFormat.text,
) -> None:
    """Print the whole runbook: containment, mixed precision, replay, hardening, after CONTINUE.

    A report (check) carries only the steps its verdict calls for, naming its
    evidence; this prints them all.

    Example: nanrunbook checklist --stage backward
    """
    from nanrunbook.output.renderers import RENDERERS
    from nanrunbook.verdict.runbook import checklist as build

    RENDERERS[format.value].checklist(build(stage.value if stage else None), sys.stdout)


@command("Print a JSON Schema (2020-12) of manifest.json; it does not replace check.")
@guarded
def schema() -> None:
    """Print a JSON Schema (2020-12) of manifest.json; it does not replace check.

    Example: nanrunbook schema > nanrunbook-bundle-1.schema.json
    """
    from nanrunbook.manifest.schema import manifest_schema
    from nanrunbook.output.json import json_text

    sys.stdout.write(json_text(manifest_schema()))

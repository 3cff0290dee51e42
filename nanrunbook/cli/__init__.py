"""The ``nanrunbook`` command: a thin shell over the library API.

Exit codes (spec section 10): 0 CONTINUE_BOUNDED_DIAGNOSTICS, 1 HOLD, 2 usage
error, 3 evidence rejected, 4 internal error, 130 interrupted.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, ParamSpec, TypeVar

import typer

from nanrunbook._version import __version__
from nanrunbook.contract import Caps
from nanrunbook.exits import Exit
from nanrunbook.strictjson import MAX_SAFE_INTEGER

app = typer.Typer(
    name="nanrunbook",
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class CheckFormat(StrEnum):
    text = "text"
    json = "json"
    kv = "kv"


class DocFormat(StrEnum):
    text = "text"
    json = "json"


class Stage(StrEnum):
    input = "input"
    forward = "forward"
    loss = "loss"
    backward = "backward"
    optimizer = "optimizer"


_DEFAULT = Caps()
MaxStageElements = Annotated[
    int,
    typer.Option(
        min=1, max=MAX_SAFE_INTEGER, help="Cap on elements in one stage (changes the contract id)."
    ),
]
MaxBundleElements = Annotated[
    int,
    typer.Option(
        min=1,
        max=MAX_SAFE_INTEGER,
        help="Cap on elements in the whole bundle (changes the contract id).",
    ),
]
MaxStageTensors = Annotated[
    int,
    typer.Option(
        min=1, max=MAX_SAFE_INTEGER, help="Cap on tensors in one stage (changes the contract id)."
    ),
]


P = ParamSpec("P")
R = TypeVar("R")


def guarded(command: Callable[P, R]) -> Callable[P, R]:
    """Ctrl-C is exit 130 and a defect of ours exit 4, each one line, never a traceback."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            sys.stderr.write("nanrunbook: interrupted\n")
            raise typer.Exit(Exit.INTERRUPTED) from None
        except BrokenPipeError:
            # Only output that carries no verdict gets here (help, documents).
            from nanrunbook.cli.judge import silence

            silence(sys.stdout)
            raise typer.Exit(0) from None
        except Exception as error:
            sys.stderr.write(f"nanrunbook: internal error: {type(error).__name__}: {error}\n")
            raise typer.Exit(Exit.INTERNAL) from None

    return run


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nanrunbook {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Check the evidence a training step left when its loss went NaN, and say what to do.

    Example: nanrunbook check bundle/ --format kv
    """


@app.command()
@guarded
def check(
    bundle: Annotated[
        Path,
        typer.Argument(metavar="BUNDLE", help="The evidence bundle directory.", show_default=False),
    ],
    format: Annotated[
        CheckFormat, typer.Option("--format", "-f", help="Output format.")
    ] = CheckFormat.text,
    max_stage_elements: MaxStageElements = _DEFAULT.max_stage_elements,
    max_bundle_elements: MaxBundleElements = _DEFAULT.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = _DEFAULT.max_stage_tensors,
) -> None:
    """Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3).

    Example: nanrunbook check fixtures/hold-backward-dynamic-skip --format kv
    """
    from nanrunbook.cli.judge import judge

    caps = Caps(max_stage_elements, max_bundle_elements, max_stage_tensors)
    # A progress bar on stderr at a terminal, text format only.
    code = judge(bundle, format.value, sys.stdout, caps=caps, progress=format is CheckFormat.text)
    raise typer.Exit(code)


@app.command()
@guarded
def contract(
    format: Annotated[
        DocFormat, typer.Option("--format", "-f", help="Output format.")
    ] = DocFormat.json,
    max_stage_elements: MaxStageElements = _DEFAULT.max_stage_elements,
    max_bundle_elements: MaxBundleElements = _DEFAULT.max_bundle_elements,
    max_stage_tensors: MaxStageTensors = _DEFAULT.max_stage_tensors,
) -> None:
    """Print the contract document in force and its content id.

    Example: nanrunbook contract --format text
    """
    import orjson

    from nanrunbook.contract import contract_content_id, contract_document

    caps = Caps(max_stage_elements, max_bundle_elements, max_stage_tensors)
    document = contract_document(caps)
    if format is DocFormat.json:
        sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    lines = [
        f"contract {document['contract_version']} for bundles {document['bundle_format']}",
        f"contract_content_id={contract_content_id(caps)}",
        "stage order: " + " -> ".join(document["stage_order"]),
        "actions on HOLD (exit 1):",
        *(f"  {stage}: {action}" for stage, action in document["actions"].items()),
        f"CONTINUE_BOUNDED_DIAGNOSTICS (exit 0): {document['no_nonfinite_action']}",
        f"root cause claim: {document['root_cause_claim']}",
        "caps:",
        *(f"  {name}: {value}" for name, value in document["caps"].items()),
        "bounds:",
        *(f"  {name}: {value}" for name, value in document["bounds"].items()),
    ]
    sys.stdout.write("\n".join(lines) + "\n")


@app.command()
@guarded
def checklist(
    stage: Annotated[
        Stage | None, typer.Option("--stage", "-s", help="Put this stage's specific steps first.")
    ] = None,
    format: Annotated[
        DocFormat, typer.Option("--format", "-f", help="Output format.")
    ] = DocFormat.text,
) -> None:
    """Print the replay runbook: containment, mixed-precision order, replay, hardening.

    Example: nanrunbook checklist --stage backward
    """
    from nanrunbook.output.renderers import render_checklist
    from nanrunbook.verdict.runbook import checklist as build

    render_checklist(build(stage.value if stage else None), format.value, sys.stdout)


@app.command()
@guarded
def schema() -> None:
    """Print a JSON Schema (2020-12) of manifest.json; it does not replace check.

    Example: nanrunbook schema > nanrunbook-bundle-1.schema.json
    """
    import orjson

    from nanrunbook.manifest.schema import manifest_schema

    sys.stdout.write(orjson.dumps(manifest_schema(), option=orjson.OPT_INDENT_2).decode() + "\n")


@app.command()
@guarded
def seal(
    bundle: Annotated[
        Path,
        typer.Argument(metavar="BUNDLE", help="The evidence bundle directory.", show_default=False),
    ],
    force: Annotated[
        bool, typer.Option("--force", help="Replace a sha256 or content id that differs.")
    ] = False,
    format: Annotated[
        CheckFormat, typer.Option("--format", "-f", help="Output format of the check.")
    ] = CheckFormat.text,
) -> None:
    """Fill and verify tensor digests and the content id of a manifest, then check it.

    Example: nanrunbook seal bundle/ --format kv
    """
    from nanrunbook.capture.seal import seal_command

    raise typer.Exit(
        seal_command(bundle, force=force, format=format.value, out=sys.stdout, err=sys.stderr)
    )


def entry_point() -> None:
    app(prog_name="nanrunbook")

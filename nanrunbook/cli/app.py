"""The Typer application and what every command shares: the guard that turns
Ctrl-C and our own defects into one line and an exit code, usage lines without
braces, option types whose errors read as sentences, and the caps options."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import os
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from typer.core import TyperCommand
from typer.main import get_command_name

from nanrunbook._version import __version__
from nanrunbook.contract import Caps
from nanrunbook.exits import Exit
from nanrunbook.strictjson import MAX_SAFE_INTEGER as MAX_CAP

__all__ = [
    "BundleArgument",
    "CheckFormat",
    "DocFormat",
    "app",
    "app_for",
    "caps_from",
    "command",
    "entry_point",
    "guarded",
    "main",
    "usage_error",
]

app = typer.Typer(
    name="nanrunbook",
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class PlainUsageCommand(TyperCommand):
    """Usage lines as a man page writes them (``check [OPTIONS] BUNDLE``): Typer
    puts braces around required arguments, which reads as a choice."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces: list[str] = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


def command(short_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a command; ``short_help`` is its whole sentence in ``nanrunbook --help``
    (click would otherwise cut the docstring's first line mid-sentence)."""
    return app.command(cls=PlainUsageCommand, short_help=short_help)


class CheckFormat(StrEnum):
    text = "text"
    json = "json"
    kv = "kv"


class DocFormat(StrEnum):
    text = "text"
    json = "json"
    kv = "kv"


def whole_number(text: str) -> int:
    """A cap: a whole number from 1 to 2^53 - 1, with an error a person can act on."""
    text = str(text).strip()
    if not text.isdigit():
        raise typer.BadParameter(f"{text!r} is not a whole number (1 to {MAX_CAP})")
    number = int(text)
    if not 1 <= number <= MAX_CAP:
        raise typer.BadParameter(f"{text} is outside 1 to {MAX_CAP}")
    return number


def _cap_option(what: str) -> Any:
    return typer.Option(
        parser=whole_number, metavar="N", help=f"Cap on {what} (changes the contract id)."
    )


MaxStageElements = Annotated[int, _cap_option("elements in one stage")]
MaxBundleElements = Annotated[int, _cap_option("elements in the whole bundle")]
MaxStageTensors = Annotated[int, _cap_option("tensors in one stage")]
DEFAULT_CAPS = Caps()


def caps_from(max_stage_elements: int, max_bundle_elements: int, max_stage_tensors: int) -> Caps:
    return Caps(max_stage_elements, max_bundle_elements, max_stage_tensors)


def non_empty_path(text: str) -> Path:
    """``check "$BUNDLE"`` with BUNDLE unset is a usage error, never a check of the
    current directory (Path("") is ".")."""
    if text == "":
        raise typer.BadParameter("the path is empty (an unset variable?)")
    return Path(text)


def path_argument(metavar: str, help: str) -> Any:
    """An argument naming a path (never the empty one)."""
    return typer.Argument(metavar=metavar, parser=non_empty_path, help=help, show_default=False)


def path_option(flag: str, metavar: str, help: str) -> Any:
    """An option naming a path (never the empty one), its default stated in ``help``."""
    return typer.Option(flag, metavar=metavar, parser=non_empty_path, help=help, show_default=False)


def change_option(help: str) -> Any:
    """``--change MECHANISM=VALUE`` (replay's and prove's), repeatable."""
    return typer.Option("--change", metavar="MECHANISM=VALUE", help=help, show_default=False)


BundleArgument = Annotated[Path, path_argument("BUNDLE", "The evidence bundle directory.")]
FormatOption = Annotated[CheckFormat, typer.Option("--format", "-f", help="Output format.")]


P = ParamSpec("P")
R = TypeVar("R")


def usage_error(verb: str, message: str) -> NoReturn:
    """A usage error found in a command's body, as one line: exit 2."""
    sys.stderr.write(f"nanrunbook: {verb}: {message}\n")
    raise typer.Exit(Exit.USAGE)


def guarded(command: Callable[P, R]) -> Callable[P, R]:
    """Ctrl-C is exit 130 and a defect of ours exit 4, each one line, never a traceback.

    A reader that went away is no exception here: :func:`entry_point`'s streams
    absorb it (nanrunbook.cli._streams), so the command's own code stands."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.BadParameter):
            raise  # BadParameter: a usage error found in the command's body (exit 2)
        except KeyboardInterrupt:
            sys.stderr.write("nanrunbook: interrupted\n")
            raise typer.Exit(Exit.INTERRUPTED) from None
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


def entry_point() -> None:
    """Run the command named in ``sys.argv``. Its exit code is its answer's, whoever
    reads the output: stdout and stderr are streams that drop what a closed pipe
    will not take instead of raising (help and usage errors included)."""
    from nanrunbook.cli._streams import reader_proof_streams

    with reader_proof_streams():
        app_for(sys.argv[1:])(prog_name="nanrunbook")


def app_for(args: list[str]) -> typer.Typer:
    """``app``, or, when the first argument names a command, a copy holding that
    command alone: typer builds every command it holds, options and all, at each
    start (13 ms for the eight, measured; 3 ms for one). The command parses and
    prints the same either way (tests/test_startup.py); shell completion, which
    names commands, always gets them all."""
    if not args or any(name.startswith("_NANRUNBOOK_COMPLETE") for name in os.environ):
        return app
    for info in app.registered_commands:
        if (info.name or get_command_name(info.callback.__name__)) == args[0]:  # type: ignore[union-attr]
            one = copy.copy(app)
            one.registered_commands = [info]
            return one
    return app


def main() -> NoReturn:
    """The ``nanrunbook`` program: :func:`entry_point`, then a quick exit.

    Tearing the interpreter down (numpy, typer, every record a check made) took
    some 40 ms of every run, measured, and nothing a command leaves needs it:
    files it writes are written and renamed before it returns, its threads are
    done, and the standard streams are flushed here. So the process ends with
    ``os._exit`` and the command's exit status. (In-process callers, tests among
    them, use :func:`entry_point`, which returns or raises ``SystemExit``.)

    The cyclic garbage collector is paused for the run: what a one-shot command
    makes (modules imported on demand, a check's records) lives until the process
    ends, and the collector rescanned it for nothing: 17 ms of a small check and
    34 ms of a 20,480-tensor one, measured. ``watch``, which may follow a file for
    hours, runs it again.
    """
    gc.disable()
    try:
        entry_point()
        status: object = 0
    except SystemExit as stop:
        status = stop.code
    if status is not None and not isinstance(status, int):
        sys.stderr.write(f"{status}\n")  # as the interpreter does for SystemExit("...")
        status = 1
    for stream in (sys.stdout, sys.stderr):
        # the reader went away, or the stream is closed (None: its descriptor was
        # closed at start): the status still counts
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(status or 0)

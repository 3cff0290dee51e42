"""``nanrunbook watch``: summarise (or follow) the sentinel's telemetry and answer
with an exit code a playbook can gate on."""

from __future__ import annotations

import functools
import gc
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanrunbook.cli.app import command, guarded, non_empty_path, path_argument
from nanrunbook.exits import Exit

if TYPE_CHECKING:
    from nanrunbook.output.base import Renderer
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["watch"]

WAIT_FOR_FILE = 300.0  # seconds --follow waits for a file not yet written (a run starting)


class WatchFormat(StrEnum):
    text = "text"
    json = "json"
    kv = "kv"


def step_number(text: str) -> int:
    """A training step: a whole number from 0."""
    text = str(text).strip()
    if not text.isdigit():
        raise typer.BadParameter(f"{text!r} is not a step (a whole number from 0)")
    return int(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 1e9:
        raise typer.BadParameter(f"{text} is not a positive number of seconds")
    return value


def window_size(text: str) -> int:
    from nanrunbook.telemetry.summary import TREND_MIN_POINTS

    text = str(text).strip()
    if not text.isdigit() or not TREND_MIN_POINTS <= int(text) <= 100_000:
        raise typer.BadParameter(
            f"{text!r} is not a window of {TREND_MIN_POINTS} to 100000 records"
        )
    return int(text)


def svg_path(text: str) -> Path:
    path = non_empty_path(text)
    if path.suffix.lower() != ".svg":
        raise typer.BadParameter(
            f"{text!r}: plots are written as SVG only (FILE.svg); for a PNG, convert it"
            " (rsvg-convert -o plots.png plots.svg)"
        )
    if not path.parent.is_dir():
        raise typer.BadParameter(f"{text!r}: {path.parent} is not a directory")
    return path


TelemetryArgument = Annotated[
    list[Path],
    path_argument(
        "TELEMETRY...",
        "The sentinel's telemetry file (nanrunbook-telemetry/1 JSON lines); several"
        " files, or a run directory (incident/RUN/: its telemetry*.jsonl, one per rank),"
        " are read as one job.",
    ),
]


@command("Summarise a run's telemetry: exit 1 on a held update or non-finite step, else 0.")
def watch(
    telemetry: TelemetryArgument,
    follow: Annotated[
        bool, typer.Option("--follow", help="Keep reading as the file grows; print each event.")
    ] = False,
    since: Annotated[
        int | None,
        typer.Option(parser=step_number, metavar="STEP", help="Only records from this step on."),
    ] = None,
    format: Annotated[
        WatchFormat, typer.Option("--format", "-f", help="Output format.")
    ] = WatchFormat.text,
    plot_file: Annotated[
        Path | None,
        typer.Option(parser=svg_path, metavar="FILE.svg", help="Also write the plots as SVG."),
    ] = None,
    no_plots: Annotated[
        bool, typer.Option("--no-plots", help="Leave the terminal plots out (text format).")
    ] = False,
    fail_on_warnings: Annotated[
        bool,
        typer.Option("--fail-on-warnings", help="Exit 5 on warnings or bad lines (no alarm)."),
    ] = False,
    window: Annotated[
        int,
        typer.Option(parser=window_size, metavar="N", help="Records in the headroom trend window."),
    ] = 50,
    stop_after_idle: Annotated[
        float | None,
        typer.Option(
            parser=seconds,
            metavar="SECONDS",
            help="With --follow: stop after this long without a line.",
        ),
    ] = None,
    until_step: Annotated[
        int | None,
        typer.Option(
            parser=step_number, metavar="STEP", help="With --follow: stop once this step is read."
        ),
    ] = None,
    wait_for_file: Annotated[
        float | None,
        typer.Option(
            parser=seconds,
            metavar="SECONDS",
            help="With --follow: wait this long for a file that does not exist yet"
            f" (default {WAIT_FOR_FILE:g}, or --stop-after-idle if shorter); then exit 3.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Summarise a run's telemetry: exit 1 on a held update or non-finite step, else 0.

    Reads the JSON lines the sentinel appends (nanrunbook-telemetry/1): steps,
    holds and skips, loss-scale backoffs and streaks, warnings by code with the
    step each first appeared, the trend of gradient headroom, and plots of loss,
    gradient max abs, headroom, loss scale and skipped steps. A job's files
    (several, or a run directory) make one summary: a step counts once, the
    first non-finite step names the ranks it began on. Exit 5 with
    --fail-on-warnings when there are warnings and no alarm; 3 when a file
    cannot be read or there is no record.

    Example: nanrunbook watch run/telemetry.jsonl --format kv
    """
    needs_follow = {
        "--stop-after-idle": stop_after_idle,
        "--until-step": until_step,
        "--wait-for-file": wait_for_file,
    }
    given = [option for option, value in needs_follow.items() if value is not None]
    if not follow and given:
        raise typer.BadParameter("it needs --follow", param_hint=given[0])
    # main() paused the cyclic collector for a one-shot command; a run followed for
    # hours, or a file of millions of lines, needs it.
    gc.enable()
    options = _Options(format.value, not no_plots, fail_on_warnings, plot_file)
    if follow:
        wait = WAIT_FOR_FILE if wait_for_file is None else wait_for_file
        if stop_after_idle is not None and wait_for_file is None:
            wait = min(wait, stop_after_idle)  # a file not there yet writes no line either
        code = _follow(telemetry, since, window, (stop_after_idle, until_step, wait), options)
    else:
        code = _once(telemetry, since, window, options)
    raise typer.Exit(code)


class _Options:
    def __init__(self, fmt: str, plots: bool, fail_on_warnings: bool, plot_file: Path | None):
        from nanrunbook.output.renderers import RENDERERS

        self.renderer: Renderer = RENDERERS[fmt]
        self.plots = plots
        self.fail_on_warnings = fail_on_warnings
        self.plot_file = plot_file


@guarded
def _once(telemetry: list[Path], since: int | None, window: int, options: _Options) -> int:
    from nanrunbook.telemetry.reader import TelemetryUnreadable
    from nanrunbook.telemetry.watch import summarise_job

    try:
        summary = summarise_job(telemetry, since=since, window=window)
    except TelemetryUnreadable as error:
        sys.stderr.write(f"nanrunbook watch: cannot read {error}\n")
        return Exit.REJECTED
    return _finish(summary, options)


@guarded
def _follow(
    telemetry: list[Path],
    since: int | None,
    window: int,
    stops: tuple[float | None, int | None, float],
    options: _Options,
) -> int:
    from nanrunbook.cli._judging import emit
    from nanrunbook.cli._streams import reader_gone
    from nanrunbook.telemetry.reader import TelemetryUnreadable
    from nanrunbook.telemetry.summary import Summariser
    from nanrunbook.telemetry.watch import FollowInterrupted, follow

    def on_event(event: WatchEvent) -> bool:
        """False once standard output has gone away (``| head``): stop following."""
        emit(functools.partial(options.renderer.watch_event, event, sys.stdout), sys.stdout)
        return not reader_gone(sys.stdout)

    # One file is followed as before; several, or a run directory, as a job.
    job = len(telemetry) > 1 or telemetry[0].is_dir()
    label = ", ".join(map(str, telemetry))
    summariser = Summariser(label, since=since, window=window)
    try:
        stop_after_idle, until_step, wait_for_file = stops
        summary = follow(
            summariser,
            on_event,
            stop_after_idle=stop_after_idle,
            until_step=until_step,
            wait_for_file=wait_for_file,
            paths=telemetry if job else None,
        )
    except TelemetryUnreadable as error:
        sys.stderr.write(f"nanrunbook watch: cannot read {error}\n")
        return Exit.REJECTED
    except FollowInterrupted as stop:
        _finish(stop.summary, options)
        sys.stderr.write("nanrunbook: interrupted\n")
        return Exit.INTERRUPTED
    return _finish(summary, options)


def _finish(summary: WatchSummary, options: _Options) -> int:
    """Print the summary, write the plot file; the exit code."""
    from nanrunbook.cli._judging import emit

    write = functools.partial(
        options.renderer.watch_summary, summary, sys.stdout, plots=options.plots
    )
    emit(write, sys.stdout)
    if options.plot_file is not None:
        _write_svg(summary, options.plot_file)
    if summary.status == "EMPTY":
        sys.stderr.write(f"nanrunbook watch: no telemetry record in {summary.path}\n")
    return int(summary.exit_code(fail_on_warnings=options.fail_on_warnings))


def _write_svg(summary: WatchSummary, path: Path) -> None:
    from nanrunbook.capture.atomic import atomic_write
    from nanrunbook.output.svg import watch_svg

    heading = f"nanrunbook watch {Path(summary.path).name}: {summary.status}"
    if summary.first_step is not None:
        heading += f", steps {summary.first_step} to {summary.last_step}"
    try:
        atomic_write(path, watch_svg(summary, heading).encode())
    except OSError as error:
        sys.stderr.write(f"nanrunbook watch: cannot write {path}: {error.strerror or error}\n")
        raise typer.Exit(Exit.USAGE) from None

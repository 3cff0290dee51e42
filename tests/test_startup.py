"""Start-up imports only what a command uses: no torch ever; numpy and rich where used.

Each case runs the real CLI entry point in a fresh interpreter and lists the
modules loaded when it returns (timings belong to ``bench/bench_check.py``, not
here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TINY = str(FIXTURES / "continue-all-finite")

PROBE = """
import contextlib, io, json, sys
sys.argv = ["nanrunbook", *json.loads(sys.argv[1])]
from nanrunbook.cli import entry_point
code = 0
with contextlib.redirect_stdout(io.StringIO()):
    try:
        entry_point()
    except SystemExit as stop:
        code = stop.code
sys.stderr.write(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def loaded(*args: str) -> tuple[int, set[str]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    return report["code"], set(report["modules"])


def tops(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize(
    "args", [["--help"], ["--version"], ["check", "--help"], ["diff", "--help"]]
)
def test_help_loads_no_numpy_rich_or_torch(args: list[str]) -> None:
    code, modules = loaded(*args)
    assert code in (0, None)
    assert not tops(modules) & {"numpy", "torch", "rich", "safetensors", "ml_dtypes"}


def test_kv_check_loads_numpy_but_not_torch_or_rich() -> None:
    code, modules = loaded("check", "--format", "kv", TINY)
    assert code == 0
    assert "numpy" in modules  # counting uses it
    assert not tops(modules) & {"torch", "rich", "safetensors", "ml_dtypes"}
    # Only the renderer of the format asked for is imported.
    assert "nanrunbook.output.kv" in modules
    assert not {"nanrunbook.output.text", "nanrunbook.output.json"} & modules


def test_every_format_of_the_command_line_has_its_renderer() -> None:
    from nanrunbook.cli.app import CheckFormat, DocFormat
    from nanrunbook.output.renderers import RENDERERS

    assert set(RENDERERS) == {f.value for f in CheckFormat} == {f.value for f in DocFormat}
    for name, renderer in RENDERERS.items():
        assert renderer.name == name


def test_kv_diff_loads_no_torch_or_rich(tmp_path: Path) -> None:
    import shutil

    copy = shutil.copytree(TINY, tmp_path / "copy")  # TINY twice compares nothing (exit 2)
    code, modules = loaded("diff", "--format", "kv", TINY, str(copy))
    assert code == 0
    assert not tops(modules) & {"torch", "rich", "safetensors", "ml_dtypes"}


def test_text_check_loads_no_torch_and_no_progress_bar_for_a_tiny_bundle() -> None:
    code, modules = loaded("check", TINY)
    assert code == 0
    assert "torch" not in tops(modules)
    assert "rich.progress" not in modules  # the bar is only built for a long read


def test_rejected_check_loads_no_torch() -> None:
    code, modules = loaded("check", "--format", "json", str(FIXTURES / "rejected-digests"))
    assert code == 3
    assert "torch" not in tops(modules)


def test_importtime_of_help_names_no_numpy() -> None:
    # The interpreter's own account, through the ``python -m nanrunbook`` entry.
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nanrunbook", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "nanrunbook.cli" in imported
    assert not tops(imported) & {"numpy", "torch", "rich"}


def test_watch_help_loads_no_plotting_numpy_rich_or_torch() -> None:
    code, modules = loaded("watch", "--help")
    assert code in (0, None)
    assert not tops(modules) & {"numpy", "torch", "rich", "plotille", "safetensors"}


def test_kv_watch_loads_no_plotting_rich_numpy_or_torch(tmp_path: Path) -> None:
    telemetry = tmp_path / "t.jsonl"
    telemetry.write_bytes(b"")
    code, modules = loaded("watch", "--format", "kv", str(telemetry))
    assert code == 3  # no record
    assert not tops(modules) & {"plotille", "rich", "numpy", "torch", "logging"}


def test_other_commands_load_no_telemetry_or_plotting() -> None:
    code, modules = loaded("check", "--format", "kv", TINY)
    assert code == 0
    assert "plotille" not in tops(modules)
    assert not {"nanrunbook.telemetry.sinks", "nanrunbook.telemetry.summary"} & modules


@pytest.mark.parametrize(
    ("stop", "code", "err"), [("None", 0, ""), ("5", 5, ""), ("'boom'", 1, "boom\n")]
)
def test_the_program_exits_with_the_commands_status(stop: str, code: int, err: str) -> None:
    # main() ends the process with os._exit after flushing: the status and the
    # output written before must survive it, as SystemExit's own rules give them.
    probe = (
        "import importlib\n"
        "app = importlib.import_module('nanrunbook.cli.app')\n"
        "def command():\n"
        "    print('written before')\n"
        f"    raise SystemExit({stop})\n"
        "app.entry_point = command\n"
        "app.main()\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (code, "written before\n", err)


def test_the_program_pauses_the_collector_and_watch_runs_it() -> None:
    # A one-shot command runs without the cyclic collector (main() pauses it);
    # importing the command line leaves it as it was; watch, which may follow a
    # file for hours, runs it again.
    probe = (
        "import gc, importlib, sys\n"
        "import nanrunbook.cli\n"
        "print('after import', gc.isenabled())\n"
        "app = importlib.import_module('nanrunbook.cli.app')\n"
        "watch = importlib.import_module('nanrunbook.cli.watch')\n"
        "def once(*args, **kwargs):\n"
        "    print('watch', gc.isenabled())\n"
        "    return 0\n"
        "watch._once = once\n"
        "real = app.entry_point\n"
        "def command():\n"
        "    print('command', gc.isenabled())\n"
        "    real()\n"
        "app.entry_point = command\n"
        "sys.argv = ['nanrunbook', 'watch', sys.argv[1]]\n"
        "app.main()\n"
    )
    telemetry = Path(__file__).resolve().parent.parent / "pyproject.toml"  # any file: never read
    done = subprocess.run(
        [sys.executable, "-c", probe, str(telemetry)], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, "after import True\ncommand False\nwatch True\n")


def _command_names() -> list[str]:
    from typer.main import get_command

    from nanrunbook.cli import app

    group = get_command(app)
    return sorted(group.commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", _command_names())
@pytest.mark.parametrize("tail", [["--help"], ["--no-such-option"], []])
def test_a_command_run_alone_parses_and_prints_as_among_all(name: str, tail: list[str]) -> None:
    """The entry point builds only the command named first; its help, usage errors
    and exit codes are those of the whole app's."""
    from typer.testing import CliRunner

    from nanrunbook.cli.app import app, app_for

    alone = app_for([name])
    assert alone is not app and [info.callback for info in alone.registered_commands] == [
        info.callback
        for info in app.registered_commands
        if info.callback is not None and info.callback.__name__.replace("_", "-") == name
    ]
    runner = CliRunner()
    expected = runner.invoke(app, [name, *tail])
    got = runner.invoke(alone, [name, *tail])
    assert (got.exit_code, got.output) == (expected.exit_code, expected.output)
    assert len(app.registered_commands) == len(_command_names())  # app itself is untouched


@pytest.mark.parametrize(
    "args", [[], ["--help"], ["--version"], ["chek"], ["--format", "kv", "check"]]
)
def test_without_a_command_first_the_whole_app_runs(args: list[str]) -> None:
    from nanrunbook.cli.app import app, app_for

    assert app_for(args) is app


def test_shell_completion_gets_every_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanrunbook.cli.app import app, app_for

    monkeypatch.setenv("_NANRUNBOOK_COMPLETE", "complete_bash")
    assert app_for(["check"]) is app

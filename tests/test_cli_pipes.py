"""Exit codes never depend on who reads the output: every command, with stdout,
stderr or both (``2>&1 | head -0``) a pipe whose reader has gone, or a closed
descriptor (``>&-``), returns the code of its normal run (found in independent
testing: ``watch FILE 2>&1 | head -1`` exited 0 or 3 at random for an empty file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bundlekit import FIXTURES, copy_fixture
from setkit import make_set

CLI = [sys.executable, "-m", "nanrunbook"]
TELEMETRY = Path(__file__).resolve().parent / "sentinel_telemetry"


def normal(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def closed(args: list[str], how: str) -> int:
    """The exit code with the output going nowhere, as ``how`` says."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write gets EPIPE, as after `| head -0` or `grep -q`
    streams = {
        "stdout": {"stdout": write_end, "stderr": subprocess.DEVNULL},
        "stderr": {"stdout": subprocess.DEVNULL, "stderr": write_end},
        "both": {"stdout": write_end, "stderr": write_end},
    }
    try:
        if how == "descriptors":  # `>&- 2>&-`: the program starts without them
            program = (
                "import os, sys; os.close(1); os.close(2); os.execv(sys.argv[1], sys.argv[1:])"
            )
            done = subprocess.run([sys.executable, "-c", program, *CLI, *args], timeout=120)
        else:
            done = subprocess.run([*CLI, *args], timeout=120, **streams[how])  # type: ignore[call-overload]
    finally:
        os.close(write_end)
    return done.returncode


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pipes")
    (root / "empty.jsonl").write_bytes(b"")
    incident = make_set(root / "incident", 2, holds={1: "backward"})
    for index, member in enumerate(sorted(incident.iterdir())):
        report = normal(["check", "--format", "json", str(member)])
        (root / f"node-{index}.json").write_text(report.stdout)
    copy_fixture(root, "hold-loss")
    return {"root": str(root), "incident": str(incident)}


COMMANDS = {
    "check continue": (["check", "{fixtures}/continue-all-finite"], 0),
    "check kv rejected": (["check", "-f", "kv", "{fixtures}/rejected-identity"], 3),
    "check json hold": (["check", "-f", "json", "{fixtures}/hold-loss"], 1),
    "check several": (["check", "{fixtures}/hold-loss", "{fixtures}/rejected-identity"], 3),
    "check a set": (["check", "{incident}"], 1),
    "check unknown option": (["check", "--bogus"], 2),
    "diff": (["diff", "{fixtures}/hold-loss", "{fixtures}/hold-forward-bf16"], None),
    "merge": (["merge", "{root}/node-0.json", "{root}/node-1.json"], 1),
    "seal": (["seal", "{root}/hold-loss"], 1),
    "watch empty": (["watch", "{root}/empty.jsonl"], 3),
    "watch kv": (["watch", "-f", "kv", str(TELEMETRY / "skip-policy.jsonl")], None),
    "contract": (["contract"], 0),
    "help": (["--help"], 0),
    "version": (["--version"], 0),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_the_exit_code_is_the_same_whoever_reads_the_output(
    name: str, places: dict[str, str]
) -> None:
    template, documented = COMMANDS[name]
    args = [arg.format(fixtures=FIXTURES, **places) for arg in template]
    expected = normal(args)
    assert "Traceback" not in expected.stderr
    if documented is not None:
        assert expected.returncode == documented, expected.stderr
    for how in ("stdout", "stderr", "both", "descriptors"):
        assert closed(args, how) == expected.returncode, how

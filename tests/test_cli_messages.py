"""What the command says to a person at 3 a.m.: usage lines, option errors, and
a manifest problem worded as one (each case found in independent testing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bundlekit import FIXTURES, copy_fixture

CLI = [sys.executable, "-m", "nanrunbook"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env
    )


@pytest.mark.parametrize("command", ["check", "seal"])
def test_empty_bundle_argument_is_a_usage_error(command: str, tmp_path: Path) -> None:
    copy_fixture(tmp_path, "continue-all-finite")
    # A bundle in the working directory must not be checked in its place.
    done = run(command, "", cwd=tmp_path / "continue-all-finite")
    assert done.returncode == 2
    assert "empty" in done.stderr and "Traceback" not in done.stderr


def test_parent_of_bundles_says_manifest_and_lists_them() -> None:
    done = run("check", str(FIXTURES))
    assert done.returncode == 3
    assert "tensor file" not in done.stdout
    assert "bundle " in done.stdout and "has no manifest.json" in done.stdout
    assert "bundles one level down: 'continue-all-finite'" in done.stdout


def test_directory_named_manifest_is_a_manifest_problem(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").mkdir()
    done = run("check", str(tmp_path), "--format", "json")
    assert done.returncode == 3
    assert "MANIFEST_UNREADABLE" in done.stdout
    assert "tensor file" not in done.stdout and "manifest of bundle" in done.stdout


def test_manifest_symlink_out_of_the_bundle_is_worded_as_manifest(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    (tmp_path / "outside.json").write_text("{}")
    (bundle / "manifest.json").symlink_to(tmp_path / "outside.json")
    done = run("check", str(bundle))
    assert done.returncode == 3
    assert "outside the bundle" in done.stdout and "tensor file" not in done.stdout


def test_usage_has_no_braces_and_summaries_are_whole_sentences() -> None:
    assert "Usage: nanrunbook check [OPTIONS] BUNDLE\n" in run("check", "--help").stdout
    assert "{" not in run("seal", "--help").stdout.splitlines()[0]
    top = run("--help").stdout
    commands = top.split("Commands:")[1]
    assert not any(line.rstrip().endswith("...") for line in commands.splitlines())
    summary = "Judge an evidence bundle: HOLD (exit 1), CONTINUE (exit 0) or rejected (exit 3)."
    assert summary in " ".join(top.split())


def test_a_bad_number_reads_as_a_sentence() -> None:
    done = run("check", str(FIXTURES / "hold-input"), "--max-stage-tensors", "abc")
    assert done.returncode == 2
    assert "'abc' is not a whole number" in done.stderr and "int range" not in done.stderr
    done = run("contract", "--max-stage-tensors", "0")
    assert done.returncode == 2 and "outside 1 to" in done.stderr


def test_docs_exit_table_says_a_non_bundle_path_is_3() -> None:
    page = (FIXTURES.parent / "docs" / "check.md").read_text()
    exits = page.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert "not a bundle" in exits and "answers 3" in exits

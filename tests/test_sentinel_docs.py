"""nanrunbook-sentinel(7) against the code: the telemetry keys, the warning codes
the sentinel can emit, the exception's attributes; and the page renders clean."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_docs import sections, tags

from nanrunbook import __version__
from nanrunbook.capture.incident import SentinelHold
from nanrunbook.capture.telemetry import (
    GradTelemetry,
    StepTelemetry,
    UpdateTelemetry,
)
from nanrunbook.warning_codes import WARNING_CODES

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "man" / "nanrunbook-sentinel.7"
GROFF = shutil.which("groff")


@pytest.mark.skipif(GROFF is None, reason="groff is not installed")
def test_the_page_renders_without_warnings_and_copies_intact() -> None:
    assert GROFF is not None
    checked = subprocess.run(
        [GROFF, "-man", "-ww", "-z", str(PAGE)], capture_output=True, text=True
    )
    assert (checked.returncode, checked.stderr) == (0, "")
    text = subprocess.run(
        [GROFF, "-man", "-Tutf8", "-P-cbou", str(PAGE)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    ).stdout
    assert "‐" not in text and "nanrunbook-telemetry/1" in text


def test_the_page_carries_the_version() -> None:
    th = next(line for line in PAGE.read_text().splitlines() if line.startswith(".TH "))
    assert f'"nanrunbook {__version__}"' in th


def test_every_telemetry_key_is_documented_in_order() -> None:
    line = StepTelemetry(
        run_id="r",
        rank=0,
        world_size=1,
        step=1,
        time=0.0,
        loss=None,
        loss_class="nan",
        grad=GradTelemetry(),
        update=UpdateTelemetry(),
        scale=None,
        found_inf=None,
        skipped=False,
        held=False,
    ).line()
    assert tags(sections(PAGE)["TELEMETRY"]) == list(line)
    body = sections(PAGE)["TELEMETRY"]
    for key in (*line["grad"], *line["update"]):
        assert re.search(rf"^\.BR? {key}\b", body, re.MULTILINE), key


def emitted_codes() -> set[str]:
    """Every warning code the capture side's source can put in a line."""
    codes = set()
    for path in (ROOT / "nanrunbook" / "capture").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Alert":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    codes.add(first.value)
    # The divergence warnings' codes have one home, shared with watch.
    from nanrunbook.telemetry._early import SIGNALS

    return codes | {code for code, _ in SIGNALS.values()}


def test_the_documented_warning_codes_are_the_emitted_ones() -> None:
    documented = set(tags(sections(PAGE)["WARNING CODES"]))
    assert documented == emitted_codes()
    assert documented <= set(WARNING_CODES)


def test_the_exceptions_attributes_are_documented() -> None:
    hold = SentinelHold(
        step=3,
        reason="r",
        stage=None,
        bundle=None,
        report=None,
        last_known_good={"checkpoint_id": "c", "step": 2},
    )
    public = {name for name in vars(hold) if not name.startswith("_")}
    public |= {name for name, value in vars(SentinelHold).items() if isinstance(value, property)}
    assert set(tags(sections(PAGE)["EXCEPTION"])) == public


def test_readme_shows_the_loop_before_and_after() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The sentinel", 1)[1].split("\n## ", 1)[0]
    assert "Before" in section and "After" in section
    assert "sentinel.forward(batch)" in section and "sentinel.checkpointed(" in section
    assert "man -l man/nanrunbook-sentinel.7" in readme

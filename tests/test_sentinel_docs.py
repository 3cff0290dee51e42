"""nanrunbook-sentinel(7) against the code: the telemetry keys, the warning codes
the sentinel can emit, the exception's attributes; and the page renders clean."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_docs import sections, tags
from test_sentinel_telemetry import full_record

from nanrunbook import __version__
from nanrunbook.capture.incident import SentinelHold
from nanrunbook.telemetry.record import record_document
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
    """Every field set (as the sentinel builds one), so no key is left out."""
    line = record_document(full_record())
    assert tags(sections(PAGE)["TELEMETRY"]) == list(line)
    body = sections(PAGE)["TELEMETRY"]
    for key in (*line["grad"], *line["update"]):
        assert re.search(rf"^\.BR? {key}\b", body, re.MULTILINE), key


def emitted_codes() -> set[str]:
    """Every warning code the capture side's source can put in a line."""
    codes = set()
    for path in (ROOT / "nanrunbook" / "capture").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "alert":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    codes.add(first.value)
    # The divergence and headroom warnings' codes have one home, shared with watch.
    from nanrunbook.telemetry._early import SIGNALS
    from nanrunbook.telemetry.record import HEADROOM_CODES

    return codes | {code for code, _ in SIGNALS.values()} | set(HEADROOM_CODES)


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


def test_the_sentinel_page_shows_the_loop_before_and_after() -> None:
    page = (ROOT / "docs" / "sentinel.md").read_text()
    section = page.split("## The sentinel", 1)[1].split("\n## ", 1)[0]
    assert "Before" in section and "After" in section
    assert "sentinel.forward(batch)" in section and "sentinel.checkpointed(" in section
    assert "man -l man/nanrunbook-sentinel.7" in page


README = ROOT / "README.md"


def readme_loops() -> tuple[str, str]:
    """The README's sentinel section: the loop without the sentinel, and with it."""
    section = README.read_text().split("## The sentinel", 1)[1].split("\n## ", 1)[0]
    assert "Without the sentinel" in section and "With it" in section
    before, after = re.findall(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert "sentinel.forward(batch)" in after and "sentinel.checkpointed(" in after
    return before, after


def run_readme_loop(code: str, steps: int, bad_step: int | None = None) -> dict[str, Any]:
    """Runs one of the README's loops as written, on a small CPU regression whose
    batch at ``bad_step`` holds an infinity; returns the names the loop left."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            x = torch.randn(16, 4, generator=generator)
            if step == bad_step:
                x[3, 1] = float("inf")
            yield {"x": x, "y": x.sum(1)}

    def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((model(batch["x"]).squeeze(1) - batch["y"]) ** 2).mean()

    names: dict[str, Any] = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "loader": batches(),
        "compute_loss": compute_loss,
        "saved": [],
        "restarts": [],
    }
    names["save_checkpoint"] = names["saved"].append
    names["restart_from"] = names["restarts"].append
    exec(compile(code, str(README), "exec"), names)
    return names


def parameters(names: dict[str, Any]) -> list[bytes]:
    return [p.detach().numpy().tobytes() for p in names["model"].parameters()]


def test_the_readme_loop_runs_as_written_with_and_without_the_sentinel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanrunbook import check_bundle

    monkeypatch.chdir(tmp_path)
    before, after = readme_loops()
    # Healthy: the sentinel's loop trains bit for bit as the plain one.
    plain = run_readme_loop(before, steps=1002)
    watched = run_readme_loop(after, steps=1002)
    assert parameters(watched) == parameters(plain)
    assert watched["saved"] == plain["saved"] == ["ckpt-1000"]
    assert watched["restarts"] == []
    # An infinity in step 1003's batch: the update is held, the bundle checks HOLD
    # at the input, and the loop is told to restart from the checkpoint of step 1000.
    held = run_readme_loop(after, steps=1005, bad_step=1003)
    assert parameters(held) == parameters(plain)
    [lkg] = held["restarts"]
    assert (lkg["checkpoint_id"], lkg["step"]) == ("ckpt-1000", 1000)
    [manifest] = (tmp_path / "incident" / "run-7").glob("*/manifest.json")
    assert manifest.parent.name == "1003"
    report = check_bundle(manifest.parent)
    assert report.decision.decision == "HOLD"
    assert report.decision.earliest_nonfinite_stage == "input"
    assert (tmp_path / "incident" / "run-7" / "telemetry.jsonl").is_file()

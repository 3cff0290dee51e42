"""Did the held step come back? Real CPU runs with real faults: a one-element
corruption only the live step sees (a simulated bit flip) is NOT_REPRODUCED; a
NaN in the data comes back on the replay and is REPRODUCED. Under
``transient="rerun"`` the transient fault skips the step instead of holding."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import sentinel_support as support
import torch
from torch import nn

from nanrunbook.capture.incident import Reproduction
from nanrunbook.capture.torch import Sentinel

HELD = 3


def flip_once(module: nn.Module, at_call: int) -> list[int]:
    """A forward hook that turns one output element into NaN at its ``at_call``-th
    call only: the live step sees it, a replay of that step does not."""
    calls = [0]

    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == at_call:
            output = output.clone()
            output.view(-1)[5] = float("nan")
        return output

    module.register_forward_hook(hook)
    return calls


def nan_batch(step: int) -> dict[str, torch.Tensor]:
    batch = support.regression_batch(step)
    if step == HELD:
        batch["x"][2, 1] = float("nan")
    return batch


def train(tmp: Path, run_id: str, batches: Any, steps: int = 5, **options: Any) -> Any:
    torch.manual_seed(0)
    model = support.Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    hooked = options.pop("hook", None)
    if hooked is not None:
        flip_once(model.body[0], hooked)
    stated = support.facts(run_id, tmp, thresholds=support.quiet_thresholds(), **options)
    sentinel = Sentinel(model, optimizer, support.mse, **stated)

    def step(i: int) -> Any:
        optimizer.zero_grad()
        loss = sentinel.forward(batches(i))
        loss.backward()
        optimizer.step()
        return loss

    ran = support.run_loop(step, steps, lambda: support.state_bits(model, optimizer))
    sentinel.close()
    return ran, model, optimizer


def test_a_nan_in_the_data_comes_back_on_the_replay(tmp_path: Path) -> None:
    ran, _, _ = train(tmp_path, "data-nan", nan_batch)
    hold = ran.hold
    assert hold is not None and hold.step == HELD
    reproduced = hold.reproduced
    assert isinstance(reproduced, Reproduction)
    assert reproduced.verdict == "REPRODUCED" and reproduced.differed == ()
    assert reproduced.live.stage == reproduced.replay.stage == "loss"
    assert reproduced.live.loss_bits == reproduced.replay.loss_bits
    assert reproduced.host == socket.gethostname() and reproduced.device == "cpu"
    assert reproduced.rank is None and reproduced.policy == "hold"
    assert "REPRODUCED on host" in str(hold)
    [line] = [line for line in support.telemetry(tmp_path, "data-nan") if line["held"]]
    assert line["reproduced"] == "REPRODUCED"


def test_a_bit_flip_only_the_live_step_saw_is_not_reproduced(tmp_path: Path) -> None:
    # Call 3 of the first layer is the live forward of step 3.
    ran, model, _ = train(tmp_path, "flip", support.regression_batch, hook=HELD)
    hold = ran.hold
    assert hold is not None and hold.step == HELD
    reproduced = hold.reproduced
    assert reproduced is not None and reproduced.verdict == "NOT_REPRODUCED"
    assert reproduced.live.stage == "loss" and reproduced.replay.stage is None
    assert reproduced.live.loss == (1, 0, 0) and reproduced.replay.loss == (0, 0, 0)
    assert reproduced.differed[0] == "first non-finite boundary: live loss, replay none"
    assert any(d.startswith("loss bits of micro-batch 0: live ") for d in reproduced.differed)
    assert reproduced.line().startswith(
        f"NOT_REPRODUCED on host {socket.gethostname()}, device cpu:"
    )
    assert support.params_finite(model)
    lines = support.telemetry(tmp_path, "flip")
    assert [line["reproduced"] for line in lines] == [None, None, "NOT_REPRODUCED"]


def test_rerun_skips_a_transient_fault_and_goes_on(tmp_path: Path) -> None:
    ran, model, _ = train(tmp_path, "rerun", support.regression_batch, hook=HELD, transient="rerun")
    assert ran.hold is None and ran.steps == 5  # the run went on
    assert support.params_finite(model)
    lines = support.telemetry(tmp_path, "rerun")
    skipped = lines[HELD - 1]
    assert skipped["skipped"] and not skipped["held"] and skipped["update"] is None
    assert skipped["reproduced"] == "NOT_REPRODUCED" and skipped["bundle"]
    assert [w["code"] for w in skipped["warnings"]] == ["STEP_NOT_REPRODUCED"]
    assert "skipped, not held: NOT_REPRODUCED" in skipped["warnings"][0]["message"]
    assert Path(skipped["bundle"]).is_dir()  # the evidence is kept
    assert not any(line["held"] for line in lines)


def test_rerun_still_holds_a_fault_that_comes_back(tmp_path: Path) -> None:
    ran, _, _ = train(tmp_path, "rerun-nan", nan_batch, transient="rerun")
    hold = ran.hold
    assert hold is not None and hold.step == HELD
    assert hold.reproduced is not None and hold.reproduced.verdict == "REPRODUCED"
    assert hold.reproduced.policy == "rerun"


def test_a_not_reproduced_incident_replays_from_its_capsule_as_its_bundle(tmp_path: Path) -> None:
    """The capsule's replay says how it differs from the live step as the held
    process's replay said it: the incident bundle again, bit for bit."""
    from nanrunbook.capture.torch import Capsule

    ran, _, _ = train(tmp_path, "flip-capsule", support.regression_batch, hook=HELD)
    hold = ran.hold
    assert hold is not None and hold.capsule is not None
    capsule = Capsule.open(hold.capsule)
    assert capsule.reproduced == hold.reproduced and capsule.reproduced.verdict == "NOT_REPRODUCED"

    def build() -> dict[str, Any]:
        model = support.Regressor()
        return {"model": model, "optimizer": torch.optim.Adam(model.parameters()),
                "compute_loss": support.mse}  # fmt: skip

    report = capsule.replay(build, out=tmp_path / "again")
    assert report.manifest.evidence_content_id == hold.report.manifest.evidence_content_id
    sources = [finding.record.probe_source for finding in report.stages]
    assert any("replay differs from the live step" in source for source in sources)

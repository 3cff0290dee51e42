"""One GradScaler shared by two optimizers, the sentinel watching one of them:
what it does to its own optimizer's scaler bookkeeping leaves the other's alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from sentinel_support import Sentinel, facts, quiet_thresholds, regression_batch
from torch import nn
from torch.amp.grad_scaler import OptState


def test_a_rollback_under_skip_does_not_unscale_the_other_optimizer_twice(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"watched": nn.Linear(8, 1), "other": nn.Linear(8, 1)})
    watched = torch.optim.SGD(model["watched"].parameters(), lr=0.05)
    other = torch.optim.SGD(model["other"].parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def loss_fn(m: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(((m[k](b["x"]).squeeze(1) - b["y"]) ** 2).mean() for k in ("watched", "other"))

    def corrupt(opt: Any, args: Any, kwargs: Any) -> None:  # one bad update, inside step()
        if opt is watched and sentinel.last_step == 3:
            with torch.no_grad():
                model["watched"].weight[0, 0] = float("nan")

    watched.register_step_post_hook(corrupt)
    sentinel = Sentinel(
        model,
        watched,
        loss_fn,
        scaler=scaler,
        policy="skip",
        snapshot=True,
        thresholds=quiet_thresholds(sample_every=0),
        **facts("shared-scaler", tmp_path),
    )
    for i in range(1, 6):
        watched.zero_grad()
        other.zero_grad()
        scaler.scale(sentinel.forward(regression_batch(i))).backward()
        scaler.unscale_(watched)  # both unscaled first, as a loop that clips both does
        scaler.unscale_(other)
        unscaled = [p.grad.clone() for p in model["other"].parameters()]
        scaler.step(watched)  # step 4: the sentinel rolls step 3 back, skips this one
        state = scaler._per_optimizer_states[id(other)]
        assert state["stage"] is OptState.UNSCALED, i
        scaler.step(other)
        grads = [p.grad for p in model["other"].parameters()]
        assert all(torch.equal(g, u) for g, u in zip(grads, unscaled, strict=True)), i
        scaler.update()
    sentinel.close()
    lines = (tmp_path / "incident" / "shared-scaler" / "telemetry.jsonl").read_text()
    assert lines.count('"skipped":true') == 2  # step 3 rolled back, step 4 skipped

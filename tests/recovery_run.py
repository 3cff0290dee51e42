"""A real run that blows up at one step for a learning rate too large for one
batch, for the proof-of-recovery tests and ``nanrunbook prove --entry``.

A linear regression on small features, with one float16 parameter ``rare``
for a feature that is zero in every batch but step ``SPIKE``'s: there its
gradient is 40000, and SGD at lr 2 writes 80000 into a float16 (inf: the
update goes non-finite, the sentinel holds the step); at lr 1 it writes
-40000, finite, and the feature never comes back. A ballast parameter with
zero gradients keeps the parameters' norm large, so that jump is no
divergence warning. Batches come from a StatefulDataLoader, in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sentinel_support
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

SPIKE = 8  # the step that blows up
BATCH = 8
STEPS = 20
RUN_ID = "prove-run"


class Rare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1, bias=False)
        self.rare = nn.Parameter(torch.full((1,), 0.01, dtype=torch.float16))
        self.ballast = nn.Parameter(torch.full((64,), 5000.0))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        features, rare = batch[:, :4], batch[:, 4]
        return (
            self.linear(features).squeeze(1) + self.rare.float() * rare + 0.0 * self.ballast.sum()
        )


def dataset() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    data = torch.zeros(STEPS * BATCH, 6)
    data[:, :4] = 0.01 * torch.randn(STEPS * BATCH, 4, generator=g)
    data[:, 5] = data[:, :4].sum(1)  # the target
    data[(SPIKE - 1) * BATCH, 4] = 40000.0  # step SPIKE's batch: the rare feature
    return data


def l1(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.l1_loss(model(batch), batch[:, 5], reduction="sum")


def build() -> dict[str, Any]:
    """The entry ``nanrunbook prove --entry recovery_run:build`` calls."""
    torch.manual_seed(0)
    model = Rare()
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    loader = StatefulDataLoader(dataset(), batch_size=BATCH, shuffle=False)
    return {
        "model": model,
        "optimizer": optimizer,
        "compute_loss": l1,
        "loader": loader,
        "sentinel": {"snapshot": True},
    }


def facts(tmp: Path) -> dict[str, Any]:
    objective = {"id": "l1", "reduction": "sum"}
    return sentinel_support.facts(
        RUN_ID, tmp, data={"id": "rare-feature"}, objective=objective, snapshot=True
    )


def run_original(tmp: Path, every: int = 3) -> tuple[Any, Path]:
    """The run as it went: a recovery point every ``every`` steps, held at SPIKE.
    Returns the hold and the directory of points."""
    from nanrunbook.capture.torch import Sentinel, SentinelHold

    built = build()
    model, optimizer, loader = built["model"], built["optimizer"], built["loader"]
    points = tmp / "points"
    points.mkdir()
    sentinel = Sentinel(model, optimizer, l1, **facts(tmp))
    hold = None
    try:
        for step, batch in enumerate(loader, start=1):
            optimizer.zero_grad()
            sentinel.forward(batch).backward()
            optimizer.step()
            if step % every == 0:
                sentinel.save_recovery_point(points / f"step-{step}", data=loader)
        sentinel.close()
    except SentinelHold as held:
        hold = held
    return hold, points

"""A loss that goes NaN through the log of a zero probability, caught and judged.

A small binary classifier ends in ``nn.Sigmoid`` and the loss is written out by
hand as ``-(y*log(p) + (1-y)*log(1-p))``. In float32, ``sigmoid(z)`` rounds to
exactly 1.0 once ``z`` passes about 17, so for a confident, correct prediction
with ``y = 1`` the second term is ``0 * log(0) = 0 * -inf = NaN``. (The fix is
``BCEWithLogitsLoss``; this script shows the incident, not the fix.)

The training loop checks the loss before ``backward()``. When it is not finite,
it replays the step on copies with :func:`nanrunbook.capture.torch.replay_step`
(the real model and optimizer are left as they are), writes the evidence
bundle, and runs the check, which answers HOLD at the loss stage.

    python examples/nan_loss_log_zero.py [--out DIR]

Exit status: the check's (1 = HOLD, 0 = CONTINUE, 3 = rejected); 2 when the run
never went non-finite.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _report import USAGE_ERROR, refused_out, report  # examples/_report.py: the verdict

from nanrunbook.capture.torch import replay_step

RUN_ID = "example-log-zero"
BATCH = 32


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Linearly separable points with 5% of the labels flipped."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator) * 3
    w_true = torch.randn(8, generator=generator)
    y = (x @ w_true > 0).float()
    flip = torch.rand(256, generator=generator) < 0.05
    y[flip] = 1 - y[flip]
    return x, y


def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    p = model(batch["x"]).squeeze(1)
    y = batch["y"]
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the bundle (a new directory)")
    args = parser.parse_args(argv)
    refused = refused_out(args.out)
    if refused is not None:
        print(refused, file=sys.stderr)
        return USAGE_ERROR
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="nanrunbook-")) / "bundle"

    torch.manual_seed(0)
    x, y = make_data()
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1), torch.nn.Sigmoid()
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    last_good = 0

    for step in range(1, 2001):
        rows = torch.arange(step * BATCH, (step + 1) * BATCH) % len(x)
        batch = {"x": x[rows], "y": y[rows]}
        rng = torch.get_rng_state()
        loss = compute_loss(model, batch)
        if torch.isfinite(loss):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            last_good = step
            continue

        print(f"step {step}: loss is {loss.item()}; replaying it on copies to capture evidence")
        binding: dict[str, dict[str, Any]] = {
            "checkpoint": {"id": "in-memory-start"},
            "data": {"id": "synthetic-separable-5pct-flipped", "rows": len(x)},
            "loader_cursor": {"id": f"row-{rows[0].item()}"},
            "objective": {"id": "hand-written-bce", "reduction": "mean"},
            "scheduler": {"id": "constant-lr"},
        }
        replay_step(
            model,
            optimizer,
            batch,
            compute_loss,
            run_id=RUN_ID,
            step=step,
            incident_owner="ml-oncall",
            # The loop stated its recovery point: the in-memory state after the last
            # good step holds all five parts together (nothing is assumed for it).
            last_known_good={
                "checkpoint_id": f"in-memory-step-{last_good}",
                "step": last_good,
                "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
            },
            binding=binding,
            rng_state=rng,
            target=out,
        )
        return report(out)
    print("the loss stayed finite; no incident")
    return 2


if __name__ == "__main__":
    sys.exit(main())

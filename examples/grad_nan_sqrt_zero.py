"""Gradients that go NaN under a finite loss (sqrt at zero), caught and judged.

A siamese encoder learns a contrastive loss on Euclidean distances,
``d = sqrt(sum((f(a) - f(b))**2))``. One batch holds a duplicated record: a pair
that is the same sample twice. Its distance is exactly 0, the loss stays
finite, but the derivative of ``sqrt`` at 0 is infinite and ``0 * inf`` makes
every gradient NaN. (The fix is ``sqrt(x + eps)`` or squared distances.)

The loop watches the gradient norm ``clip_grad_norm_`` returns. When it is not
finite, the step is not applied; the loop replays it on copies with
:func:`nanrunbook.capture.torch.replay_step` (the real model and optimizer are
left as they are), writes the evidence bundle, and runs the check: HOLD at the
backward stage, although the loss was finite.

    python examples/grad_nan_sqrt_zero.py [--out DIR]

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

RUN_ID = "example-sqrt-zero"
DUPLICATE_STEP = 20  # the batch that holds one record twice


def make_batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    a = torch.randn(16, 10, generator=generator)
    same = torch.rand(16, generator=generator) < 0.5
    near = a + 0.1 * torch.randn(16, 10, generator=generator)
    b = torch.where(same[:, None], near, torch.randn(16, 10, generator=generator))
    if step == DUPLICATE_STEP:
        b[3], same[3] = a[3], True  # a duplicated record paired with itself
    return {"a": a, "b": b, "same": same.float()}


def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    distance = ((model(batch["a"]) - model(batch["b"])) ** 2).sum(1).sqrt()
    similar = batch["same"]
    return (similar * distance**2 + (1 - similar) * torch.relu(1.0 - distance) ** 2).mean()


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
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    last_good = 0

    for step in range(1, 101):
        batch = make_batch(step)
        rng = torch.get_rng_state()
        loss = compute_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        if torch.isfinite(norm):
            optimizer.step()
            last_good = step
            continue

        optimizer.zero_grad()  # the NaN gradients are never applied
        print(
            f"step {step}: loss {loss.item():.4g} but gradient norm {norm.item()};"
            " replaying it on copies to capture evidence"
        )
        binding: dict[str, dict[str, Any]] = {
            "checkpoint": {"id": "in-memory-start"},
            "data": {"id": "synthetic-pairs", "dedup": "none"},
            "loader_cursor": {"id": f"batch-{step}"},
            "objective": {"id": "contrastive-euclidean", "reduction": "mean"},
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
    print("the gradients stayed finite; no incident")
    return 2


if __name__ == "__main__":
    sys.exit(main())

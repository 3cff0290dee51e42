"""An fp16 overflow under autocast with a dynamic GradScaler, caught and judged.

A small MLP trains on the CPU under ``torch.autocast(dtype=torch.float16)`` with
a ``torch.amp.GradScaler``. One shard logs a feature in raw units (tens of
thousands): the float32 batch is finite, but values above 65504 overflow when
autocast casts the first Linear's input to float16, the activations become
inf and NaN, and so does the loss.

The scaler alone would only skip the step and halve the scale, which looks like
routine loss-scale overflow. The loop checks the loss instead; when it is not
finite it replays the step on copies with
:func:`nanrunbook.capture.torch.replay_step` (the real model, optimizer and
scaler are left as they are), writes the evidence bundle with the scaler's own
found_inf / skip / backoff, and runs the check: HOLD at the forward stage,
where the overflow happened, not at the loss scaling.

    python examples/fp16_overflow_gradscaler.py [--out DIR]

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

RUN_ID = "example-fp16-overflow"
FEATURES = 16
RAW_UNITS_STEP = 12  # the first batch from the shard with the unnormalized feature


def make_batch(step: int, w_true: torch.Tensor) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, FEATURES, generator=generator)
    if step >= RAW_UNITS_STEP:
        x[:, 3] = x[:, 3].abs() * 3.0e4  # feature 3 in raw units, not standardized
    return {"x": x, "y": (x @ w_true).argmax(1)}


def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(batch["x"])
        return torch.nn.functional.cross_entropy(logits, batch["y"])


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
    w_true = torch.randn(FEATURES, 4)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 4),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    last_good = 0

    for step in range(1, 101):
        batch = make_batch(step, w_true)
        rng = torch.get_rng_state()
        loss = compute_loss(model, batch)
        if torch.isfinite(loss):
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            last_good = step
            continue

        print(
            f"step {step}: loss is {loss.item()} (scale {scaler.get_scale()});"
            " replaying it on copies to capture evidence"
        )
        binding: dict[str, dict[str, Any]] = {
            "checkpoint": {"id": "in-memory-start"},
            "data": {"id": "synthetic-mixed-units", "shard": "raw-units"},
            "loader_cursor": {"id": f"batch-{step}"},
            "objective": {"id": "cross-entropy", "reduction": "mean"},
            "scheduler": {"id": "constant-lr"},
        }
        replay_step(
            model,
            optimizer,
            batch,
            compute_loss,
            scaler=scaler,
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

"""A warm-up written wrong blows a run up; the sentinel warns, holds and captures.

A small regression model trains with SGD under a LambdaLR warm-up whose factor
is meant to reach 1.0 but is written as 3000.0 from step 30 on. The gradient
norm spikes against its running median (GRAD_NORM_SPIKE, in the telemetry and
the log) several steps before the loss overflows. At the first non-finite
loss the sentinel holds: the optimizer and the scheduler do not step, the
step is replayed on copies, its bundle is written under the incident
directory and checked (HOLD at the loss), and SentinelHold says where to
restart from.

The loop differs from an unwatched one by the lines marked ``# sentinel``.

    python examples/sentinel_warmup_blowup.py [--out DIR]

Exit status: the check's (1 = HOLD, 0 = CONTINUE, 3 = rejected); 2 when the run
never went non-finite.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from _report import report  # examples/_report.py: prints the check's verdict

from nanrunbook.capture.torch import Sentinel, SentinelHold

RUN_ID = "example-warmup-blowup"
PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]


def batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=generator)
    return {"x": x, "y": x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(32, generator=generator)}


def compute_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]).squeeze(1) - batch["y"]) ** 2).mean()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the incident directory (default: a new one)")
    args = parser.parse_args(argv)
    incident: Path = args.out or Path(tempfile.mkdtemp(prefix="nanrunbook-")) / "incident"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 30 else 3000.0)
    sentinel = Sentinel(  # sentinel
        model,
        optimizer,
        compute_loss,
        scheduler=warmup,
        run_id=RUN_ID,
        incident_dir=incident,
        checkpoint={"id": "init-seed-0", "verified_together": PARTS},
        data={"id": "synthetic-linear"},
        objective={"id": "mse", "reduction": "mean"},
    )
    try:
        for step in range(1, 201):
            optimizer.zero_grad()
            loss = sentinel.forward(batch(step))  # sentinel: was compute_loss(model, batch(step))
            loss.backward()
            optimizer.step()
            warmup.step()
            if step % 10 == 0:
                sentinel.checkpointed(f"in-memory-{step}", verified_together=PARTS)  # sentinel
    except SentinelHold as hold:
        print(f"held: {hold}")
        telemetry = incident / RUN_ID / "telemetry.jsonl"
        lines = [json.loads(line) for line in telemetry.read_text().splitlines()]
        warned = [line["step"] for line in lines if line["warnings"]]
        print(
            f"telemetry: {len(lines)} lines; first warning at step {warned[0]},"
            f" hold at step {hold.step}"
        )
        return report(hold.bundle) if hold.bundle is not None else 3
    print("the run stayed finite; no incident")
    return 2


if __name__ == "__main__":
    sys.exit(main())

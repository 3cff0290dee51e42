"""Under a dynamic GradScaler, which non-finite values the policy decides and
which hold whatever it says: the runs, and man 7's DECISIONS, agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sentinel_support import (
    Classifier,
    Sentinel,
    bundles,
    drifting_batch,
    facts,
    quiet_thresholds,
    run_loop,
    state_bits,
    telemetry,
    xent,
)
from test_docs import sections

PAGE = Path(__file__).resolve().parent.parent / "man" / "nanrunbook-sentinel.7"


def _run(
    tmp: Path, run_id: str, policy: str, init_scale: float, bad: set[int], **thresholds: Any
) -> Any:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    sentinel = Sentinel(
        model,
        optimizer,
        xent,
        scaler=scaler,
        policy=policy,
        thresholds=quiet_thresholds(**thresholds),
        **facts(run_id, tmp),
    )

    def step(i: int) -> Any:
        batch = drifting_batch(i, drift_from=10**6)
        if i in bad:
            batch["x"][0, 0] = float("nan")  # a bad record: the loss itself is NaN
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sentinel.forward(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    ran = run_loop(step, 12, lambda: state_bits(model, optimizer, scaler=scaler))
    sentinel.close()
    return ran, scaler, telemetry(tmp, run_id)


def _gradscaler_rule() -> str:
    body = sections(PAGE)["DECISIONS"]
    return " ".join(
        body[body.index("a GradScaler overflow") : body.index("a non\\-finite update")].split()
    )


def test_a_nan_loss_under_a_gradscaler_is_the_policys_to_decide(tmp_path: Path) -> None:
    """skip: the bad record's step is skipped, the scale neither backs off nor
    counts it, training goes on; the same run under hold holds at once."""
    ran, _, lines = _run(tmp_path, "skip", "skip", 2.0**8, bad={3, 7})
    assert ran.hold is None and ran.steps == 12
    assert [line["step"] for line in lines if line["skipped"]] == [3, 7]
    assert [line["loss_class"] for line in lines if line["skipped"]] == ["nan", "nan"]
    scales = {line["step"]: line["scale"] for line in lines}
    assert scales[3] == scales[4] and scales[7] == scales[8]  # no backoff for a NaN loss
    assert ran.before[4] == ran.before[3] and bundles(tmp_path, "skip") == []

    ran, _, lines = _run(tmp_path, "hold", "hold", 2.0**8, bad={3})
    assert ran.hold is not None and ran.hold.step == 3 and ran.hold.stage == "input"
    assert "non-finite loss" in ran.hold.reason
    # man 7 says the same: the policy decides a non-finite loss under a scaler.
    rule = _gradscaler_rule()
    assert "or when the unscaled loss itself is non" not in rule
    assert "decided by the policy" in rule


def test_a_nan_loss_every_step_under_skip_holds_after_skip_hold(tmp_path: Path) -> None:
    ran, _, lines = _run(tmp_path, "streak", "skip", 2.0**8, bad=set(range(2, 13)), skip_hold=3)
    assert ran.hold is not None and ran.hold.step == 5  # skips 2, 3, 4; the fourth holds
    assert "consecutive skipped steps" in ran.hold.reason
    assert [line["step"] for line in lines if line["skipped"]] == [2, 3, 4]
    assert "after" in _gradscaler_rule() and "skip_hold" in _gradscaler_rule()


@pytest.mark.parametrize("policy", ["hold", "skip"])
def test_scaler_backoffs_hold_whatever_the_policy(policy: str, tmp_path: Path) -> None:
    """The scaler's own limits (backoff_hold in a row, the floor) hold under
    skip as under hold: they are not a skip's to absorb."""
    ran, _, lines = _run(tmp_path, policy, policy, 2.0**24, bad=set(), backoff_hold=3)
    assert ran.hold is not None and ran.hold.step == 3
    assert "GradScaler overflow skips in a row" in ran.hold.reason
    assert [(line["found_inf"], line["skipped"]) for line in lines[:2]] == [(True, True)] * 2
    assert "whatever the policy" in _gradscaler_rule()

"""Real FSDP2 training loops for the sentinel's tests (gloo, CPU): a small MLP,
``fully_shard`` on each linear layer and the root, over ``init_device_mesh("cpu",
(N,))``. A worker writes what its rank ended with to ``<tmp>/result-<rank>.json``."""

from __future__ import annotations

import gc
import hashlib
import json
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
from sentinel_support import HostSyncs, facts, hold_facts, regression_batch
from torch import nn

from nanrunbook.capture.torch import Sentinel, SentinelHold, Thresholds


@dataclass(frozen=True)
class ShardedCase:
    """``scenario``: ``nan-rank1`` (a NaN in rank 1's batch at ``fault_step``),
    ``nan-update`` (a NaN written into rank 1's shard inside ``optimizer.step()``
    at ``fault_step``), ``blowup`` (the learning rate x3000 from step 5),
    ``healthy``; ``snapshot``: the sentinel's pre-step snapshot.
    ``micro``: micro-batches a step (all but the last without gradient sync);
    ``bf16``: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32);
    ``clip``: the loop clips through the sentinel at this max norm;
    ``torchrun``: each rank's LOCAL_RANK set as torchrun sets it (the
    environment item then names it, as a replay under torchrun does)."""

    run_id: str
    scenario: str = "healthy"
    steps: int = 6
    fault_step: int = 3
    micro: int = 1
    bf16: bool = False
    clip: float | None = None
    snapshot: bool = False
    torchrun: bool = False


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(t: Any) -> str:
    local = _local(t).detach().contiguous()
    data = local.view(torch.uint8).numpy().tobytes() if local.numel() else b""
    return f"{local.dtype}{list(local.shape)}:" + hashlib.sha256(data).hexdigest()


def local_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Every bit of this rank's shards: parameters and buffers (with the identity
    of each parameter object) and optimizer state and hyperparameters."""
    state: dict[str, Any] = {n: _digest(p) for n, p in model.named_parameters()}
    state.update({f"id/{n}": id(p) for n, p in model.named_parameters()})
    state.update({f"buffer/{n}": _digest(b) for n, b in model.named_buffers()})
    for index, saved in enumerate(optimizer.state.values()):
        for key, value in saved.items():
            state[f"opt/{index}/{key}"] = (
                _digest(value) if isinstance(value, torch.Tensor) else repr(value)
            )
    state["groups"] = repr(
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    )
    return state


def _model(world: int, case: ShardedCase) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if case.bf16
        else MixedPrecisionPolicy()
    )
    torch.manual_seed(0)  # the same initial model on every rank
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    return net


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]).squeeze(1).float() - batch["y"]) ** 2).mean()


def _batch(rank: int, step: int, micro: int, case: ShardedCase) -> dict[str, torch.Tensor]:
    batch = regression_batch(1000 * rank + 10 * step + micro)
    if case.scenario == "nan-rank1" and rank == 1 and step == case.fault_step and micro == 0:
        batch["x"][2, 5] = float("nan")
    return batch


def _run(
    rank: int, world: int, tmp: Path, case: ShardedCase, watched: bool
) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The loop, with or without the sentinel; returns the result and the local
    state before each step."""
    model = _model(world, case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    jump = 3000.0 if case.scenario == "blowup" else 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 4 else jump)
    if case.scenario == "nan-update" and rank == 1:
        updates = [0]  # the real optimizer's steps (a replay's copy has no hook)

        def corrupt(opt: Any, args: Any, kwargs: Any) -> None:
            updates[0] += 1
            if updates[0] == case.fault_step:
                with torch.no_grad():
                    _local(opt.param_groups[0]["params"][0])[0, 0] = float("nan")

        optimizer.register_step_post_hook(corrupt)
    sentinel = (
        Sentinel(
            model,
            optimizer,
            _loss,
            scheduler=scheduler,
            snapshot=case.snapshot,
            thresholds=Thresholds(sample_every=0),
            **facts(case.run_id, tmp),
        )
        if watched
        else None
    )
    forward = sentinel.forward if sentinel is not None else (lambda b, m=model: _loss(m, b))
    before: dict[int, dict[str, Any]] = {}
    hold: SentinelHold | None = None
    norm_type = ""
    steps = 0
    syncs = HostSyncs((optimizer,))
    for i in range(1, case.steps + 1):
        before[i] = local_state(model, optimizer)
        steps = i
        # From the second step on (the first warms up): host reads, as the tests count them.
        counting: AbstractContextManager[Any] = (
            syncs if i > 1 and case.scenario == "healthy" else nullcontext()
        )
        try:
            with counting:
                optimizer.zero_grad()
                for m in range(case.micro):
                    model.set_requires_gradient_sync(m == case.micro - 1)  # type: ignore[operator]
                    loss = forward(_batch(rank, i, m, case)) / case.micro
                    loss.backward()
                if case.clip is not None:
                    clip = (
                        sentinel.clip_grad_norm_
                        if sentinel is not None
                        else torch.nn.utils.clip_grad_norm_
                    )
                    norm_type = type(clip(model.parameters(), case.clip)).__name__
                optimizer.step()
                scheduler.step()
        except SentinelHold as held:
            hold = held
            break
    if sentinel is not None:
        sentinel.close()
    after = local_state(model, optimizer)
    result = {
        "host_syncs": dict(syncs.kinds),
        "steps": steps,
        **hold_facts(hold),
        "capture_error": hold.capture_error if hold else None,
        "capsule": str(hold.capsule) if hold and hold.capsule else None,
        "capsule_error": hold.capsule_error if hold else None,
        # The state before the held step (an update is found at the next step).
        "untouched": bool(hold) and after == before[hold.step if hold else steps],
        "changed": sorted(
            k for k in after if after[k] != before[hold.step if hold else steps].get(k)
        ),
        "finite": all(bool(torch.isfinite(_local(p)).all()) for p in model.parameters()),
        "state": {k: v for k, v in after.items() if not k.startswith("id/")},
        "norm_type": norm_type,
    }
    # Drop every reference to the sharded model before the group goes (gloo's
    # pending work would abort the process at exit).
    del sentinel, model, optimizer, scheduler, forward, hold
    gc.collect()
    return result, before


def _scaler_refusal(world: int, tmp: Path, case: ShardedCase) -> str | None:
    """The sentinel's error for a GradScaler under FSDP2 (None: accepted)."""
    model = _model(world, case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        sentinel = Sentinel(
            model,
            optimizer,
            _loss,
            scaler=torch.amp.GradScaler("cpu"),
            **facts(f"{case.run_id}-scaler", tmp),
        )
    except ValueError as error:
        return str(error)
    sentinel.close()
    return None


def sharded_worker(rank: int, world: int, tmp: str, case: ShardedCase) -> None:
    """One rank of ``case``: with the sentinel, and for ``healthy`` the same loop
    without it first (its final local state is ``plain_state``)."""
    import os

    import torch.distributed as dist

    if case.torchrun:
        os.environ["LOCAL_RANK"] = str(rank)
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        plain = None
        refused = None
        if case.scenario == "healthy":
            plain, _ = _run(rank, world, Path(tmp), case, watched=False)
            refused = _scaler_refusal(world, Path(tmp), case)
        result, _ = _run(rank, world, Path(tmp), case, watched=True)
        result["plain_state"] = plain["state"] if plain is not None else None
        result["plain_syncs"] = plain["host_syncs"] if plain is not None else None
        result["scaler_refused"] = refused
        gc.collect()
    finally:
        dist.destroy_process_group()
    (Path(tmp) / f"result-{rank}.json").write_text(json.dumps(result))


def _noisy_step(
    forward: Any, optimizer: Any, scheduler: Any, rank: int, step: int, case: ShardedCase
) -> None:
    """One step whose batch draws from torch's generator (so the random states a
    point restores decide the step); ``forward`` takes the batch, gives the loss."""
    batch = _batch(rank, step, 0, case)
    batch["x"] = batch["x"] + 0.01 * torch.randn_like(batch["x"])
    optimizer.zero_grad()
    forward(batch).backward()
    optimizer.step()
    scheduler.step()


def _failed_saves(
    root: Path, sentinel: Sentinel, cursor: dict[str, int], rank: int, case: ShardedCase
) -> dict[str, str | None]:
    """What each rank raised saving over the point, and saving with rank 1's data
    position not one (an object)."""
    from nanrunbook.capture.torch import save_recovery_point

    found: dict[str, str | None] = {}
    for name in ("exists", "bad_data"):
        try:
            if name == "exists":
                sentinel.save_recovery_point(root / "point", data=cursor)
            else:
                save_recovery_point(
                    root / "bad",
                    model=sentinel.model,
                    optimizer=sentinel.optimizer,
                    step=3,
                    run_id=case.run_id,
                    data=object() if rank == 1 else cursor,
                )
            found[name] = None
        except (OSError, TypeError, RuntimeError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _without_ids(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if not k.startswith("id/")}


def _ddp_point(root: Path, rank: int, case: ShardedCase) -> dict[str, Any]:
    """The same under DDP (replicas: DCP writes each tensor once): saved after
    two steps, one more step, then a fresh DDP model resumes and takes it."""
    from torch.nn.parallel import DistributedDataParallel

    from nanrunbook.capture.torch import load_recovery_point, save_recovery_point

    def build() -> tuple[nn.Module, Any, Any]:
        torch.manual_seed(0)
        net = DistributedDataParallel(nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1)))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        return net, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)

    net, optimizer, scheduler = build()
    torch.manual_seed(200 + rank)
    for step in (1, 2):
        _noisy_step(partial(_loss, net), optimizer, scheduler, rank, step, case)
    path = root / "ddp-point"
    cursor = {"rank": rank}
    save_recovery_point(
        path, model=net, optimizer=optimizer, scheduler=scheduler, data=cursor, step=2,
        run_id=case.run_id,
    )  # fmt: skip
    _noisy_step(partial(_loss, net), optimizer, scheduler, rank, 3, case)
    uninterrupted = local_state(net, optimizer)
    net, optimizer, scheduler = build()
    loaded = load_recovery_point(
        path, model=net, optimizer=optimizer, scheduler=scheduler, check_digests=True
    )
    _noisy_step(partial(_loss, net), optimizer, scheduler, rank, 3, case)
    return {
        "ddp_exactly": loaded.restored_exactly,
        "ddp_cursor": dict(loaded.cursor or {}),
        "ddp_same": _without_ids(local_state(net, optimizer)) == _without_ids(uninterrupted),
    }


def recovery_worker(rank: int, world: int, tmp: str, case: ShardedCase) -> None:
    """A sharded recovery point: two steps under the sentinel, every rank saves
    one point (``<tmp>/point``), the run goes on one step (the uninterrupted
    state); saving over it, and a rank whose data position is not one, fail on
    every rank; a fresh model and optimizer load the point and take the same
    step (the resumed state)."""
    import torch.distributed as dist

    from nanrunbook.capture.torch import load_recovery_point

    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    root = Path(tmp)
    result: dict[str, Any] = {}
    try:
        model = _model(world, case)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        torch.manual_seed(100 + rank)  # each rank's own random stream
        sentinel = Sentinel(
            model, optimizer, _loss, scheduler=scheduler, thresholds=Thresholds(sample_every=0),
            **facts(case.run_id, root),
        )  # fmt: skip
        for step in (1, 2):
            _noisy_step(sentinel.forward, optimizer, scheduler, rank, step, case)
        cursor = {"rank": rank, "batches": 2}
        point = sentinel.save_recovery_point(root / "point", data=cursor)
        result["last_known_good"] = sentinel.last_known_good["checkpoint_id"]
        _noisy_step(sentinel.forward, optimizer, scheduler, rank, 3, case)
        result["uninterrupted"] = local_state(model, optimizer)
        result["lr"] = scheduler.get_last_lr()
        result.update(_failed_saves(root, sentinel, cursor, rank, case))
        sentinel.close()
        del sentinel, model, optimizer, scheduler
        gc.collect()
        fresh = _model(world, case)
        fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.01, momentum=0.9)
        fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
        torch.manual_seed(7)  # drawn over by the point's random states
        loaded = load_recovery_point(
            point.path,
            model=fresh,
            optimizer=fresh_optimizer,
            scheduler=fresh_scheduler,
            check_digests=True,
        )
        result["restored_exactly"] = loaded.restored_exactly
        result["cursor"] = dict(loaded.cursor or {})
        _noisy_step(partial(_loss, fresh), fresh_optimizer, fresh_scheduler, rank, 3, case)
        result["resumed"] = local_state(fresh, fresh_optimizer)
        result["resumed_lr"] = fresh_scheduler.get_last_lr()
        del fresh, fresh_optimizer, fresh_scheduler, loaded
        gc.collect()
        result.update(_ddp_point(root, rank, case))
        gc.collect()
    finally:
        dist.destroy_process_group()
    for state in ("uninterrupted", "resumed"):
        result[state] = _without_ids(result[state])
    (root / f"result-{rank}.json").write_text(json.dumps(result))


def replay_build() -> dict[str, Any]:
    """The ``--entry`` of ``nanrunbook replay`` under torchrun: the objects of
    ``_run`` for the nan-rank1 case, built on this job's world size (the
    process group the replay started)."""
    import torch.distributed as dist

    case = ShardedCase("replayed", scenario="nan-rank1")
    model = _model(dist.get_world_size(), case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return {"model": model, "optimizer": optimizer, "compute_loss": _loss, "scheduler": scheduler}


def replay_build_failing_on_rank_1() -> dict[str, Any]:
    """:func:`replay_build` on rank 0; rank 1's entry raises (after rank 0's
    has built its FSDP2 model), so that rank 0 must learn it from rank 1."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("no data on this node")
    return replay_build()

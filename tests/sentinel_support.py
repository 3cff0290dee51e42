"""Real training loops for the sentinel's tests: small models, real arithmetic, a
handful of steps each. A loop runs a step function until the sentinel holds,
keeping every bit of the real state before each step to compare with after."""

from __future__ import annotations

import glob
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanrunbook import check_bundle
from nanrunbook.capture.torch import Sentinel, SentinelHold, Thresholds, probe, tensor_to_raw
from nanrunbook.contract import STAGE_ORDER

PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]


def facts(run_id: str, tmp: Path | None, **more: Any) -> dict[str, Any]:
    """The loop's own statement, and where the sentinel writes: ``tmp``'s
    incident/ (None: where a framework's adapter puts it)."""
    stated: dict[str, Any] = {
        "run_id": run_id,
        "checkpoint": {"id": "init-seed-0", "verified_together": PARTS},
        "data": {"id": "synthetic"},
        "objective": {"id": "objective", "reduction": "mean"},
    }
    if tmp is not None:
        stated["incident_dir"] = tmp / "incident"
    return {**stated, **more}


def bits(tensor: Any) -> tuple[str, tuple[int, ...], bytes]:
    raw = tensor_to_raw(tensor)
    return raw.dtype, raw.shape, raw.data


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return bits(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return repr(value)


def state_bits(
    model: nn.Module, optimizer: Any, scheduler: Any = None, scaler: Any = None, same: bool = True
) -> Any:
    """Every bit of the real state a step could change: parameters and buffers
    (and, with ``same``, that they are the same tensor objects), optimizer state
    and hyperparameters, scheduler and scaler state."""
    ident = id if same else (lambda value: None)
    state: dict[str, Any] = {
        name: (ident(value), bits(value))
        for name, value in model.state_dict(keep_vars=True).items()
    }
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state["params"] = [(ident(p), bits(p)) for p in params]
    state["optimizer"] = _plain(optimizer.state_dict())
    if scheduler is not None:
        state["scheduler"] = _plain(scheduler.state_dict())
    if scaler is not None:
        state["scaler"] = _plain(scaler.state_dict())
        state["scaler/_scale"] = None if scaler._scale is None else bits(scaler._scale)
        tracker = scaler._growth_tracker
        state["scaler/_growth_tracker"] = None if tracker is None else bits(tracker)
    return state


@dataclass
class Ran:
    """What a loop run under the sentinel ended with."""

    hold: SentinelHold | None
    steps: int  # steps started
    before: dict[int, Any] = field(default_factory=dict)  # step -> state before it
    losses: dict[int, Any] = field(default_factory=dict)  # step -> the loss the loop saw


def run_loop(
    step: Callable[[int], Any],
    steps: int,
    state: Callable[[], Any],
) -> Ran:
    """``step(i)`` runs training step i (1-based) and returns its loss."""
    ran = Ran(None, 0)
    for i in range(1, steps + 1):
        ran.before[i] = state()
        ran.steps = i
        try:
            ran.losses[i] = step(i)
        except SentinelHold as hold:
            ran.hold = hold.with_traceback(None)  # its frames would hold the model
            break
    return ran


def telemetry(tmp: Path, run_id: str) -> list[dict[str, Any]]:
    path = tmp / "incident" / run_id / "telemetry.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_held_evidence(tmp: Path, run_id: str, bundle: Any, step: int, stage: str) -> None:
    """The held step's bundle checks HOLD at ``stage``, and every step up to the
    held one has its telemetry line."""
    report = check_bundle(bundle)
    assert report.decision.decision == "HOLD"
    assert report.decision.earliest_nonfinite_stage == stage
    lines = telemetry(tmp, run_id)
    assert [line["step"] for line in lines] == list(range(1, step + 1))
    assert [line["held"] for line in lines] == [False] * (step - 1) + [True]


def bundles(tmp: Path, run_id: str) -> list[Path]:
    root = tmp / "incident" / run_id
    if not root.exists():
        return []
    # A held step's capsule (its bundle's capsule/ directory) has a manifest too.
    return sorted(p.parent for p in root.rglob("manifest.json") if p.parent.name != "capsule")


def params_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ------------------------------------------------------------------ models


class Regressor(nn.Module):
    """A small MLP with dropout and batch norm: replays must repeat both."""

    def __init__(self, features: int = 8, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Dropout(0.1)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(1)


class Classifier(nn.Module):
    def __init__(self, features: int = 16, width: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Pooler(nn.Module):
    """Token embeddings, a masked mean pooled by functional code between leaf
    modules (no module boundary shows it), a head."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(tokens)))
        weights = mask.unsqueeze(-1)
        pooled = probe("pool.mean", (h * weights).sum(1) / weights.sum(1))  # 0/0 on an empty row
        return self.head(pooled)


def regression_batch(step: int, size: int = 16, features: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, features, generator=g)
    return {"x": x, "y": x.sum(1) + 0.1 * torch.randn(size, generator=g)}


def mse(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def mse_column(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``mse`` for a model whose output is one column (an ``nn.Linear(n, 1)``)."""
    return ((model(batch["x"]).squeeze(1) - batch["y"]) ** 2).mean()


def drifting_batch(step: int, drift_from: int) -> dict[str, torch.Tensor]:
    """Feature 3 drifts into raw units (x1.4 a step) from ``drift_from`` on: finite
    in float32, eventually beyond float16 under autocast."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(32, 16, generator=g)
    y = (x @ torch.linspace(-1, 1, 64).reshape(16, 4)).argmax(1)
    if step > drift_from:
        x[:, 3] = x[:, 3].abs() * 100 * 1.4 ** (step - drift_from)
    return {"x": x, "y": y}


def xent(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def fp16_scaled_step(
    sentinel: Sentinel, model: nn.Module, optimizer: Any, scaler: Any, batch: Callable[[], Any]
) -> torch.Tensor:
    """One float16-autocast step under a dynamic GradScaler: the batch made and
    the forward run under autocast (its labels come from a float16 matmul), the
    scaled backward, the unscaled gradients clipped to norm 5, the scaler's
    step and update."""
    with torch.autocast("cpu", dtype=torch.float16):
        loss = sentinel.forward(batch())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    sentinel.clip_grad_norm_(model.parameters(), 5.0)
    scaler.step(optimizer)
    scaler.update()
    return loss


def quiet_thresholds(**changes: Any) -> Thresholds:
    return Thresholds(**{"sample_every": 5, **changes})


__all__ = [
    "PARTS",
    "Classifier",
    "HostSyncs",
    "Pooler",
    "Ran",
    "Regressor",
    "Sentinel",
    "bits",
    "bundles",
    "drifting_batch",
    "facts",
    "mse",
    "params_finite",
    "quiet_thresholds",
    "regression_batch",
    "run_loop",
    "state_bits",
    "telemetry",
    "xent",
]


# ------------------------------------------------------------ several ranks


def backend_threads() -> list[str]:
    """The names of this process's threads that belong to a c10d backend (gloo's
    transport loop and its ``pt_gloo_runloop`` workers)."""
    names = (Path(p).read_text().strip() for p in glob.glob("/proc/self/task/*/comm"))
    return sorted(n for n in names if "gloo" in n)


def end_process_group() -> None:
    """destroy_process_group(), then fail unless the group's threads ended with
    it: a group that something still holds (the sentinel, or torch's own module
    defaults) is torn down at interpreter shutdown instead, where its threads can
    abort the process (SIGABRT), which torchrun and Slurm report as a crash."""
    import torch.distributed as dist

    dist.destroy_process_group()
    left = backend_threads()
    if left:
        raise AssertionError(f"threads outlived destroy_process_group(): {left}")


def rank_worker(rank: int, world: int, tmp: str, scenario: str) -> None:
    """One rank of a data-parallel job (gloo, CPU) under the sentinel; writes what
    it ended with to ``<tmp>/result-<rank>.json``."""
    import torch.distributed as dist

    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        result = _rank_loop(rank, Path(tmp), scenario)
    except BaseException:
        dist.destroy_process_group()  # the loop's own error is the one to see
        raise
    end_process_group()
    (Path(tmp) / f"result-{rank}.json").write_text(json.dumps(result))


def _rank_loop(rank: int, tmp: Path, scenario: str) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial model on every rank
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    model = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    jump = 3000.0 if scenario == "blowup" else 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 5 else jump)

    sentinel = Sentinel(
        model,
        optimizer,
        mse_column,
        scheduler=scheduler,
        thresholds=Thresholds(sample_every=0),
        **facts(scenario, tmp),
    )
    ran = Ran(None, 0)
    for i in range(1, 13 if scenario == "healthy" else 40):
        ran.before[i] = state_bits(net, optimizer, scheduler)
        ran.steps = i
        batch = regression_batch(100 * rank + i)
        if scenario == "nan-rank1" and rank == 1 and i == 3:
            batch["x"][2, 5] = float("nan")
        try:
            optimizer.zero_grad()
            loss = sentinel.forward(batch)
            loss.backward()
            optimizer.step()
            scheduler.step()
        except SentinelHold as hold:
            ran.hold = hold.with_traceback(None)  # its frames would hold the model
            break
    sentinel.close()
    hold = ran.hold
    return {
        "steps": ran.steps,
        "held": hold.step if hold else None,
        "bundle": str(hold.bundle) if hold and hold.bundle else None,
        "stage": hold.stage if hold else None,
        "reason": hold.reason if hold else None,
        "origin": list(hold.origin_ranks) if hold and hold.origin_ranks is not None else None,
        "reproduced": hold.reproduced.line() if hold and hold.reproduced else None,
        "capsule": str(hold.capsule) if hold and hold.capsule else None,
        "finite": params_finite(net),
        "untouched": bool(hold) and state_bits(net, optimizer, scheduler) == ran.before[ran.steps],
        "changed": _changed(state_bits(net, optimizer, scheduler), ran.before[ran.steps]),
    }


def _changed(after: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """The state entries that differ (for a failing assertion's message)."""
    return sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))


# ------------------------------------------------------------ host syncs


class HostSyncs:
    """Counts, by kind, every operation that would make the host wait for a
    device value on an accelerator, though on CPU nothing waits: a scalar
    read (``.item()``, ``bool()``, ``float()``: ``_local_scalar_dense``),
    ``.tolist()`` and ``.numpy()``, a copy to the host (``.cpu()``,
    ``.to("cpu")``, and any copy from an accelerator's memory into the
    host's), an output whose size depends on the values (``nonzero``,
    ``masked_select``, boolean-mask indexing, ``unique``,
    ``repeat_interleave`` without ``output_size``) and ``torch.equal``.

    Python-level calls (tolist, numpy, cpu, to) are seen by a
    ``TorchFunctionMode`` (on CPU they reach no kernel), the rest by a
    ``TorchDispatchMode`` at the aten op. An optimizer's ``state["step"]``
    tensors are left out: torch keeps them on the host unless ``capturable``,
    so reading them (AdamW does, per parameter and step) never waits."""

    def __init__(self, optimizers: tuple[Any, ...] | list[Any] = ()) -> None:
        from collections import Counter

        self.kinds: Counter[str] = Counter()
        self._optimizers = list(optimizers)
        self._modes: list[Any] = []
        self.inside = False  # within a read counted at the Python call

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    def __enter__(self) -> HostSyncs:
        self._modes = [_FunctionSide(self), _DispatchSide(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def _host_resident(self, tensor: Any) -> bool:
        """An optimizer's CPU step counter (by storage: the dispatcher may hand
        over another Python object for the same tensor)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return False
        where = tensor.untyped_storage().data_ptr()
        for optimizer in self._optimizers:
            for state in optimizer.state.values():
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, torch.Tensor) and step.untyped_storage().data_ptr() == where:
                    return True
        return False

    def saw(self, kind: str, tensor: Any) -> None:
        if not self.inside and not self._host_resident(tensor):
            self.kinds[kind] += 1


def _to_host(args: Any, kwargs: Any) -> bool:
    """Whether a ``Tensor.to`` call names the host by name (``"cpu"``). A
    ``torch.device`` is not counted: code passes one it took from another
    tensor (``t.to(flags[0].device)``), which is the accelerator on one and
    the host only here, where everything is; a real copy off an accelerator
    is counted at the aten op."""
    targets = [*args[1:], kwargs.get("device")]
    return any(isinstance(t, str) and torch.device(t).type == "cpu" for t in targets)


class _FunctionSide(torch.overrides.TorchFunctionMode):
    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = {
            torch.Tensor.tolist: "tolist",
            torch.Tensor.numpy: "numpy",
            torch.Tensor.cpu: "to_host",
        }.get(func)
        if kind is None and func is torch.Tensor.to and _to_host(args, kwargs):
            kind = "to_host"
        if kind is None:
            return func(*args, **kwargs)
        self.counter.saw(kind, args[0] if args else None)
        self.counter.inside = True  # the copy it makes is this read, not another
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside = False


_DATA_DEPENDENT = {
    "_local_scalar_dense": "item",
    "nonzero": "nonzero",
    "masked_select": "masked_select",
    "equal": "equal",
    "_unique": "unique",
    "_unique2": "unique",
    "unique_dim": "unique",
    "unique_consecutive": "unique",
}


def _boolean_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


class _DispatchSide(TorchDispatchMode):
    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        first = args[0] if args else None
        if name in _DATA_DEPENDENT:
            self.counter.saw(_DATA_DEPENDENT[name], first)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _boolean_index(
            args
        ):
            self.counter.saw("boolean_index", first)
        elif name == "repeat_interleave" and isinstance(first, torch.Tensor):
            if kwargs.get("output_size") is None:
                self.counter.saw("repeat_interleave", first)
        elif name in ("_to_copy", "copy_", "_copy_from") and _device_to_host(name, args, kwargs):
            self.counter.saw("to_host", first)
        return func(*args, **kwargs)


def _device_to_host(name: str, args: Any, kwargs: Any) -> bool:
    """A copy from an accelerator into host memory (seen only off CPU)."""
    if name == "_to_copy":
        source, device = args[0], kwargs.get("device")
        return source.device.type != "cpu" and device is not None and device.type == "cpu"
    if name == "copy_":
        dest, source = args[0], args[1]
    else:
        source, dest = args[0], args[1]
    return (
        isinstance(source, torch.Tensor)
        and isinstance(dest, torch.Tensor)
        and source.device.type != "cpu"
        and dest.device.type == "cpu"
    )


@dataclass(frozen=True)
class RankCase:
    """A data-parallel job under the sentinel, and what goes wrong on which rank.

    ``fault``: ``nan-data`` (a NaN in the batch), ``nan-update`` (a NaN written
    into a parameter inside ``optimizer.step()``: a silent corruption of one
    replica), ``check-fails`` (the per-step checks raise), all at ``fault_step``
    on the ``fault_ranks``, whose captures also take ``slow`` seconds longer. ``groups``: DDP over data-parallel
    groups of 2 (``{0,1}, {2,3}``); ``vote_in_group``: the sentinel votes in that
    group too (else over the world). ``checkpoint``: the loop calls
    ``checkpointed()`` after every step."""

    run_id: str
    steps: int = 8
    fault: str = "nan-data"
    fault_ranks: tuple[int, ...] = (1,)
    fault_step: int = 3
    policy: str = "hold"
    snapshot: bool = False
    checkpoint: bool = False
    groups: bool = False
    vote_in_group: bool = False
    timeout: float = 60.0
    slow: float = 0.0


class InjectedCheckFailure(RuntimeError):
    """The per-step checks of one rank fail (as an out-of-memory would)."""


def case_worker(rank: int, world: int, tmp: str, case: RankCase) -> None:
    """One rank of ``case``; writes what it ended with to ``<tmp>/result-<rank>.json``."""
    import torch.distributed as dist

    store = dist.FileStore(str(Path(tmp) / "store"), world)
    timeout = timedelta(seconds=case.timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = _case_loop(rank, world, Path(tmp), case)
    except BaseException:
        dist.destroy_process_group()  # the loop's own error is the one to see
        raise
    end_process_group()
    (Path(tmp) / f"result-{rank}.json").write_text(json.dumps(result))


def jobs_worker(
    rank: int, world: int, tmp: str, jobs: tuple[tuple[str, str | RankCase], ...]
) -> None:
    """One rank of several jobs in turn, job ``name`` in ``<tmp>/<name>/`` with a
    process group of its own, as :func:`rank_worker` (a scenario) or
    :func:`case_worker` (a :class:`RankCase`) alone would run it: one spawn and
    one torch import for them all."""
    for name, job in jobs:
        where = Path(tmp) / name
        where.mkdir(exist_ok=True)
        if isinstance(job, RankCase):
            case_worker(rank, world, str(where), job)
        else:
            rank_worker(rank, world, str(where), job)


def hold_facts(hold: SentinelHold | None) -> dict[str, Any]:
    """What a rank's worker reports of the hold it met (each None without one)."""
    return {
        "held": hold.step if hold else None,
        "bundle": str(hold.bundle) if hold and hold.bundle else None,
        "reason": hold.reason if hold else None,
        "origin": list(hold.origin_ranks) if hold and hold.origin_ranks is not None else None,
    }


def _digest(net: nn.Module) -> list[Any]:
    return [list(p.detach().reshape(-1).tolist()) for p in net.parameters()]


def _case_loop(rank: int, world: int, tmp: Path, case: RankCase) -> dict[str, Any]:
    import torch.distributed as dist

    import nanrunbook.capture.torch.sentinel._decide as decide

    group = None
    if case.groups:  # every rank creates every group, in the same order
        made = [dist.new_group(list(r)) for r in ((0, 1), (2, 3))]
        group = made[rank // 2]
    faulty = rank in case.fault_ranks

    def batch(i: int) -> dict[str, torch.Tensor]:
        b = regression_batch(100 * rank + i)
        if case.fault == "nan-data" and faulty and i == case.fault_step:
            b["x"][2, 5] = float("nan")
        return b

    # The same job without the sentinel, for the parameters it must end with.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    plain_ddp = nn.parallel.DistributedDataParallel(plain, process_group=group)
    plain_opt = torch.optim.SGD(plain_ddp.parameters(), lr=0.05)
    for i in range(1, case.fault_step):
        plain_opt.zero_grad()
        mse_column(plain_ddp, batch(i)).backward()
        plain_opt.step()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model = nn.parallel.DistributedDataParallel(net, process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # undone at the end: a hook that holds its optimizer is a cycle, and a patched
    # module function that holds the sentinel would keep the model to process exit
    undo: list[Callable[[], Any]] = []
    if case.fault == "nan-update" and faulty:

        def corrupt(opt: Any, args: Any, kwargs: Any) -> None:
            if opt is optimizer and sentinel.last_step == case.fault_step:  # not a replay's copy
                with torch.no_grad():
                    net[0].weight[0, 0] = float("nan")

        undo.append(optimizer.register_step_post_hook(corrupt).remove)
    if case.fault == "check-fails" and faulty:
        real_gradients = decide.gradients

        def failing(params: Any) -> Any:
            if sentinel.last_step == case.fault_step:
                raise InjectedCheckFailure("out of memory in the per-step checks (injected)")
            return real_gradients(params)

        decide.gradients = failing  # type: ignore[assignment]
        undo.append(lambda: setattr(decide, "gradients", real_gradients))
    if case.slow > 0 and faulty:
        real_capture = decide.capture_step

        def slow_capture(*args: Any, **kwargs: Any) -> Any:
            time.sleep(case.slow)
            return real_capture(*args, **kwargs)

        decide.capture_step = slow_capture  # type: ignore[assignment]
        undo.append(lambda: setattr(decide, "capture_step", real_capture))

    sentinel = Sentinel(
        model,
        optimizer,
        mse_column,
        policy=case.policy,  # type: ignore[arg-type]
        snapshot=case.snapshot,
        thresholds=Thresholds(sample_every=0),
        process_group=group if case.vote_in_group else None,
        **facts(case.run_id, tmp),
    )
    hold: SentinelHold | None = None
    error: str | None = None
    before_fault: list[Any] = []
    steps = 0
    for i in range(1, case.steps + 1):
        steps = i
        if i == case.fault_step:
            before_fault = _digest(net)
        try:
            optimizer.zero_grad()
            loss = sentinel.forward(batch(i))
            loss.backward()
            optimizer.step()
            if case.checkpoint:
                sentinel.checkpointed(f"ckpt-{i}", verified_together=PARTS)
        except SentinelHold as held:
            hold = held.with_traceback(None)  # its frames would hold the model
            break
        except InjectedCheckFailure as failure:
            error = str(failure)
            break
    try:
        sentinel.close()
    except SentinelHold as held:  # the last update, checked at close
        hold = held.with_traceback(None)
    for step in undo:
        step()
    return {
        "steps": steps,
        **hold_facts(hold),
        "contaminated": hold.contaminated if hold else None,
        "error": error,
        "before_fault": before_fault,
        "plain_before_fault": _digest(plain),
        "params": _digest(net),
        "finite": params_finite(net),
    }


def set_verdict(incident: Path) -> tuple[list[int], str | None, dict[int, str]]:
    """Spec section 11 from the members: origin ranks, earliest stage, decisions."""
    decisions, stages = {}, {}
    for member in sorted(incident.iterdir()):
        report = check_bundle(member)
        rank = report.manifest.binding.rank
        assert member.name == f"rank-{rank:05d}"
        decisions[rank] = report.decision.decision
        if report.decision.decision == "HOLD":
            stages[rank] = report.decision.earliest_nonfinite_stage
    if not stages:
        return [], None, decisions
    earliest = min(stages.values(), key=STAGE_ORDER.index)
    return sorted(r for r, s in stages.items() if s == earliest), earliest, decisions


def assert_rank1_data_held(
    tmp: Path, run_id: str, step: int, results: list[dict[str, Any]]
) -> None:
    """A 2-rank DDP job whose rank 1 read a NaN: both held at ``step``, rank 1 the
    origin at input, rank 0's own gradients finite before the all-reduce (the
    sentinel watches the DDP module), a telemetry line per step on each rank."""
    assert all(r["origin"] == [1] for r in results)
    assert results[1]["reason"].startswith("non-finite loss")
    assert "own gradients were finite before the all-reduce" in results[0]["reason"]
    origin, stage, decisions = set_verdict(tmp / "incident" / run_id / str(step))
    assert (origin, stage) == ([1], "input")
    assert decisions[1] == "HOLD"
    for rank in (0, 1):
        lines = (tmp / "incident" / run_id / f"telemetry-rank-{rank:05d}.jsonl").read_text()
        assert [json.loads(line)["step"] for line in lines.splitlines()] == list(range(1, step + 1))

"""A replay of one training step on copies, capturing its five boundaries.

:class:`StepRecipe` says how the step ran: its micro-batches (each with the RNG
state taken before its forward and the autocast regions around it), the loss
scaling (none, static, or a dynamic GradScaler), gradient clipping and which
gradients to capture. :func:`replay` runs it on deep copies of the model, the
optimizer and the scaler, so the real run's state is untouched ("reproduce
without an update"), and records the stages into a
:class:`~nanrunbook.capture.BundleWriter`. :func:`replay_step` is the
one-micro-batch form for hand-written capture; the sentinel builds recipes of
the steps it holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from nanrunbook.capture.torch._convert import tensor_to_raw
from nanrunbook.capture.torch._copies import (
    clone_batch,
    copy_optimizer,
    copy_scaler,
    eager_module,
    flatten,
)
from nanrunbook.capture.torch._faithfulness import (
    HostRandom,
    determinism_facts,
    device_facts,
    inexact_kernels,
    kept,
)
from nanrunbook.capture.torch._offload import ReplayMemory, Room, room_for_replay
from nanrunbook.capture.torch.replay._binding import (
    batch_binding,
    cuda_devices,
    environment_binding,
    model_binding,
    optimizer_binding,
    precision_binding,
    random_state_binding,
    topology_binding,
)
from nanrunbook.capture.torch.replay._recording import ForwardCapture, leaf
from nanrunbook.capture.writer import BundleWriter
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.manifest.parse import BINDING_ITEMS

__all__ = [
    "REQUIRED_BINDING",
    "Autocast",
    "Clipping",
    "MicroBatch",
    "Replayed",
    "RngState",
    "Scaling",
    "StepRecipe",
    "replay_recipe",
    "replay_step",
]

Choose = Callable[[str, Any], bool]


@dataclass(frozen=True)
class RngState:
    """The global CPU generator's state and each initialised CUDA device's, and
    numpy's, Python's and the loop's own generators' (``host``)."""

    cpu: Any
    cuda: tuple[Any, ...] = ()
    host: HostRandom | None = None

    @classmethod
    def now(
        cls, generators: Sequence[Any] = (), *, taken_live: bool = False, host: bool = True
    ) -> RngState:
        """``host`` false: not numpy's and Python's (numpy's get_state costs about 1 ms)."""
        devices = cuda_devices()
        return cls(
            torch.get_rng_state(),
            tuple(torch.cuda.get_rng_state(d) for d in devices),
            HostRandom.now(generators, taken_live=taken_live, streams=host),
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in enumerate(self.cuda):
            torch.cuda.set_rng_state(state, device)
        if self.host is not None:
            self.host.restore()

    def kept(self) -> AbstractContextManager[None]:
        """Around a replay that restores this state: numpy's, Python's and the
        generators' states put back after (torch's fork puts back torch's)."""
        return kept([g for g, _ in self.host.generators] if self.host is not None else [])


@dataclass(frozen=True)
class Autocast:
    """One enabled autocast region around the forward."""

    device_type: str
    dtype: Any
    cache_enabled: bool = True

    @classmethod
    def now(cls) -> tuple[Autocast, ...]:
        """The autocast regions enabled at this point of the program."""
        cache = torch.is_autocast_cache_enabled()
        return tuple(
            cls(device, torch.get_autocast_dtype(device), cache)
            for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)
        )


@dataclass(frozen=True)
class MicroBatch:
    """One forward of the step: its batch, the RNG state before it (None: a fork
    of the current state) and the autocast regions around it."""

    batch: Any
    rng: RngState | None = None
    autocast: tuple[Autocast, ...] = ()


@dataclass(frozen=True)
class Scaling:
    """How the step scaled its loss: ``none``, ``static`` (``scale``) or
    ``dynamic`` (a GradScaler, copied from ``scaler`` or from ``state``)."""

    mode: Literal["none", "static", "dynamic"] = "none"
    scale: float = 1.0
    scaler: Any = None
    state: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Clipping:
    """``clip_grad_norm_`` as the loop called it, on the real parameters ``params``
    (their ids; the replay clips their copies)."""

    max_norm: float
    norm_type: float = 2.0
    params: tuple[int, ...] = ()
    foreach: bool | None = None


@dataclass(frozen=True)
class StepRecipe:
    compute_loss: Callable[[Any, Any], Any]
    micro_batches: tuple[MicroBatch, ...]
    scaling: Scaling = field(default_factory=Scaling)
    clipping: Clipping | None = None
    gradients: Literal["unscaled", "scaled"] = "unscaled"
    choose: Choose = leaf
    optimizer_factory: Callable[[list[dict[str, Any]]], Any] | None = None
    outside: bool = False  # the optimizer may hold parameters outside the model
    seed: int | None = None  # recorded in the random_state binding
    memory: ReplayMemory = "auto"  # where the replay makes room (see _offload)


@dataclass
class Replayed:
    """What a replay found: the writer with its stages, and the derived bindings."""

    writer: BundleWriter
    scaler: dict[str, Any]
    activation_weights: dict[str, int]
    random_state: dict[str, Any]
    batch: dict[str, Any]
    inexact: list[str] = field(default_factory=list)  # why it may not repeat the live step
    loss_bits: tuple[str, ...] = ()  # each micro-batch loss's stored bytes, hex


# ------------------------------------------------------------------ the copies


@dataclass
class _Copies:
    model: Any
    optimizer: Any
    scaler: Any
    params: list[Any]  # the copy's optimizer parameters, in group order
    names: dict[int, str]  # id of a copied parameter -> its bundle name
    outside: list[tuple[Any, Any]]  # (real, copy) of parameters outside the model
    twins: dict[int, Any]  # id of a real parameter -> its copy
    room: Room
    real_optimizer: Any  # its state is loaded into the copy only for the update


def _make_copies(model: Any, optimizer: Any, recipe: StepRecipe, room: Room) -> _Copies:
    model_copy = copy.deepcopy(model)
    mapping = {id(p): q for p, q in zip(model.parameters(), model_copy.parameters(), strict=True)}
    names = {id(p): name for name, p in model_copy.named_parameters()}
    outside: list[tuple[Any, Any]] = []
    if recipe.outside:
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if id(param) not in mapping:
                    twin = param.detach().clone().requires_grad_(param.requires_grad)
                    mapping[id(param)] = twin
                    names[id(twin)] = f"outside/group{g}.param{i}"
                    outside.append((param, twin))
    # Without its state until the update: the forward's activations and the
    # optimizer state are never on the device at once.
    groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
    optimizer_copy = copy_optimizer(
        optimizer, mapping, recipe.optimizer_factory, {"state": {}, "param_groups": groups}
    )
    optimizer_copy.zero_grad(set_to_none=True)
    scaling = recipe.scaling
    scaler = copy_scaler(scaling.scaler, scaling.state) if scaling.mode == "dynamic" else None
    params = [p for group in optimizer_copy.param_groups for p in group["params"]]
    return _Copies(
        model_copy, optimizer_copy, scaler, params, names, outside, mapping, room, optimizer
    )


@contextmanager
def _outside_gradients(copies: _Copies) -> Iterator[None]:
    """The loss function reaches parameters outside the model directly (a loss
    module's temperature): during the replay their real ``.grad`` is set aside
    and what the replay accumulates is moved to their copies."""
    saved = [real.grad for real, _ in copies.outside]
    for real, _ in copies.outside:
        real.grad = None
    try:
        yield
        for real, twin in copies.outside:
            twin.grad = real.grad
    finally:
        for (real, _), grad in zip(copies.outside, saved, strict=True):
            real.grad = grad


@contextmanager
def _autocast(regions: Sequence[Autocast]) -> Iterator[None]:
    with ExitStack() as stack:
        for region in regions:
            stack.enter_context(
                torch.autocast(
                    region.device_type, dtype=region.dtype, cache_enabled=region.cache_enabled
                )
            )
        yield


# ------------------------------------------------------- forward, loss, backward


@dataclass
class _Forward:
    inputs: list[tuple[str, Any, str]] = field(default_factory=list)
    activations: list[tuple[str, Any, str]] = field(default_factory=list)
    losses: list[tuple[str, Any, str]] = field(default_factory=list)
    weights: dict[str, int] = field(default_factory=dict)
    stopped: str | None = None  # why backward was not run, if it was not
    random_state: dict[str, Any] = field(default_factory=dict)
    inexact: list[str] = field(default_factory=list)  # why the replay may not be the step
    loss_bits: list[str] = field(default_factory=list)  # each loss's stored bytes, hex


def _label(kind: str, index: int, count: int) -> str:
    return f"{kind}/mb{index}" if count > 1 else kind


def _micro_batch(copies: _Copies, recipe: StepRecipe, index: int, forward: _Forward) -> None:
    """One forward (captured) and, unless the loss is unguarded and non-finite, its
    backward, on the RNG state and under the autocast regions it ran with."""
    count = len(recipe.micro_batches)
    micro = recipe.micro_batches[index]
    if micro.rng is not None:
        micro.rng.restore()
    if index == 0:
        host = micro.rng.host if micro.rng is not None else None
        forward.random_state = {
            **random_state_binding(recipe.seed),
            **(host or HostRandom.now()).fields(),
        }
    batch = clone_batch(micro.batch)
    name = _label("batch", index, count)
    # Bytes now: compute_loss may rewrite its batch in place (x.sub_, masked_fill_).
    forward.inputs += [
        (f"{name}/{n}" if n else name, tensor_to_raw(t), f"batch[{n!r}]" if n else "batch")
        for n, t in flatten(batch, "")
    ]
    capture = ForwardCapture(copies.model, recipe.choose, f"mb{index}/" if count > 1 else "")
    with capture.hooked(), _autocast(micro.autocast):
        loss = recipe.compute_loss(copies.model, batch)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"compute_loss returned a {type(loss).__name__}, not a tensor")
    forward.activations += capture.captured
    for dtype, elements in capture.weights.items():
        forward.weights[dtype] = forward.weights.get(dtype, 0) + elements
    forward.losses.append((_label("loss", index, count), loss, "compute_loss(model, batch)"))
    forward.loss_bits.append(tensor_to_raw(loss.detach()).data.hex())
    if forward.stopped is not None:
        return
    if recipe.scaling.mode != "dynamic" and not bool(torch.isfinite(loss.detach()).all()):
        guard = "no GradScaler" if recipe.scaling.mode == "none" else "a static loss scale"
        which = f"micro-batch {index}'s loss" if count > 1 else "the loss"
        forward.stopped = f"{which} is non-finite and {guard} guards the step: backward not run"
        return
    if loss.numel() != 1:
        raise ValueError(f"the loss has {loss.numel()} elements; backward needs a scalar loss")
    if copies.scaler is not None:
        copies.scaler.scale(loss).backward()
    elif recipe.scaling.mode == "static":
        (loss * recipe.scaling.scale).backward()  # type: ignore[no-untyped-call]
    else:
        loss.backward()  # type: ignore[no-untyped-call]


def _forward_stages(
    writer: BundleWriter, copies: _Copies, recipe: StepRecipe, owner: Mapping[str, str]
) -> _Forward:
    forward = _Forward()
    first = recipe.micro_batches[0].rng
    host = first.host if first is not None else None
    with torch.random.fork_rng(devices=cuda_devices()), (first or RngState(None)).kept():
        start = host if host is not None and host.numpy is not None else HostRandom.now()
        with _outside_gradients(copies):
            for index in range(len(recipe.micro_batches)):
                _micro_batch(copies, recipe, index, forward)
        if not start.taken_live and not start.same_as_now():
            forward.inexact.append(
                "the replay drew from numpy's or Python's random, whose state at the"
                " live step is not known"
            )
    if not forward.activations:
        raise ValueError("no chosen module ran in the forward: nothing to capture")
    writer.observe(
        "input",
        forward.inputs,
        owner=owner["input"],
        probe_source="the batch as given, before compute_loss",
    )
    writer.observe(
        "forward",
        forward.activations,
        owner=owner["forward"],
        probe_source="forward hooks on leaf modules and named probes, execution order"
        " (replay on a deep copy)",
    )
    writer.observe(
        "loss",
        forward.losses,
        owner=owner["loss"],
        probe_source="loss returned by compute_loss, before backward",
    )
    for taken in (forward.inputs, forward.activations, forward.losses):
        taken.clear()  # the writer has them: a streaming one spooled them, so let them go
    return forward


def _gradients(copies: _Copies) -> list[tuple[str, Any, str]]:
    # Bytes now: unscaling and clipping rewrite the gradients in place.
    return [
        (f"grad/{copies.names[id(p)]}", tensor_to_raw(p.grad), "param.grad")
        for p in copies.params
        if p.grad is not None
    ]


def _backward_stage(
    writer: BundleWriter, copies: _Copies, recipe: StepRecipe, owner: Mapping[str, str]
) -> bool:
    """Unscale, capture the gradients; returns the dynamic scaler's found_inf."""
    captured = _gradients(copies) if recipe.gradients == "scaled" else []
    found_inf, source = False, "param.grad after loss.backward() on the copy (no loss scaling)"
    if copies.scaler is not None:
        copies.scaler.unscale_(copies.optimizer)
        per_device = copies.scaler._found_inf_per_device(copies.optimizer)
        found_inf = bool(sum(v.item() for v in per_device.values()))
        source = "param.grad after scaler.scale(loss).backward(), before unscale_"
        if recipe.gradients == "unscaled":
            source = "param.grad after scaler.unscale_(optimizer) on the copy"
    elif recipe.scaling.mode == "static":
        grads = [p.grad for p in copies.params if p.grad is not None]
        torch._foreach_div_(grads, recipe.scaling.scale)
        source = "param.grad after (loss * scale).backward() and dividing by the static scale"
    if recipe.gradients == "unscaled":
        captured = _gradients(copies)
    if not captured:
        raise ValueError("no parameter of the optimizer received a gradient")
    writer.observe(
        "backward",
        captured,
        owner=owner["backward"],
        probe_source=source,
        gradients=recipe.gradients,
    )
    return found_inf


# ------------------------------------------------------------------ the update


def _scaler_fields(copies: _Copies, recipe: StepRecipe, scale: float, found_inf: bool) -> Any:
    if copies.scaler is None:
        if recipe.scaling.mode == "static":
            return {"id": "static-loss-scale", "mode": "static", "scale": recipe.scaling.scale}
        return {"id": "no-loss-scaling", "mode": "none", "scale": 1}
    scaler = copies.scaler
    return {
        "id": "torch.amp.GradScaler",
        "mode": "dynamic",
        "scale": scale,
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "found_inf": found_inf,
        "step_skipped": found_inf,  # GradScaler.step skips optimizer.step exactly then
        "scale_after": scaler.get_scale(),
        "growth_interval": scaler.get_growth_interval(),
    }


def _clip(copies: _Copies, clipping: Clipping | None) -> None:
    if clipping is not None:
        chosen = [copies.twins[i] for i in clipping.params if i in copies.twins]
        torch.nn.utils.clip_grad_norm_(
            chosen, clipping.max_norm, clipping.norm_type, foreach=clipping.foreach
        )


def _optimizer_stage(
    writer: BundleWriter,
    copies: _Copies,
    owner: Mapping[str, str],
    found_inf: bool,
) -> None:
    state = copies.room.optimizer_state(copies.real_optimizer)
    copies.optimizer.load_state_dict(
        copy.deepcopy(copies.real_optimizer.state_dict()) if state is None else state
    )
    del state
    before = [copies.room.keep(p) for p in copies.params]
    if copies.scaler is not None:
        copies.scaler.step(copies.optimizer)
        copies.scaler.update()
        if found_inf:
            writer.not_run(
                "optimizer",
                owner=owner["optimizer"],
                reason="GradScaler found inf/NaN after unscale_ and skipped optimizer.step()",
            )
            return
    else:
        copies.optimizer.step()
    tensors: list[tuple[str, Any, str]] = []
    for p in copies.params:
        for key, value in copies.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                name = f"opt/{copies.names[id(p)]}/{key}"
                tensors.append((name, value, f"optimizer.state[p][{key!r}]"))
    for index, p in enumerate(copies.params):
        new, old = p.detach(), before[index].to(p.device)
        before[index] = None  # each update made, taken to host bytes and let go in turn
        if p.is_floating_point() and p.element_size() < 4:
            new, old = new.float(), old.float()
        update = tensor_to_raw(new - old)
        tensors.append((f"update/{copies.names[id(p)]}", update, "param after step() minus before"))
    writer.observe(
        "optimizer",
        tensors,
        owner=owner["optimizer"],
        probe_source="optimizer.step() on the copy: state after, and the update it applied",
    )


def _spool_dir(target: str | Path | None) -> Path | None:
    """Beside ``target`` when its directory exists (else the write refuses it)."""
    parent = Path(target).parent if target is not None else None
    return parent if parent is not None and parent.is_dir() else None


def replay_recipe(
    model: Any,
    optimizer: Any,
    recipe: StepRecipe,
    owner: Mapping[str, str],
    **identity: Any,
) -> Replayed:
    """Run ``recipe`` on copies of ``model``, ``optimizer`` and its scaler; record
    the five stages into a BundleWriter made with ``identity`` (run_id, step,
    incident_owner, last_known_good) and an empty binding."""
    if not recipe.micro_batches:
        raise ValueError("the step has no micro-batch to replay")
    batches = [
        (f"mb{i}/{n}" if len(recipe.micro_batches) > 1 else n, t)
        for i, micro in enumerate(recipe.micro_batches)
        for n, t in flatten(micro.batch, "")
    ]
    batch = batch_binding(batches)  # refuses a batch without tensors before any work
    with room_for_replay(model, optimizer, recipe.memory) as room:
        # The copies live in the call's frame only: gone before the real state
        # takes its room back.
        return _replay_on_copies(model, optimizer, recipe, owner, room, batch, identity)


def _replay_on_copies(
    model: Any,
    optimizer: Any,
    recipe: StepRecipe,
    owner: Mapping[str, str],
    room: Room,
    batch: dict[str, Any],
    identity: Mapping[str, Any],
) -> Replayed:
    copies = _make_copies(model, optimizer, recipe, room)
    writer = BundleWriter(binding={}, **identity)
    scale = copies.scaler.get_scale() if copies.scaler is not None else 1.0
    forward = _forward_stages(writer, copies, recipe, owner)
    found_inf = False
    if forward.stopped is not None:
        writer.not_run(
            "backward", owner=owner["backward"], reason=forward.stopped, gradients=recipe.gradients
        )
        writer.not_run("optimizer", owner=owner["optimizer"], reason=forward.stopped)
    else:
        found_inf = _backward_stage(writer, copies, recipe, owner)
        if not found_inf:
            _clip(copies, recipe.clipping)
        _optimizer_stage(writer, copies, owner, found_inf)
    return Replayed(
        writer=writer,
        scaler=_scaler_fields(copies, recipe, scale, found_inf),
        activation_weights=forward.weights,
        random_state=forward.random_state,
        batch=batch,
        inexact=forward.inexact,
        loss_bits=tuple(forward.loss_bits),
    )


def bind(
    replayed: Replayed,
    model: Any,
    optimizer: Any,
    given: Mapping[str, Mapping[str, Any]],
    derived: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Set the writer's binding: what the replay and the process can derive, then
    ``derived`` (more derived items), then ``given`` (the caller's, which win).
    Returns why the replay may not repeat the live step (also in the
    environment item: ``replay`` and ``replay_inexact``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = params[0].device if params else torch.device("cpu")
    inexact = [*replayed.inexact, *inexact_kernels(device)]
    environment = {
        **environment_binding(),
        **device_facts(device),
        **determinism_facts(),
        "replay": "inexact" if inexact else "exact",
    }
    if inexact:
        environment["replay_inexact"] = "; ".join(inexact)
    items: dict[str, Any] = {
        "model": model_binding(iter(model.state_dict().items()), model),
        "batch": replayed.batch,
        "optimizer": optimizer_binding(optimizer),
        "scaler": replayed.scaler,
        "random_state": replayed.random_state,
        "environment": environment,
        "topology": topology_binding(),
        "precision": precision_binding(params, replayed.activation_weights),
        **{name: dict(fields) for name, fields in (derived or {}).items()},
        **{name: dict(fields) for name, fields in given.items()},
    }
    replayed.writer.binding = {
        **{name: items[name] for name in BINDING_ITEMS if name in items},
        **{name: value for name, value in items.items() if name not in BINDING_ITEMS},
    }
    return inexact


EAGER_REPLAY = (
    "replayed eagerly on a copy of the compiled model's original module (_orig_mod);"
    " the live step ran compiled"
)


COMPILED_LIVE = "the live step ran compiled, the replay eagerly"


def mark_eager(writer: BundleWriter) -> None:
    """Say in each stage the model made that the replay ran eagerly."""
    for stage in STAGE_ORDER[1:]:
        if writer.nonfinite(stage) is not None:
            writer.annotate(stage, EAGER_REPLAY)


# ------------------------------------------------------------- replay_step (API)

REQUIRED_BINDING = ("checkpoint", "data", "loader_cursor", "objective", "scheduler")


def rng_state_for(seed: int | None, rng_state: Any, generators: Sequence[Any] = ()) -> RngState:
    """The RNG state a replay starts from: seeded, the given
    ``torch.get_rng_state()``, or (neither) the current state; numpy's, Python's
    and ``generators``' current states. ValueError for both."""
    if seed is not None and rng_state is not None:
        raise ValueError("give seed or rng_state, not both")
    if seed is None and rng_state is None:
        return RngState.now(generators)  # a fork of the current state
    with torch.random.fork_rng(devices=cuda_devices()):
        if seed is not None:
            torch.manual_seed(seed)
        else:
            torch.set_rng_state(rng_state)
        return RngState.now(generators)


def _refuse_what_cannot_be_true(binding: Mapping[str, Any], gradients: str, scaler: Any) -> bool:
    """Raise for arguments that cannot give a true bundle; True with a dynamic scaler."""
    missing = [name for name in REQUIRED_BINDING if name not in binding]
    if missing:
        raise ValueError(f"binding needs {', '.join(missing)}: replay_step cannot derive them")
    if gradients not in ("unscaled", "scaled"):
        raise ValueError("gradients is 'unscaled' or 'scaled'")
    dynamic = scaler is not None and scaler.is_enabled()
    if gradients == "scaled" and not dynamic:
        raise ValueError("gradients='scaled' needs an enabled GradScaler")
    return bool(dynamic)


def replay_step(
    model: Any,
    optimizer: Any,
    batch: Any,
    compute_loss: Callable[[Any, Any], Any],
    *,
    run_id: str,
    step: int,
    incident_owner: str,
    last_known_good: Mapping[str, Any],
    binding: Mapping[str, Mapping[str, Any]],
    scaler: Any = None,
    gradients: str = "unscaled",
    owners: Mapping[str, str] | None = None,
    seed: int | None = None,
    rng_state: Any = None,
    modules: Callable[[str, Any], bool] | None = None,
    optimizer_factory: Callable[[list[dict[str, Any]]], Any] | None = None,
    target: str | Path | None = None,
    overwrite: bool = False,
    generators: Sequence[Any] = (),
) -> BundleWriter:
    """Replay one training step on copies and capture its five boundaries.

    ``compute_loss(model, batch)`` runs the forward and returns the loss, as the
    training loop does (autocast included, if the loop uses it); it is called
    with a deep copy of ``model`` and a clone of ``batch`` (a tensor, or a
    mapping/sequence of them). The optimizer is rebuilt on the copy's
    parameters and loaded from a deep copy of its state_dict (or built by
    ``optimizer_factory(param_groups)``), and ``scaler`` (a
    ``torch.amp.GradScaler``, optional) is rebuilt from its state_dict, so the
    real model, optimizer, scaler, gradients and global RNG state are left
    bit-identical. The copy's gradients start from None. A ``torch.compile``d
    model is replayed eagerly on a copy of its original module (``_orig_mod``),
    as each stage's probe_source says.

    Captured: input (the batch tensors as given, taken before ``compute_loss``
    runs, which may change its clone in place), forward (outputs of ``modules`` --
    default: every leaf module -- named ``act/<module path>``, and named probes,
    ``probe/<name>``, in execution order), loss, backward (``grad/<param>`` of
    the optimizer's parameters, after ``scaler.unscale_``, or before it when
    ``gradients="scaled"``) and optimizer (``opt/<param>/<state key>`` after
    ``step()``, and ``update/<param>``, the parameter after the step minus
    before, in float32 for lower-precision parameters). When the loss is
    non-finite and no enabled scaler guards the step, backward and optimizer
    are NOT_RUN; when the scaler finds inf/NaN, the optimizer stage is NOT_RUN
    (the step is skipped).

    ``binding`` must give ``checkpoint``, ``data``, ``loader_cursor``,
    ``objective`` (with ``reduction``) and ``scheduler``; the others are derived
    (model and batch ids are SHA-256 digests of the state_dict and batch bytes,
    the scaler item is the loss-scale evidence) and any given item replaces the
    derived one. ``seed`` or ``rng_state`` (a ``torch.get_rng_state()``
    snapshot) sets the RNG the replay runs on; by default it runs on a fork of
    the current state. numpy's and Python's random and ``generators`` (the
    loop's own ``torch.Generator`` objects) replay from their current states, put back
    afterwards; the environment item says whether the replay could be exact
    (``replay``, and ``replay_inexact``: why not). ``last_known_good`` states ``checkpoint_id``, ``step``
    and ``verified_together``.

    Returns the BundleWriter; with ``target`` the bundle is also written there
    (see :meth:`BundleWriter.write`).
    """
    dynamic = _refuse_what_cannot_be_true(binding, gradients, scaler)
    model, compiled = eager_module(model)
    owner = dict.fromkeys(STAGE_ORDER, incident_owner)
    owner.update(owners or {})
    recipe = StepRecipe(
        compute_loss=compute_loss,
        micro_batches=(MicroBatch(batch, rng_state_for(seed, rng_state, generators)),),
        scaling=Scaling("dynamic", scaler=scaler) if dynamic else Scaling(),
        gradients="scaled" if gradients == "scaled" else "unscaled",
        choose=modules or leaf,
        optimizer_factory=optimizer_factory,
        seed=seed,
    )
    identity = {
        "run_id": run_id,
        "step": step,
        "incident_owner": incident_owner,
        "last_known_good": last_known_good,
        # Written at once: the tensors stream to a spool beside the target.
        "spool_dir": _spool_dir(target),
    }
    replayed = replay_recipe(model, optimizer, recipe, owner, **identity)
    if compiled:
        mark_eager(replayed.writer)
        replayed.inexact.append(COMPILED_LIVE)
    bind(replayed, model, optimizer, binding)
    if target is not None:
        replayed.writer.write(target, overwrite=overwrite)
    return replayed.writer

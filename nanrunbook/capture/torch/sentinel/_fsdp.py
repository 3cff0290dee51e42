"""The sentinel under FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters,
gradients and optimizer state are DTensors, each rank holding a shard.

The checks read each rank's local shards (``to_local()``: no collective, and
the same batched norms and one host read as any step). A custom reduce-scatter
(:class:`OwnGradients`, FSDP2's public ``set_custom_reduce_scatter``) measures
this rank's own gradients before they are reduced with the others': after the
reduce-scatter a NaN from one rank's batch is in every rank's shard, before it
only in the rank that made it.

A held step's evidence (:func:`capture_sharded_step`) cannot be a replay on
copies: FSDP2 modules refuse ``deepcopy``, and a copy's backward would
reduce-scatter on ranks that branch apart (a rank whose loss is non-finite
stops). So each rank writes what it holds of the live step, and says so in
every stage: the batch as given and the loss the live step computed; the
forward run again on the live module under ``torch.no_grad`` by all ranks
together (its all-gathers matched, the RNG state of the live forward restored,
the buffers put back after); the gradients' local shards as the reduce-scatter
left them; and the update replayed on copies of the local shards from those
gradients. Tensor names carry the shard (``grad/0.weight@shard1of2``), each
probe its placements, global shape and offset.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nanrunbook.capture.torch._convert import tensor_to_raw
from nanrunbook.capture.torch._copies import clone_batch, copy_optimizer, flatten
from nanrunbook.capture.torch._shards import is_dtensor, local
from nanrunbook.capture.torch.capsule import BindingFacts, write_sharded_capsule
from nanrunbook.capture.torch.replay import (
    ForwardCapture,
    Replayed,
    batch_binding,
    bind,
    cuda_devices,
    model_binding,
    scheduler_binding,
    topology_binding,
)
from nanrunbook.capture.torch.sentinel._capture import (
    Captured,
    StepCapture,
    StepObjects,
    capture_failed,
    held_line,
    stated_binding,
    write_incident,
)
from nanrunbook.capture.torch.sentinel._steps import StepRecord
from nanrunbook.capture.writer import BundleWriter

__all__ = [
    "ELEMENTWISE",
    "EVIDENCE",
    "OwnGradients",
    "capture_sharded_step",
    "is_fully_sharded",
    "replicated",
    "sharded_evidence",
]

log = logging.getLogger("nanrunbook.sentinel")

# Optimizers whose step is elementwise given the gradients: replayed on a rank's
# local shards, they make exactly that shard of the sharded update.
ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta"}
)


def _fsdp_module() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


def is_fully_sharded(model: Any) -> bool:
    """``model`` or one of its modules was wrapped by ``fully_shard``."""
    kind = _fsdp_module()
    return (
        kind is not None
        and isinstance(model, torch.nn.Module)
        and any(isinstance(m, kind) for m in model.modules())
    )


def replicated(norm: Any) -> Any:
    """A DTensor norm (``get_total_norm`` of sharded gradients is a partial
    reduction) made whole on every rank, once: the all-reduce the loop's own
    ``clip_grad_norm_`` makes when it clips; the clipping then reuses it."""
    if not is_dtensor(norm):
        return norm
    from torch.distributed.tensor import Replicate

    return norm.redistribute(placements=[Replicate()] * norm.device_mesh.ndim)


class OwnGradients:
    """A reduce-scatter on every FSDP2 module of the model that first measures its
    input, this rank's own (accumulated) gradients, then reduce-scatters as the
    module's communication did: the check before the reduction, which names the
    rank whose own gradients went non-finite. ``collective`` names it for the
    hold's reason."""

    collective = "reduce-scatter"

    def __init__(self, model: Any) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        self.norms: list[Any] = []
        owner = self

        class Measured(ReduceScatter):
            """The module's reduce-scatter, its input measured first."""

            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
                return self.inner.allocate(size, dtype=dtype, device=device)

            def __call__(
                self,
                output_tensor: Any,
                input_tensor: Any,
                group: Any,
                op: Any,
                async_op: Any = False,
            ) -> Any:
                # In float32 without a float32 copy of a bfloat16 input.
                norm = torch.linalg.vector_norm(input_tensor.detach(), dtype=torch.float32)
                owner.norms.append(norm)
                return self.inner(output_tensor, input_tensor, group, op, async_op)

        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            if not groups:
                continue  # a module without parameters of its own reduces nothing
            # raises for several parameter groups (a per-parameter mesh)
            module.set_custom_reduce_scatter(Measured(_reduce_scatter_of(groups)))

    def take(self) -> Any:
        """This step's norms (a device tensor), or None; then forget them."""
        norms, self.norms = self.norms, []
        return torch.stack([n.to(norms[0].device) for n in norms]) if norms else None


def _reduce_scatter_of(groups: list[Any]) -> Any:
    """The reduce-scatter the module uses now (FSDP2's default unless the loop set
    one), read from its parameter group: FSDP2 has no public getter for it."""
    current = getattr(groups[0], "_reduce_scatter_comm", None)
    if current is not None:
        return current
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter()


# ---------------------------------------------------------------- the evidence


def _shard(tensor: Any) -> tuple[str, str]:
    """A name suffix and a probe description of a DTensor's local shard."""
    if not is_dtensor(tensor):
        return "", ""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate() or []
    index = 0
    for position, size in zip(coordinate, mesh.shape, strict=True):
        index = index * size + position
    count = math.prod(mesh.shape)
    placements = ", ".join(repr(p) for p in tensor.placements)
    where = ""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
        where = f" at global offset {list(offset)}"
    except Exception:  # a torch without the helper: the shape and placements still say it
        pass
    describe = (
        f"local shard {index} of {count} ({placements} on mesh {tuple(mesh.shape)}) of"
        f" global shape {list(tensor.shape)}: local shape {list(tensor.to_local().shape)}{where}"
    )
    return f"@shard{index}of{count}", describe


def _named_params(model: Any, optimizer: Any) -> list[tuple[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        (names.get(id(p), f"outside/group{g}.param{i}"), p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    ]


def _local_entries(
    kind: str, named: list[tuple[str, Any]], probe: str
) -> list[tuple[str, Any, str]]:
    """(name, bytes, probe) of each non-empty local shard (a rank whose shard of a
    small parameter is empty lists none of it)."""
    out = []
    for name, tensor in named:
        piece = local(tensor)
        if piece.numel() == 0:
            continue
        suffix, where = _shard(tensor)
        out.append(
            (
                f"{kind}/{name}{suffix}",
                tensor_to_raw(piece),
                f"{probe}: {where}" if where else probe,
            )
        )
    return out


def _label(kind: str, index: int, count: int) -> str:
    return f"{kind}/mb{index}" if count > 1 else kind


class _LocalModel:
    """The shards as ``bind`` reads a model (its model item is replaced by the
    shards' own, :func:`_model_item`)."""

    def __init__(self, params: list[Any]) -> None:
        self._params = params

    def state_dict(self) -> dict[str, Any]:
        return {}

    def parameters(self) -> Iterator[Any]:
        return iter(self._params)


def _model_item(model: Any) -> dict[str, Any]:
    state = [(n, local(t)) for n, t in model.state_dict().items()]
    item = model_binding(iter(state), model)
    item["sharding"] = "fsdp2 local shards: the digest covers this rank's shards"
    return item


def _rerun_forward(
    objects: StepObjects, record: StepRecord
) -> tuple[list[tuple[str, Any, str]], list[tuple[str, Any, str]], dict[str, int]]:
    """The inputs and the forward's outputs, the forward run again on the live
    module without gradients (every rank does, so the all-gathers match)."""
    inputs: list[tuple[str, Any, str]] = []
    activations: list[tuple[str, Any, str]] = []
    weights: dict[str, int] = {}
    count = len(record.micro)
    with torch.random.fork_rng(devices=cuda_devices()), torch.no_grad():
        for index, micro in enumerate(record.micro):
            if micro.rng is not None:
                micro.rng.restore()
            batch = clone_batch(micro.batch)
            name = _label("batch", index, count)
            inputs += [
                (f"{name}/{n}" if n else name, tensor_to_raw(t), f"batch[{n!r}]" if n else "batch")
                for n, t in flatten(batch, "")
            ]
            capture = ForwardCapture(
                objects.model, objects.choose, f"mb{index}/" if count > 1 else ""
            )
            with capture.hooked(), ExitStack() as regions:
                for region in micro.autocast:
                    regions.enter_context(
                        torch.autocast(
                            region.device_type,
                            dtype=region.dtype,
                            cache_enabled=region.cache_enabled,
                        )
                    )
                objects.compute_loss(objects.model, batch)
            activations += capture.captured
            for dtype, elements in capture.weights.items():
                weights[dtype] = weights.get(dtype, 0) + elements
    record.buffers.restore()  # what the forward wrote into BatchNorm's statistics
    return inputs, activations, weights


def _update_on_copies(
    objects: StepObjects, named: list[tuple[str, Any]], record: StepRecord
) -> tuple[Any, list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The optimizer rebuilt on copies of this rank's local shards, their gradients
    copies of the live local gradients (clipped as the loop's clip would), its
    state the local shards of the real one's."""
    copies = {id(p): local(p).detach().clone().requires_grad_(p.requires_grad) for _, p in named}
    for _, p in named:
        if p.grad is not None:
            copies[id(p)].grad = local(p.grad).detach().clone()
    state = objects.optimizer.state_dict()
    local_state = {
        "state": {
            key: {
                k: local(v).detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in s.items()
            }
            for key, s in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }
    optimizer = copy_optimizer(objects.optimizer, copies, None, local_state)
    clip = record.clip
    if clip is not None:
        total = local(clip.total).detach().float()
        coefficient = torch.clamp(clip.max_norm / (total + 1e-6), max=1.0)
        clipped = [copies[id(p)].grad for p in clip.params if copies.get(id(p)) is not None]
        grads = [g for g in clipped if g is not None]
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device))
    params = [(name, copies[id(p)]) for name, p in named]
    before = [(name, q.detach().clone()) for name, q in params]
    return optimizer, params, before


def _optimizer_entries(
    optimizer: Any,
    named: list[tuple[str, Any]],
    params: list[tuple[str, Any]],
    before: list[tuple[str, Any]],
) -> list[tuple[str, Any, str]]:
    tensors: list[tuple[str, Any, str]] = []
    source = dict(named)
    for name, q in params:
        suffix, where = _shard(source[name])
        if q.numel() == 0:
            continue
        for key, value in optimizer.state.get(q, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() > 0 and value.dim() > 0:
                tensors.append(
                    (
                        f"opt/{name}{suffix}/{key}",
                        tensor_to_raw(value),
                        f"optimizer.state[p][{key!r}] {where}",
                    )
                )
    for (name, q), (_, old) in zip(params, before, strict=True):
        if q.numel() == 0:
            continue
        suffix, where = _shard(source[name])
        new = q.detach()
        if new.is_floating_point() and new.element_size() < 4:
            new, old = new.float(), old.float()
        tensors.append(
            (
                f"update/{name}{suffix}",
                tensor_to_raw(new - old),
                f"param after step() minus before {where}",
            )
        )
    return tensors


def _scaler_item(objects: StepObjects) -> dict[str, Any]:
    if objects.loss_scale is not None:
        return {"id": "static-loss-scale", "mode": "static", "scale": objects.loss_scale}
    return {"id": "no-loss-scaling", "mode": "none", "scale": 1}


EVIDENCE = (
    "live held step under FSDP2, not a replay on copies: input, loss and gradient shards"
    " as the live step left them; forward run again on the live module without gradients;"
    " the update replayed on copies of the local shards"
)


def sharded_evidence(
    objects: StepObjects,
    record: StepRecord,
    *,
    run_id: str,
    incident_owner: str,
    last_known_good: Mapping[str, Any],
    given: Mapping[str, Mapping[str, Any]],
    topology: Mapping[str, Any] | None,
    spool_dir: Path,
    own: bool | None,
) -> tuple[BundleWriter, list[str]]:
    """The bundle of a fully sharded step whose forward and backward ran on the
    live objects (the held step's, or a capsule's replay of it), ready to write:
    its writer and the notes for the hold's reason. Every rank calls it together
    (the forward run again all-gathers). ``given``: the loop's stated binding
    items; ``own``: whether this rank's gradients were finite before the
    reduce-scatter (None: not measured)."""
    owner = incident_owner
    inputs, activations, weights = _rerun_forward(objects, record)
    named = _named_params(objects.model, objects.optimizer)
    writer = BundleWriter(
        binding={},
        run_id=run_id,
        step=record.number,
        incident_owner=owner,
        last_known_good=last_known_good,
        spool_dir=spool_dir,  # the tensors stream to disk as they are taken
    )
    writer.observe(
        "input",
        inputs,
        owner=owner,
        probe_source="the batch as given, before compute_loss (the live step's)",
    )
    writer.observe(
        "forward",
        activations,
        owner=owner,
        probe_source="forward hooks on leaf modules, execution order: the forward run again on"
        " the live FSDP2 module under torch.no_grad by every rank together, from the live"
        " forward's RNG state (not a replay on copies: FSDP2 modules cannot be copied)",
    )
    count = len(record.losses)
    writer.observe(
        "loss",
        [
            (_label("loss", i, count), tensor_to_raw(loss), "compute_loss(model, batch)")
            for i, loss in enumerate(record.losses)
        ],
        owner=owner,
        probe_source="the loss the live step's compute_loss returned, before backward",
    )
    gradients = [(n, p.grad) for n, p in named if p.grad is not None]
    source = "param.grad local shards after FSDP2's reduce-scatter, before clipping: the live held step's, not replayed"
    if own is not None:
        source += (
            "; this rank's own gradients were finite before the reduce-scatter"
            if own
            else "; this rank's own gradients were already non-finite before the reduce-scatter"
        )
    grad_entries = _local_entries("grad", gradients, "param.grad")
    if not grad_entries:
        raise ValueError("no local gradient shard on this rank")
    writer.observe("backward", grad_entries, owner=owner, probe_source=source, gradients="unscaled")
    optimizer, params, before = _update_on_copies(objects, named, record)
    replayed = Replayed(
        writer=writer,
        scaler=_scaler_item(objects),
        activation_weights=weights,
        random_state={"id": "torch-rng-state-of-the-live-forward", "seed": "unknown"},
        batch=batch_binding(
            [(n, t) for micro in record.micro for n, t in flatten(micro.batch, "")]
        ),
    )
    derived: dict[str, Any] = {
        "model": _model_item(objects.model),
        "scheduler": scheduler_binding(objects.scheduler),
    }
    derived["topology"] = {**topology_binding(), **(topology or {}), "sharding": "fsdp2"}
    inexact = bind(
        replayed,
        _LocalModel([q for _, q in params]),
        optimizer,
        {k: dict(v) for k, v in given.items()},
        derived,
    )
    environment = writer.binding["environment"]
    environment["replay"] = "none"
    environment["evidence"] = EVIDENCE
    notes = [EVIDENCE]
    if type(objects.optimizer).__name__ not in ELEMENTWISE:
        inexact.append(
            f"{type(objects.optimizer).__name__} may not update elementwise: its update on the local shards may not be the shard of the sharded update"
        )
    if inexact:
        environment["replay_inexact"] = "; ".join(inexact)
    optimizer.step()
    writer.observe(
        "optimizer",
        _optimizer_entries(optimizer, named, params, before),
        owner=owner,
        probe_source="optimizer.step() replayed on copies of this rank's local shards, from"
        " the live gradient shards (clipped as the loop's clip_grad_norm_ would): state"
        " after, and the update it applied",
    )
    return writer, notes


def capture_sharded_step(request: StepCapture) -> Captured:
    """:func:`~._capture.capture_step` for a fully sharded model: this rank's
    bundle of the request's held step (see the module's docstring), written and
    checked. Every rank calls it at the same agreed hold (the forward's
    all-gathers). Never raises: a capture that fails is reported and the hold
    stands. No replay on copies, so no reproduction to judge (the request's
    ``policy`` is moot); under several ranks every rank writes the one sharded
    capsule into rank 0's bundle."""
    objects, facts, record = request.objects, request.facts, request.step
    last_known_good, root = request.last_known_good, request.root
    if record.updated:
        # A non-finite update found after it ran (rolled back): its gradients were
        # clipped in place, or replaced by the next step's backward, and no copy
        # can run the step again.
        error = (
            "no bundle under FSDP2 for an update found non-finite after it ran: the held"
            " step's live gradients are gone (clipped in place or replaced by the next"
            " step's backward), and FSDP2 modules cannot be replayed on copies"
        )
        log.error("step %d: %s", record.number, error)
        return Captured(None, None, error)
    given: dict[str, Any] = {}
    try:
        given = stated_binding(facts, record.number, request.recovery)
        run_directory = root / facts.run_id
        run_directory.mkdir(parents=True, exist_ok=True)
        writer, notes = sharded_evidence(
            objects,
            record,
            run_id=facts.run_id,
            incident_owner=facts.incident_owner,
            last_known_good=last_known_good,
            given=given,
            topology=request.topology,
            spool_dir=run_directory,
            own=record.grads.local_finite,  # this rank's before the reduce-scatter; None: unmeasured
        )
        target, report = write_incident(writer, request)
    except Exception as error:  # the hold must stand whatever the capture hits
        captured = capture_failed(record.number, error)
    else:
        log.error("%s", held_line(record.number, target, report, peer=request.peer))
        captured = Captured(target, report, None, tuple(notes))
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return captured
    # Every rank reaches this at the agreed hold, its bundle written or not.
    capsule, capsule_error = write_sharded_capsule(
        captured.bundle,
        model=objects.model,
        optimizer=objects.optimizer,
        scheduler=objects.scheduler,
        micro_batches=record.micro,
        loss_scale=objects.loss_scale,
        clipping=record.clip.recipe() if record.clip is not None else None,
        run_id=facts.run_id,
        step=record.number,
        evidence_content_id=(
            captured.report.manifest.evidence_content_id if captured.report is not None else None
        ),
        failed=captured.error,
        binding=BindingFacts(facts.incident_owner, last_known_good, given, request.topology),
    )
    return replace(captured, capsule=capsule, capsule_error=capsule_error)

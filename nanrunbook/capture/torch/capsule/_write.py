"""Writing a held step's capsule: the real objects' state as it was before the
step (the update was held, the buffers put back), the step's micro-batches and
random states, its recipe and the incident's facts, through the shared state
directory (DCP, JSON documents, a SHA-256 manifest written last, atomically).

Nothing here runs on a healthy step: the sentinel keeps the micro-batches and
random states per step already; a capsule is written only at a hold, or at a
step asked for by ``capture_steps=`` (at its decision, before its update: the
pre-step state is still the real one).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanrunbook.capture.incident import Reproduction
from nanrunbook.capture.torch._faithfulness import determinism_facts, device_facts
from nanrunbook.capture.torch._state_dir import FORMATS, encode_value, write_state_dir
from nanrunbook.capture.torch.capsule._contents import CapsuleRefused, encode_micro_batches
from nanrunbook.capture.torch.replay import Clipping, MicroBatch

__all__ = ["CAPSULE_FORMAT", "HeldStep", "clipping_document", "scheduler_state", "write_capsule"]

CAPSULE_FORMAT = FORMATS["capsule"]


@dataclass(frozen=True)
class HeldStep:
    """What a capsule records of a held step, as the sentinel hands it over."""

    model: Any  # the module replayed (wrappers off)
    optimizer: Any
    scheduler: Any
    scaler: Any  # an enabled GradScaler, or None
    loss_scale: float | None
    micro_batches: Sequence[MicroBatch]
    clipping: Clipping | None
    custom_modules: bool  # the sentinel was given modules=: the build must give them too
    compiled: bool
    run_id: str
    step: int
    incident_owner: str
    last_known_good: Mapping[str, Any]
    given: Mapping[str, Mapping[str, Any]]  # the loop's binding items, as the bundle got them
    topology: Mapping[str, Any] | None  # the bundle's derived topology item (several ranks)
    live: Mapping[str, Any]  # the live step's finiteness, for the replay's annotations
    reproduced: Reproduction | None
    bundle_evidence_id: str


def _outside(model: Any, optimizer: Any) -> dict[str, Any]:
    inside = {id(p) for p in model.parameters()}
    return {
        f"group{g}.param{i}": p.detach()
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in inside
    }


def _optimizer(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The optimizer's tensors for DCP and the rest for JSON."""
    saved = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(str(index), {})[key] = value
            else:
                values.setdefault(str(index), {})[key] = encode_value(value, f"state[{index}]")
    shapes = {
        index: {
            key: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for key, t in entry.items()
        }
        for index, entry in tensors.items()
    }
    document = {
        # JSON objects are written with sorted keys: the state's own order, which
        # orders a replay's optimizer tensors, is kept as lists.
        "order": [[str(index), list(entry)] for index, entry in saved["state"].items()],
        "class": type(optimizer).__name__,
        "param_groups": encode_value(saved["param_groups"], "param_groups"),
        "values": values,
        "tensors": shapes,
        "params": [len(g["params"]) for g in optimizer.param_groups],
    }
    return tensors, document


def clipping_document(optimizer: Any, clipping: Clipping | None) -> dict[str, Any] | None:
    """The step's clipping as the capsule's recipe records it: its parameters by
    their place in the optimizer's groups."""
    if clipping is None:
        return None
    params = {
        id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
    }
    return {
        "max_norm": clipping.max_norm,
        "norm_type": encode_value(clipping.norm_type),
        "params": [params[i] for i in clipping.params if i in params],
        "foreach": clipping.foreach,
    }


def scheduler_state(scheduler: Any) -> dict[str, Any] | None:
    """The scheduler's class and state as JSON (its callables left out: a lambda
    schedule is the entry's to build again)."""
    if scheduler is None:
        return None
    state = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    return {"class": type(scheduler).__name__, "state": encode_value(state, "scheduler")}


def _recipe(held: HeldStep) -> dict[str, Any]:
    scaler = held.scaler
    return {
        "scaling": {
            "mode": "dynamic" if scaler is not None else "static" if held.loss_scale else "none",
            "scale": held.loss_scale,
            "state": None if scaler is None else encode_value(scaler.state_dict(), "scaler"),
            "device": None if scaler is None else str(getattr(scaler, "_device", "cuda")),
        },
        "clipping": clipping_document(held.optimizer, held.clipping),
        "modules": "custom" if held.custom_modules else "leaf",
        "compiled": held.compiled,
        "live": dict(held.live),
    }


def _environment(held: HeldStep) -> dict[str, Any]:
    param = next(iter(held.model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    return {
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": str(torch.version.cuda or "none"),
        "device": device_facts(device),
        "determinism": determinism_facts(),
        "world_size": int(held.topology.get("world_size", 1)) if held.topology else 1,
        "rank": int(held.topology.get("rank", 0)) if held.topology else 0,
    }


def write_capsule(path: Path, held: HeldStep) -> Path:
    """Write ``held``'s capsule at ``path`` (which must not exist); its path.
    CapsuleRefused when a part cannot be recorded exactly (nothing written)."""
    micro, batch_state = encode_micro_batches(held.micro_batches)
    optimizer_tensors, optimizer_document = _optimizer(held.optimizer)
    state: dict[str, Any] = {"model": held.model.state_dict()}
    outside = _outside(held.model, held.optimizer)
    if outside:
        state["outside"] = outside
    if optimizer_tensors:
        state["optimizer"] = optimizer_tensors
    if batch_state:
        state["batch"] = batch_state
    scheduler = held.scheduler
    try:
        scheduler_document = scheduler_state(scheduler)
        documents = {
            "incident": {
                "run_id": held.run_id,
                "step": held.step,
                "incident_owner": held.incident_owner,
                "last_known_good": encode_value(dict(held.last_known_good)),
                "given": encode_value({k: dict(v) for k, v in held.given.items()}),
                "topology": None if held.topology is None else encode_value(dict(held.topology)),
                "bundle": {"path": "..", "evidence_content_id": held.bundle_evidence_id},
                "reproduced": None if held.reproduced is None else held.reproduced.document(),
                "contaminated": False,
            },
            "micro_batches": micro,
            "optimizer": optimizer_document,
            "scheduler": scheduler_document,
            "recipe": _recipe(held),
            "environment": _environment(held),
        }
    except TypeError as error:
        raise CapsuleRefused(str(error)) from None
    header = {
        "run_id": held.run_id,
        "step": held.step,
        "torch": str(torch.__version__),
        "bundle_evidence_content_id": held.bundle_evidence_id,
        "reproduced": None if held.reproduced is None else held.reproduced.verdict,
        "micro_batches": len(micro),
    }
    write_state_dir(
        path, kind_format=CAPSULE_FORMAT, state=state, documents=documents, header=header
    )
    return path

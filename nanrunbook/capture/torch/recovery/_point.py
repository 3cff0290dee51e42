"""Save and load a recovery point: model and optimizer through DCP, the
scheduler, the GradScaler, the data position and the random states as exact
JSON documents, one manifest over all of it (``capture/torch/_state_dir.py``).

Loading verifies every file first (``capture/recovery.py``, every violation;
DCP's metadata, the non-tensor values and the documents are read meanwhile,
restricted and weights-only), checks every part against the object it will go
into, and only then reads the tensors, straight into the run's own where they
fit (``capture/torch/_dcp_reader.py``): a refused point changes nothing, and
the resume holds no second copy of the state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.distributed as dist

from nanrunbook.capture._state_manifest import DCP_METADATA, RANKS_KEY, StateDirRejected
from nanrunbook.capture.incident import rank_member
from nanrunbook.capture.recovery import (
    FORMAT,
    RecoveryPoint,
    RecoveryVerification,
    verified_reading,
)
from nanrunbook.capture.torch._every_rank import agree, gather
from nanrunbook.capture.torch._faithfulness import HostRandom
from nanrunbook.capture.torch._shards import local
from nanrunbook.capture.torch._state_dir import (
    StateDirManifest,
    StateOutline,
    decode_value,
    encode_value,
    load_verified_state,
    outline_verified_state_dir,
    rank_documents,
    read_verified_state_dir,
    write_state_dir,
)
from nanrunbook.errors import Violation, quote
from nanrunbook.manifest.fields import IDENTIFIER

__all__ = [
    "LoadedRecoveryPoint",
    "load_recovery_point",
    "same_state",
    "save_recovery_point",
    "state_digest",
]


def state_digest(state: Mapping[Any, Any]) -> str:
    """SHA-256 of a state dict: every entry in sorted key order, a tensor as its
    dtype, shape and bytes, anything else as its exact JSON form."""
    hasher = hashlib.sha256()
    for key, value in sorted(_leaves(state, ()), key=lambda item: item[0]):
        hasher.update(orjson.dumps(key))
        if isinstance(value, torch.Tensor):
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            hasher.update(f"{value.dtype}{list(value.shape)}".encode())
            if flat.numel():
                hasher.update(flat.view(torch.uint8).numpy().data)
        else:
            hasher.update(orjson.dumps(encode_value(value), option=orjson.OPT_SORT_KEYS))
    return hasher.hexdigest()


def same_state(a: Mapping[Any, Any], b: Mapping[Any, Any]) -> bool:
    """Two state dicts hold the same entries, tensors equal bit for bit (dtype,
    shape and bytes: a NaN equals itself), other values in their exact JSON form."""
    left, right = dict(_leaves(a, ())), dict(_leaves(b, ()))
    if left.keys() != right.keys():
        return False
    for key, x in left.items():
        y = right[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            xs, ys = (_as_integers(t) for t in (x, y))
            if xs.numel() and not torch.equal(xs, ys):
                return False
        elif encode_value(x) != encode_value(y):
            return False
    return True


# Bits compared as integers of the element's width: a NaN equals itself, and
# torch compares 8-byte words about 4x faster than bytes.
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(_SAME_WIDTH.get(flat.element_size(), torch.uint8))


def _leaves(value: Any, path: tuple[str, ...]) -> Iterable[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))
    elif isinstance(value, list) and any(
        isinstance(item, Mapping | torch.Tensor) for item in value
    ):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, str(index)))
    else:
        yield "/".join(path), local(value)  # a DTensor: this rank's shard, no collective


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _object_document(step: int, obj: Any) -> dict[str, Any]:
    """A scheduler's or scaler's part: its state_dict, or that there is none."""
    if obj is None or (hasattr(obj, "is_enabled") and not obj.is_enabled()):
        return {"step": step, "kind": "none"}
    return {
        "step": step,
        "kind": "state_dict",
        "source": type(obj).__qualname__,
        "state": encode_value(obj.state_dict(), "$.state"),
    }


def _data_document(step: int, data: Any) -> dict[str, Any]:
    """The data position: a loader's or sampler's state_dict when it has one
    (torchdata's StatefulDataLoader), else the caller's cursor, recorded as a
    cursor (the tool cannot restore it: the loop must)."""
    if data is not None and callable(getattr(data, "state_dict", None)):
        return {
            "step": step,
            "kind": "state_dict",
            "source": type(data).__qualname__,
            "state": encode_value(data.state_dict(), "$.state"),
        }
    cursor = data() if callable(data) else data
    if cursor is None:
        cursor = {"kind": "steps-since-start", "step": step}
    if not isinstance(cursor, Mapping):
        raise TypeError(
            "data is a loader or sampler with state_dict(), or the loop's cursor as a mapping;"
            f" got a {type(data).__name__}"
        )
    return {"step": step, "kind": "cursor", "cursor": encode_value(dict(cursor), "$.cursor")}


def _rng_document(step: int, generators: Sequence[Any]) -> dict[str, Any]:
    host = HostRandom.now(generators)
    streams: dict[str, Any] = {
        "torch_cpu": encode_value(torch.get_rng_state()),
        "numpy": encode_value(host.numpy),
        "python": encode_value(host.python),
    }
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            streams[f"cuda:{index}"] = encode_value(state)
    generator_states = [encode_value(state) for _, state in host.generators]
    return {"step": step, "streams": streams, "generators": generator_states}


def _point_id(run_id: str, step: int, given: str | None) -> str:
    point_id = given if given is not None else f"{run_id}.recovery-{step}"
    if not IDENTIFIER.fullmatch(point_id):
        raise ValueError(f"point_id {point_id!r} is not an identifier (letters, digits, ._:@/+=-)")
    return point_id


def save_recovery_point(
    path: str | Path,
    *,
    model: Any,
    optimizer: Any,
    step: int,
    run_id: str,
    scheduler: Any = None,
    scaler: Any = None,
    data: Any = None,
    extra: Mapping[str, torch.Tensor] | None = None,
    generators: Iterable[Any] = (),
    point_id: str | None = None,
) -> RecoveryPoint:
    """Write one recovery point at ``path`` (which must not exist) after step
    ``step``: the model's and optimizer's state through DCP; ``scheduler``,
    ``scaler`` (a GradScaler; none or disabled is recorded as none);
    ``data`` (an object with ``state_dict()``, such as torchdata's
    StatefulDataLoader or a sampler, else the loop's cursor, a mapping or a
    callable returning one); ``extra`` (parameters outside the model, by name);
    the random states (torch CPU, every CUDA device present, numpy, Python, and
    ``generators``); then the manifest, last, atomically. Nothing of the run
    changes. Returns the point: its manifest's digests are of the bytes read
    back from disk once DCP wrote and synced them (the one SHA-256 pass)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if not isinstance(run_id, str) or not IDENTIFIER.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r} is not an identifier (letters, digits, ._:@/+=-)")
    identity = _point_id(run_id, step, point_id)
    world = _world_size()
    every_rank = world > 1
    documents: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        documents = {
            "scheduler": _object_document(step, scheduler),
            "scaler": _object_document(step, scaler),
            "data_position": _data_document(step, data),
            "rng": _rng_document(step, tuple(generators)),
        }
    except (TypeError, ValueError) as caught:
        error = caught
    if every_rank:  # a rank that cannot describe its part stops every rank, before DCP's save
        agree("saving a recovery point", error)
    elif error is not None:
        raise error
    if every_rank:
        # Every rank's own shards (FSDP2's DTensors; DDP's replicas, which DCP
        # writes once), the optimizer's state keyed by parameter name.
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if extra:
        state["extra"] = dict(extra)
    target = Path(path)
    header = _header(
        step, run_id, identity, documents, has_extra=bool(extra), ranks=world if every_rank else 0
    )
    write_state_dir(
        target,
        kind_format=FORMAT,
        state=state,
        documents=documents,
        header=header,
        every_rank=every_rank,
    )
    return RecoveryPoint(str(target), identity, run_id, step, documents["data_position"]["kind"])


def _header(
    step: int,
    run_id: str,
    identity: str,
    documents: Mapping[str, Any],
    *,
    has_extra: bool,
    ranks: int = 0,
) -> dict[str, Any]:
    """The point's manifest header: its facts and each part's files and step
    (``ranks``: written by that many ranks, a document per rank in its folder)."""
    parts: dict[str, Any] = {
        part: {"kind": "dcp", "files": [DCP_METADATA], "step": step}
        for part in ("model", "optimizer")
    }
    for part, document in documents.items():
        files = [f"{rank_member(rank)}/{part}.json" for rank in range(ranks)] or [f"{part}.json"]
        parts[part] = {"kind": document.get("kind", "streams"), "files": files, "step": step}
    parts["rng"]["streams"] = sorted(documents["rng"]["streams"])
    if has_extra:
        parts["extra"] = {"kind": "dcp", "files": [DCP_METADATA], "step": step}
    return {
        "step": step,
        "run_id": run_id,
        "point_id": identity,
        "torch_version": str(torch.__version__),
        "world_size": _world_size(),
        "parts": parts,
    }


@dataclass(frozen=True)
class LoadedRecoveryPoint:
    """A point restored into the run's objects: the point, the SHA-256 of the
    model's, optimizer's (and extra tensors') state as the point holds it,
    whether the run's state after the restore is that, bit for bit, and the
    loop's cursor when the data position was one (the loop restores it)."""

    point: RecoveryPoint
    verification: RecoveryVerification
    restored_digests: Mapping[str, str]  # part -> sha256 of its state (empty: not taken)
    restored_exactly: bool  # the run's state after the restore is the point's, bit for bit
    cursor: Mapping[str, Any] | None = None
    random_states: Mapping[str, Any] = field(default_factory=dict, repr=False)
    generators: tuple[Any, ...] = field(default=(), repr=False)

    def restore_random(self) -> None:
        """Put the point's random states back again: for a loop that makes its
        loader's iterator after the load (a DataLoader's iterator draws its
        seed from torch's generator when the loader has none of its own)."""
        _restore_rng(self.random_states, self.generators)

    @property
    def digests_match(self) -> bool:
        """The restored state is the point's, bit for bit, and its digests were
        taken (False when ``check_digests`` was off)."""
        return bool(self.restored_digests) and self.restored_exactly


def _refuse(code: str, where: str, message: str) -> Violation:
    return Violation(code, where, message)


def _object_violations(part: str, document: Any, obj: Any) -> list[Violation]:
    where = f"{part}.json"
    kind = document.get("kind") if isinstance(document, dict) else None
    present = obj is not None and not (hasattr(obj, "is_enabled") and not obj.is_enabled())
    if kind == "none" and present:
        return [
            _refuse(
                "RECOVERY_PART_MISSING", where, f"the point holds no {part} state; one was given"
            )
        ]
    if kind == "state_dict" and not present:
        return [
            _refuse("RECOVERY_PART_MISSING", where, f"the point holds {part} state; none was given")
        ]
    if kind == "state_dict" and document.get("source") != type(obj).__qualname__:
        message = (
            f"saved from a {quote(document.get('source'))}, loading into a {type(obj).__qualname__}"
        )
        return [_refuse("STATE_KEYS_DIFFER", where, message)]
    return []


def _data_violations(document: Any, data: Any) -> list[Violation]:
    where = "data_position.json"
    kind = document.get("kind") if isinstance(document, dict) else None
    restorable = data is not None and callable(getattr(data, "load_state_dict", None))
    if kind == "state_dict" and not restorable:
        message = "the point holds a loader's state; give the loader (data=) to restore it"
        return [_refuse("RECOVERY_PART_MISSING", where, message)]
    if kind == "cursor" and restorable:
        message = "the point holds the loop's cursor, not a loader's state: the loop restores it"
        return [_refuse("RECOVERY_PART_MISSING", where, message)]
    return []


def _model_violations(saved: Mapping[str, Any], model: Any) -> list[Violation]:
    live = model.state_dict()
    where = "model"
    violations: list[Violation] = []
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if missing or unexpected:
        shown = ", ".join(quote(k) for k in (missing + unexpected)[:4])
        message = f"{len(missing)} key(s) not saved, {len(unexpected)} not in the model: {shown}"
        violations.append(_refuse("STATE_KEYS_DIFFER", where, message))
    for key in sorted(set(live) & set(saved)):
        here, there = live[key], saved[key]
        if not isinstance(here, torch.Tensor) or not isinstance(there, torch.Tensor):
            continue
        if here.shape != there.shape:
            message = f"{quote(key)}: {list(there.shape)} saved, {list(here.shape)} in the model"
            violations.append(_refuse("STATE_SHAPE_MISMATCH", where, message))
        elif here.dtype != there.dtype:
            message = f"{quote(key)}: {there.dtype} saved, {here.dtype} in the model"
            violations.append(_refuse("STATE_DTYPE_MISMATCH", where, message))
    return violations


def _optimizer_state(saved: Mapping[str, Any]) -> dict[str, Any]:
    """DCP stores dict keys as strings: the optimizer's state is keyed by index."""
    state = {int(index): dict(values) for index, values in dict(saved.get("state", {})).items()}
    return {"state": state, "param_groups": list(saved.get("param_groups", []))}


def _optimizer_violations(saved: Mapping[str, Any], optimizer: Any) -> list[Violation]:
    where = "optimizer"
    groups = saved["param_groups"]
    live_groups = optimizer.param_groups
    sizes = [len(group.get("params", [])) for group in groups]
    live_sizes = [len(group["params"]) for group in live_groups]
    if sizes != live_sizes:
        message = f"parameter groups of {sizes} saved, {live_sizes} in the optimizer"
        return [_refuse("STATE_KEYS_DIFFER", where, message)]
    params = {
        index: param
        for group, live in zip(groups, live_groups, strict=True)
        for index, param in zip(group["params"], live["params"], strict=True)
    }
    violations: list[Violation] = []
    for index, values in saved["state"].items():
        param = params.get(index)
        if param is None:
            message = f"state for parameter {index}, which no group holds"
            violations.append(_refuse("STATE_KEYS_DIFFER", where, message))
            continue
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                message = f"state {index}.{quote(name)}: {list(value.shape)}, the parameter {list(param.shape)}"
                violations.append(_refuse("STATE_SHAPE_MISMATCH", where, message))
    return violations


def _rng_violations(document: Any, generators: Sequence[Any]) -> list[Violation]:
    saved = document.get("generators", []) if isinstance(document, dict) else []
    if len(saved) != len(generators):
        message = f"{len(saved)} generator state(s) saved, {len(generators)} generator(s) given"
        return [_refuse("RECOVERY_RNG_MISSING", "rng.json", message)]
    return []


def _restore_rng(document: Mapping[str, Any], generators: Sequence[Any]) -> None:
    streams = document["streams"]
    torch.set_rng_state(decode_value(streams["torch_cpu"]))
    if torch.cuda.is_available():
        states = [
            decode_value(streams[f"cuda:{i}"])
            for i in range(torch.cuda.device_count())
            if f"cuda:{i}" in streams
        ]
        if states:
            torch.cuda.set_rng_state_all(states)
    generator_states = [decode_value(state) for state in document.get("generators", [])]
    HostRandom(
        decode_value(streams["numpy"]),
        decode_value(streams["python"]),
        tuple(zip(generators, generator_states, strict=True)),
    ).restore()


def load_recovery_point(
    path: str | Path,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any = None,
    scaler: Any = None,
    data: Any = None,
    extra: Mapping[str, torch.Tensor] | None = None,
    generators: Iterable[Any] = (),
    progress: Any = None,
    check_digests: bool = False,
) -> LoadedRecoveryPoint:
    """Verify the point, then restore every part bit for bit: parameters and
    buffers, optimizer state, scheduler, scaler, the loader's position (a
    loader or sampler with ``load_state_dict``) and the random states, so the
    next batches and the next step are those the run would have had. Raises
    StateDirRejected naming every violation (a part missing, a digest, keys,
    shapes or dtypes that differ) before anything is changed.
    ``check_digests`` (what ``prove`` records): read the point once more into
    scratch, compare the restored model, optimizer and extra state with it bit
    for bit and digest it (``digests_match``, ``restored_digests``): one more
    read and SHA-256 pass, and a copy of the state in memory."""

    # The point's metadata, its non-tensor values and its documents are read
    # while its data files are hashed; once every digest matched, each part is
    # checked against the object it goes into, and only then are the tensors
    # read, straight into the run's own where they fit: a refused point changes
    # nothing. A point every rank wrote is read by DCP collectively.
    root = Path(path)

    def outline(manifest: StateDirManifest) -> StateOutline | None:
        if RANKS_KEY in manifest.header:
            return None
        return outline_verified_state_dir(root, manifest)

    verification, manifest, outlined = verified_reading(
        root, read=outline, progress=progress, metadata_unpickled=True
    )
    if not verification.verified or manifest is None:
        raise verification.rejected()
    gens = tuple(generators)
    if RANKS_KEY in manifest.header:
        return _load_every_rank(
            root, manifest, verification, model, optimizer, scheduler, scaler,
            data, extra, gens, check_digests=check_digests,
        )  # fmt: skip
    if outlined is None:  # outline() reads every point one process wrote
        raise verification.rejected()
    outline_saved, documents = outlined.saved(), outlined.documents
    violations = [
        *_model_violations(outline_saved.get("model", {}), model),
        *_optimizer_violations(_optimizer_state(outline_saved.get("optimizer", {})), optimizer),
        *_object_violations("scheduler", documents["scheduler"], scheduler),
        *_object_violations("scaler", documents["scaler"], scaler),
        *_data_violations(documents["data_position"], data),
        *_rng_violations(documents["rng"], gens),
        *_extra_violations(outline_saved.get("extra", {}), extra),
    ]
    if violations:
        raise StateDirRejected(violations)
    live: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if extra:
        live["extra"] = dict(extra)
    saved = outlined.read(live)
    saved_model = saved.get("model", {})
    saved_optimizer = _optimizer_state(saved.get("optimizer", {}))
    model.load_state_dict(saved_model, strict=True)  # a tensor read in place copies nothing
    optimizer.load_state_dict(saved_optimizer)
    cursor = _restore_documents(documents, scheduler, scaler, data)
    if extra:
        with torch.no_grad():
            for name, tensor in extra.items():
                tensor.copy_(saved["extra"][name])
    _restore_rng(documents["rng"], gens)  # last: building the objects may have drawn
    point = verification.point()
    restored: dict[str, str] = {}
    exact = False
    if check_digests:
        # The point read once more, into scratch: the restored state compared
        # with it bit for bit, and its digest taken, each part on a thread.
        _, held, _ = read_verified_state_dir(root, manifest)
        pairs = [("model", model.state_dict(), held.get("model", {}))]
        pairs.append(
            ("optimizer", optimizer.state_dict(), _optimizer_state(held.get("optimizer", {})))
        )
        if extra:
            pairs.append(("extra", dict(extra), held["extra"]))
        with ThreadPoolExecutor(len(pairs)) as pool:
            digests = {part: pool.submit(state_digest, kept) for part, _, kept in pairs}
            exact = all(same_state(now, kept) for _, now, kept in pairs)
            restored = {part: digest.result() for part, digest in digests.items()}
    return LoadedRecoveryPoint(point, verification, restored, exact, cursor, documents["rng"], gens)


def _extra_violations(
    saved: Mapping[str, Any], extra: Mapping[str, torch.Tensor] | None
) -> list[Violation]:
    given = dict(extra or {})
    if set(saved) != set(given):
        message = f"extra tensors {sorted(saved)} saved, {sorted(given)} given"
        return [_refuse("STATE_KEYS_DIFFER", "extra", message)]
    return [
        _refuse("STATE_SHAPE_MISMATCH", "extra", f"{quote(name)}: {list(saved[name].shape)} saved")
        for name in sorted(given)
        if saved[name].shape != given[name].shape or saved[name].dtype != given[name].dtype
    ]


def _restore_documents(
    documents: Mapping[str, Any], scheduler: Any, scaler: Any, data: Any
) -> Mapping[str, Any] | None:
    """Scheduler, scaler and loader from their documents; the loop's cursor
    when the data position is one (the loop restores it), else None."""
    for part, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if documents[part]["kind"] == "state_dict":
            obj.load_state_dict(decode_value(documents[part]["state"]))
    position = documents["data_position"]
    if position["kind"] == "state_dict":
        data.load_state_dict(decode_value(position["state"]))
        return None
    cursor: Mapping[str, Any] = decode_value(position["cursor"])
    return cursor


def _load_every_rank(
    root: Path,
    manifest: StateDirManifest,
    verification: RecoveryVerification,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    data: Any,
    extra: Mapping[str, torch.Tensor] | None,
    gens: tuple[Any, ...],
    *,
    check_digests: bool,
) -> LoadedRecoveryPoint:
    """A point every rank wrote, loaded by every rank of a job of its world
    size: each rank's shards through DCP (collective), each rank's scheduler,
    data position and random states from its own folder. Every rank's
    violations are gathered before DCP reads, so every rank refuses together."""
    world = _world_size()
    saved_world = verification.world_size
    if saved_world != world:  # the same on every rank: no collective needed
        message = (
            f"written by {saved_world} ranks, loaded on {world}: each rank's random states and"
            f" data position belong to one rank; load it on {saved_world} ranks"
        )
        raise StateDirRejected(
            [Violation("RECOVERY_WORLD_SIZE_MISMATCH", "manifest.json", message)]
        )
    rank = dist.get_rank()
    documents = rank_documents(root, manifest, rank)
    mine = [
        *_object_violations("scheduler", documents["scheduler"], scheduler),
        *_object_violations("scaler", documents["scaler"], scaler),
        *_data_violations(documents["data_position"], data),
        *_rng_violations(documents["rng"], gens),
    ]
    found = gather([(v.code, f"{rank_member(rank)}/{v.where}", v.message) for v in mine])
    violations = [Violation(*each) for listed in found for each in listed]
    if violations:
        raise StateDirRejected(violations)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    if extra:
        state["extra"] = dict(extra)
    load_verified_state(root, state)  # every rank's shards, read in place
    set_state_dict(  # on copies of the dicts: torch renames DDP's keys in the ones given
        model,
        optimizer,
        model_state_dict=_containers_copied(state["model"]),
        optim_state_dict=_containers_copied(state["optimizer"]),
    )
    cursor = _restore_documents(documents, scheduler, scaler, data)
    _restore_rng(documents["rng"], gens)
    restored: dict[str, str] = {}
    exact = False
    if check_digests:
        live_model, live_optimizer = get_state_dict(model, optimizer)
        pairs: list[tuple[str, Mapping[str, Any], Mapping[str, Any]]] = [
            ("model", live_model, state["model"]),
            ("optimizer", live_optimizer, state["optimizer"]),
        ]
        if extra:
            pairs.append(("extra", dict(extra), state["extra"]))
        exact = all(same_state(live, held) for _, live, held in pairs)
        restored = {part: state_digest(held) for part, _, held in pairs}  # this rank's shards
    point = verification.point()
    return LoadedRecoveryPoint(point, verification, restored, exact, cursor, documents["rng"], gens)


def _containers_copied(value: Any) -> Any:
    """``value`` with every dict and list copied, the tensors shared."""
    if isinstance(value, Mapping):
        return {key: _containers_copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_containers_copied(item) for item in value]
    return value

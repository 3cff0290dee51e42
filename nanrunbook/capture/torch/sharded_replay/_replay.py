"""``nanrunbook replay`` of a sharded capsule, run as a distributed job
(``torchrun --nproc-per-node N -m nanrunbook replay CAPSULE --entry mod:build``).

Every rank of a job of the capsule's world size builds the objects with the
entry (its FSDP2 model), loads its own part (its shards through DCP, its
``batch_<rank>`` micro-batches, its ``rank-NNNNN/`` documents), runs the
step's forward and backward on the built objects with the recorded
micro-batches and random states, every rank together (FSDP2's collectives
need them all), and writes its bundle into ``--out`` as an incident set, as
the sentinel wrote the held step's (:func:`~..sentinel.sharded_evidence`),
each stage's probe source saying it is this replay. Each rank's bundle is
compared with its incident member (``diff``); the answers are gathered, so
every rank exits with the same code and rank 0 prints them.

Every phase ends in an agreement (:func:`_together`): a rank that fails
stops every rank with its reason, and no rank waits in a collective another
never reaches. A job of another world size, or no job, is refused before
anything is built (a usage error: how it was started).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch

from nanrunbook.capture._state_manifest import RANKS_KEY
from nanrunbook.capture.incident import incident_bundle_path, rank_member
from nanrunbook.capture.torch._copies import clone_batch
from nanrunbook.capture.torch._entry import Built, EntryError
from nanrunbook.capture.torch._shards import local
from nanrunbook.capture.torch._state_dir import (
    StateDirManifest,
    StateDirRejected,
    decode_value,
    load_verified_state,
    rank_documents,
    verify_state_dir,
)
from nanrunbook.capture.torch.capsule import (
    CAPSULE_FORMAT,
    Capsule,
    decode_micro_batches,
    generator_count,
    identity_violation,
    micro_batch_template,
    replay_head,
)
from nanrunbook.capture.torch.replay import leaf
from nanrunbook.capture.torch.sentinel import (
    Buffers,
    ClipCall,
    OwnGradients,
    StepObjects,
    StepRecord,
    is_fully_sharded,
    replicated,
    sharded_evidence,
)
from nanrunbook.diff import Comparison, ComparisonRejected, diff_bundles
from nanrunbook.errors import Violation
from nanrunbook.exits import Exit, most_severe

T = TypeVar("T")

REPLAYED = (
    "replayed by nanrunbook replay under torchrun from the sharded capsule: the held step's"
    " forward and backward run again on the entry's FSDP2 objects by every rank together"
)

_TIMEOUT_VARIABLE = "NANRUNBOOK_REPLAY_TIMEOUT"


def _timeout() -> timedelta:
    """How long a rank waits in one of the replay's collectives for the others:
    ``NANRUNBOOK_REPLAY_TIMEOUT`` seconds, default 300."""
    text = os.environ.get(_TIMEOUT_VARIABLE, "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise EntryError(f"{_TIMEOUT_VARIABLE}={text!r}: expected a positive number of seconds")
    return timedelta(seconds=seconds)


def launched_world() -> int | None:
    """The world size torchrun (or any launcher setting WORLD_SIZE) started this
    process in; None when it was started on its own."""
    value = os.environ.get("WORLD_SIZE")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _how_to_start(world: int) -> str:
    return f"torchrun --nproc-per-node {world} -m nanrunbook replay ..."


@dataclass(frozen=True)
class ShardedCapsule:
    """A verified capsule every rank of an FSDP2 job wrote."""

    path: Path
    manifest: StateDirManifest
    world_size: int

    @property
    def run_id(self) -> str:
        return str(self.manifest.header["run_id"])

    @property
    def step(self) -> int:
        return int(self.manifest.header["step"])

    def documents(self, rank: int) -> dict[str, Any]:
        """The JSON documents ``rank`` wrote (its ``rank-NNNNN/`` folder)."""
        found = rank_documents(self.path, self.manifest, rank)
        missing = [
            n for n in ("incident", "micro_batches", "scheduler", "recipe") if n not in found
        ]
        if missing:
            where = f"{rank_member(rank)}/{missing[0]}.json"
            raise StateDirRejected(
                [Violation("CAPSULE_DOCUMENT_INVALID", where, "the capsule has no such document")]
            )
        return found

    def incident_member(self, rank: int, documents: Mapping[str, Any]) -> Path:
        """``rank``'s incident bundle, as its incident document names it."""
        return (self.path / str(documents["incident"]["bundle"]["path"])).resolve()


def open_capsule(path: str | Path) -> Capsule | ShardedCapsule:
    """Verify ``path`` once (every file against the manifest): the capsule one
    process wrote, or the one every rank of an FSDP2 job wrote.
    StateDirRejected with every violation."""
    root = Path(path)
    manifest, violations = verify_state_dir(root, kind_format=CAPSULE_FORMAT)
    if violations or manifest is None:
        raise StateDirRejected(violations)
    if RANKS_KEY in manifest.header:
        why = identity_violation(manifest.header.get("run_id"), manifest.header.get("step"))
        if why is not None:
            raise StateDirRejected([Violation("CAPSULE_DOCUMENT_INVALID", "manifest.json", why)])
        return ShardedCapsule(root, manifest, len(manifest.header[RANKS_KEY]))
    return Capsule.verified(root, manifest)


@dataclass(frozen=True)
class RankReplay:
    """One rank's replay: its bundle, its incident member and their diff."""

    rank: int
    bundle: Path
    incident: Path
    verdict: str
    not_reproduced: str | None
    decision: str
    stage: str | None
    exit_code: int


@dataclass(frozen=True)
class ShardedReplay:
    """What the job's replay found, every rank's answer (the same on every rank)."""

    capsule: ShardedCapsule
    out: Path
    ranks: tuple[RankReplay, ...]

    def exit_code(self, *, require_fixed: bool = False) -> int:
        """As the single-process replay's: the most severe rank's; with
        ``require_fixed`` nothing was changed, so no recovery is proven."""
        codes = [r.exit_code for r in self.ranks]
        if require_fixed:
            codes.append(Exit.HOLD)
        return most_severe(codes)

    @property
    def verdict(self) -> str:
        verdicts = {r.verdict for r in self.ranks}
        return verdicts.pop() if len(verdicts) == 1 else "MIXED"


def _failure(error: BaseException) -> tuple[str, str, list[tuple[str, str, str]]]:
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, StateDirRejected | ComparisonRejected):
        return "rejected", line, [(v.code, v.where, v.message) for v in error.violations]
    if isinstance(error, ValueError):  # EntryError included: how it was run
        return "usage", line, []
    return "failed", f"{type(error).__name__}: {line}", []


def _together(run: Callable[[], T]) -> T:
    """``run`` on every rank, then one agreement: every rank raises when any
    rank failed (StateDirRejected with every rank's violations, each under its
    rank's folder; EntryError for a usage error; RuntimeError otherwise)."""
    from nanrunbook.capture.torch._every_rank import gather

    value: Any = None
    failure = None
    try:
        value = run()
    except Exception as error:  # every rank learns it, below
        failure = _failure(error)
    found = gather(failure)
    failures = [(rank, each) for rank, each in enumerate(found) if each is not None]
    if not failures:
        return value  # type: ignore[no-any-return]
    rejected = [
        Violation(code, f"{rank_member(rank)}/{where}", message)
        for rank, (kind, _, violations) in failures
        if kind == "rejected"
        for code, where, message in violations
    ]
    if rejected:
        raise StateDirRejected(rejected)
    named = "; ".join(f"rank {rank}: {line}" for rank, (_, line, _) in failures)
    if any(kind == "failed" for _, (kind, _, _) in failures):
        raise RuntimeError(named)
    raise EntryError(named)


def _check_launch(capsule: ShardedCapsule, changes: int) -> None:
    """Refuse a job that cannot replay ``capsule``: the same on every rank, no
    collective."""
    world = launched_world()
    if world is None:
        raise EntryError(
            f"{capsule.path} was written by {capsule.world_size} ranks under FSDP2: replay it"
            f" as a distributed job, {_how_to_start(capsule.world_size)}"
        )
    if world != capsule.world_size:
        raise EntryError(
            f"{capsule.path} was written by {capsule.world_size} ranks under FSDP2, this job"
            f" has {world}: each rank's shards, batches and random states belong to one rank;"
            f" {_how_to_start(capsule.world_size)}"
        )
    if changes:
        raise EntryError(
            "--change is not built for a sharded capsule's replay: it replays the step as"
            " recorded only"
        )


def _kinds(documents: Mapping[str, Any], built: Built) -> list[Violation]:
    """This rank's built objects against what it recorded, before any load."""
    found: list[Violation] = []

    def differ(where: str, message: str) -> None:
        found.append(Violation("CAPSULE_OBJECTS_DIFFER", where, message))

    if not is_fully_sharded(built.model):
        differ("environment.json", "an FSDP2 model in the capsule; the entry's model is not"
               " fully_shard-ed")  # fmt: skip
    scheduler = documents["scheduler"]
    built_scheduler = type(built.scheduler).__name__ if built.scheduler is not None else None
    recorded = scheduler["class"] if scheduler is not None else None
    if built_scheduler != recorded:
        differ("scheduler.json", f"scheduler {recorded or 'none'} in the capsule,"
               f" {built_scheduler or 'none'} built")  # fmt: skip
    if built.scaler is not None and built.scaler.is_enabled():
        differ("recipe.json", "no GradScaler under FSDP2 in the capsule, an enabled one built")
    wanted = generator_count(documents["micro_batches"])
    if wanted != len(built.generators):
        differ("micro_batches.json", f"{wanted} generator state(s) in the capsule,"
               f" {len(built.generators)} generator(s) built")  # fmt: skip
    return found


@dataclass(frozen=True)
class _Loaded:
    objects: StepObjects
    micro: tuple[Any, ...]  # MicroBatch
    clipping: Any  # (params, max_norm, norm_type, foreach) or None


def _load(
    capsule: ShardedCapsule, documents: Mapping[str, Any], built: Built, rank: int
) -> _Loaded:
    """This rank's shards through DCP (collective) and its own micro-batches,
    scheduler and recipe into the built objects."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = built.model, built.optimizer
    model_state, optimizer_state = get_state_dict(model, optimizer)
    own = f"batch_{rank:05d}"
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    batch = micro_batch_template(documents["micro_batches"])
    if batch:
        state[own] = batch
    load_verified_state(  # another rank's micro-batches are not this rank's to load
        capsule.path,
        state,
        others=lambda key: key.startswith("batch_") and key.split(".")[0] != own,
    )
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    scheduler = documents["scheduler"]
    if scheduler is not None:
        built.scheduler.load_state_dict(decode_value(scheduler["state"]))
    micro = decode_micro_batches(documents["micro_batches"], state.get(own, {}), built.generators)
    recipe = documents["recipe"]
    scaling = recipe["scaling"]
    objects = StepObjects(
        model=model,
        optimizer=optimizer,
        scheduler=built.scheduler,
        scaler=None,
        loss_scale=float(scaling["scale"]) if scaling["mode"] == "static" else None,
        compute_loss=built.compute_loss,
        choose=built.modules or leaf,
    )
    clip = recipe["clipping"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clipping = (
        None
        if clip is None
        else (
            [params[i] for i in clip["params"]],
            float(clip["max_norm"]),
            float(decode_value(clip["norm_type"])),
            clip["foreach"],
        )
    )
    return _Loaded(objects, micro, clipping)


def _run_step(loaded: _Loaded, step: int) -> tuple[Any, bool | None]:
    """The step's forward and backward on the built objects, as the loop ran
    them (the last micro-batch syncs the gradients); its record for the
    evidence, and whether this rank's own gradients were finite before the
    reduce-scatter."""
    objects = loaded.objects
    model = objects.model
    own = OwnGradients(model)
    record = StepRecord(step, 0.0, Buffers(model), None, micro=list(loaded.micro))
    objects.optimizer.zero_grad(set_to_none=True)
    count = len(loaded.micro)
    for index, micro in enumerate(loaded.micro):
        model.set_requires_gradient_sync(index == count - 1)
        if micro.rng is not None:
            micro.rng.restore()
        with ExitStack() as regions:
            for region in micro.autocast:
                regions.enter_context(
                    torch.autocast(
                        region.device_type, dtype=region.dtype, cache_enabled=region.cache_enabled
                    )
                )
            loss = objects.compute_loss(model, clone_batch(micro.batch))
        record.losses.append(loss.detach())
        scale = objects.loss_scale
        (loss * scale if scale is not None else loss).backward()
    norms = own.take()
    finite = None if norms is None else bool(torch.isfinite(norms).all())
    if loaded.clipping is not None:  # the norm only: a held step's clipping is not applied
        params, max_norm, norm_type, foreach = loaded.clipping
        grads = [p.grad for p in params if p.grad is not None]
        total = replicated(torch.nn.utils.get_total_norm(grads, norm_type, False, foreach))
        record.clip = ClipCall(params, max_norm, norm_type, foreach, total, local(total))
    return record, finite


def _write_bundle(
    capsule: ShardedCapsule,
    documents: Mapping[str, Any],
    loaded: _Loaded,
    record: Any,
    own: bool | None,
    out: Path,
    rank: int,
) -> Path:
    """This rank's bundle of the replay, bound as its incident bundle was."""
    incident = documents["incident"]
    topology = incident.get("topology")
    spool = out / capsule.run_id
    spool.mkdir(parents=True, exist_ok=True)
    writer, _ = sharded_evidence(
        loaded.objects,
        record,
        run_id=capsule.run_id,
        incident_owner=str(incident["incident_owner"]),
        last_known_good=decode_value(incident["last_known_good"]),
        given=decode_value(incident["given"]),
        topology=None if topology is None else decode_value(topology),
        spool_dir=spool,
        own=own,
    )
    for stage in ("input", "forward", "loss", "backward", "optimizer"):
        writer.annotate(stage, REPLAYED)
    target = incident_bundle_path(out, capsule.run_id, capsule.step, rank, 0)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer.write_checked(target)
    return target


def _compare(
    capsule: ShardedCapsule, documents: Mapping[str, Any], bundle: Path, rank: int
) -> RankReplay:
    """This rank's replay against its incident member (the one the capsule names)."""
    from nanrunbook import strictjson
    from nanrunbook.errors import EvidenceRejected

    member = capsule.incident_member(rank, documents)
    recorded = documents["incident"]["bundle"]["evidence_content_id"]
    try:
        found = strictjson.load_manifest_bytes((member / "manifest.json").read_bytes())
    except (OSError, EvidenceRejected):
        found = None  # diff rejects it, naming why
    if found is not None and found.get("evidence_content_id") != recorded:
        message = f"its evidence content id is not {recorded}, which the capsule names"
        where = f"{rank_member(rank)}/incident.json"
        raise StateDirRejected([Violation("CAPSULE_BUNDLE_DIFFERS", where, message)])
    comparison: Comparison = diff_bundles(member, bundle)
    decision = comparison.other.decision
    return RankReplay(
        rank,
        bundle,
        member,
        comparison.verdict,
        comparison.not_reproduced,
        decision.decision,
        decision.earliest_nonfinite_stage,
        comparison.exit_code(),
    )


def _outside(out: Path, capsule: ShardedCapsule) -> None:
    incident_set = capsule.path.resolve().parent.parent
    here = out.resolve()
    if (
        here == incident_set
        or incident_set in here.parents
        or capsule.path.resolve() in here.parents
    ):
        raise EntryError(f"--out {out} is inside {incident_set}: a replay never writes there")
    if out.exists() or out.is_symlink():
        raise EntryError(f"--out {out} exists: a replay writes a new directory")


def replay_sharded(
    capsule: ShardedCapsule,
    build: Callable[[], Built],
    out: Path,
    *,
    changes: int = 0,
) -> ShardedReplay:
    """Every rank of a job of the capsule's world size: build (``build``), load
    this rank's part, run the step, write this rank's bundle below ``out`` (an
    incident set: ``out/RUN/STEP/rank-NNNNN``), compare it with its incident
    member. EntryError when the job is not the capsule's (its world size, no
    job, ``changes``) or the entry fails; StateDirRejected when the capsule, a
    bundle or the built objects do not fit; the same on every rank."""
    import torch.distributed as dist

    _check_launch(capsule, changes)
    timeout = _timeout()
    started = not dist.is_initialized()
    if started:
        backend = "gloo" if not torch.cuda.is_available() else "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, timeout=timeout)
    try:
        from nanrunbook.capture.torch._every_rank import gather

        rank = dist.get_rank()
        _together(lambda: _outside(out, capsule) if rank == 0 else None)
        documents = _together(lambda: capsule.documents(rank))
        built = _together(build)

        def fits() -> None:
            found = _kinds(documents, built)
            if found:
                raise StateDirRejected(found)

        _together(fits)
        loaded = _together(lambda: _load(capsule, documents, built, rank))
        record, own = _together(lambda: _run_step(loaded, capsule.step))
        # Made once every rank has run the step: a job that fails before leaves nothing.
        _together(lambda: out.mkdir(parents=True) if rank == 0 else None)
        bundle = _together(
            lambda: _write_bundle(capsule, documents, loaded, record, own, out, rank)
        )
        mine = _together(lambda: _compare(capsule, documents, bundle, rank))
        ranks = tuple(gather(mine))
        return ShardedReplay(capsule, out, ranks)
    finally:
        if started:
            dist.destroy_process_group()


def sharded_document(result: ShardedReplay, *, require_fixed: bool = False) -> dict[str, Any]:
    """The job's replay as JSON (``replay --format json`` under torchrun)."""
    capsule = result.capsule
    return {
        **replay_head(capsule.path, capsule.run_id, capsule.step),
        "world_size": capsule.world_size,
        "incident_set": str(result.out / capsule.run_id / str(capsule.step)),
        "verdict": result.verdict,
        "ranks": [
            {
                "rank": r.rank,
                "bundle": str(r.bundle),
                "incident_bundle": str(r.incident),
                "verdict": r.verdict,
                "not_reproduced": r.not_reproduced,
                "decision": r.decision,
                "earliest_nonfinite_stage": r.stage,
                "exit_code": r.exit_code,
            }
            for r in result.ranks
        ],
        "changes": [],
        "exit_code": result.exit_code(require_fixed=require_fixed),
    }

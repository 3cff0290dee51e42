"""The sentinel: holds the update, captures the failing step and warns early, from
inside a PyTorch training loop.

Adopting it takes two added lines, and the loop's forward call routed through
it (and its clipping, if it clips)::

    sentinel = Sentinel(model, optimizer, compute_loss, scaler=scaler, scheduler=scheduler,
                        run_id="run-7", checkpoint={...}, data={...}, objective={...})
    for batch in loader:
        loss = sentinel.forward(batch)           # was: loss = compute_loss(model, batch)
        ...                                      # backward, unscale_, step, update as before
        if saved:                                # after the loop's own checkpoint
            sentinel.checkpointed("ckpt-2000", verified_together=PARTS)

It wraps ``optimizer.step``, ``scaler.step``/``update`` and ``scheduler.step`` on
the instances. At each step it checks the loss before backward, the gradients
after unscale and before clipping and the step, and the update after it, with
one host read per step (see :mod:`.checks`). A non-finite loss or gradient:
the optimizer, scheduler and scaler do not step, the model's buffers are put
back, and under the ``hold`` policy the step is replayed on copies, its bundle
written under ``incident_dir/<run>/<step>/`` and checked, and
:class:`~nanrunbook.capture.incident.SentinelHold` raised.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch

from nanrunbook.capture.facts import Cursor, LoopFacts, recovery_point
from nanrunbook.capture.incident import SentinelHold, rank_member
from nanrunbook.capture.recovery import RecoveryPoint
from nanrunbook.capture.telemetry import TelemetryFile, Thresholds, alert
from nanrunbook.capture.torch._copies import clone_batch, eager_module
from nanrunbook.capture.torch._offload import REPLAY_MEMORY, ReplayMemory
from nanrunbook.capture.torch._shards import local
from nanrunbook.capture.torch.replay import (
    Autocast,
    ExtremesSampler,
    MicroBatch,
    OutputExtremes,
    RngState,
    leaf,
)
from nanrunbook.capture.torch.sentinel._capture import StepObjects
from nanrunbook.capture.torch.sentinel._decide import Policy, StepDecider, Transient
from nanrunbook.capture.torch.sentinel._fsdp import (
    OwnGradients,
    is_fully_sharded,
    replicated,
)
from nanrunbook.capture.torch.sentinel._intercept import Intercepts
from nanrunbook.capture.torch.sentinel._ranks import LocalGradients, Ranks
from nanrunbook.capture.torch.sentinel._snapshot import (
    SNAPSHOT_PLACES,
    Buffers,
    SnapshotPlace,
    StateSnapshot,
    reset_scaler_step,
)
from nanrunbook.capture.torch.sentinel._steps import ClipCall, StepRecord
from nanrunbook.contract import SCALE_RANGE, is_contract_scale

__all__ = ["Policy", "Sentinel"]

log = logging.getLogger("nanrunbook.sentinel")


def _refuse_closure_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, torch.optim.LBFGS):
        closure_required = True
    else:
        step = inspect.signature(type(optimizer).step).parameters.get("closure")
        closure_required = step is not None and step.default is inspect.Parameter.empty
    if closure_required:
        raise TypeError(
            f"{type(optimizer).__name__} steps with a closure that re-evaluates the loss inside"
            " step(); the sentinel cannot check or hold what happens in there, nor replay it"
        )


def _static_scale(loss_scale: float | None, scaler: Any) -> float | None:
    if loss_scale is None:
        return None
    if scaler is not None:
        raise ValueError("give a static loss_scale or an enabled GradScaler, not both")
    if not is_contract_scale(float(loss_scale)):
        raise ValueError(f"loss_scale {loss_scale!r} is not {SCALE_RANGE}")
    return float(loss_scale)


def _local_gradients(
    model: Any, sharded: bool, ranks: Ranks
) -> LocalGradients | OwnGradients | None:
    if sharded and ranks.distributed:
        try:
            return OwnGradients(model)
        except (RuntimeError, ValueError) as error:  # several parameter groups a module
            log.info("gradients are checked after the reduce-scatter only: %s", error)
            return None
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    try:
        return LocalGradients(model)
    except (RuntimeError, ValueError) as error:  # the loop has a hook of its own
        log.info("gradients are checked after the all-reduce only: %s", error)
        return None


def _telemetry_path(
    given: str | Path | None, incident_dir: Path, facts: LoopFacts, ranks: Ranks
) -> Path:
    if given is not None:
        return Path(given)
    name = "telemetry.jsonl"
    if ranks.member is not None:  # the job's rank: unique across its groups
        name = f"telemetry-{rank_member(ranks.member)}.jsonl"
    return incident_dir / facts.run_id / name


class Sentinel:
    """Watches one model, optimizer (and scaler, scheduler) of a training loop.

    ``compute_loss(model, batch)`` is the loop's forward and loss, called by
    :meth:`forward` on the real model and, on a hold, on copies; it must use the
    model it is given. ``checkpoint`` is the binding item of the state the run
    starts from, with its ``step`` (default 0) and ``verified_together`` (all
    five parts: that state is the recovery point until :meth:`checkpointed`
    names a newer one); ``data``, ``objective`` (with ``reduction``) and
    ``loader_cursor`` (a mapping, or a callable returning one at capture) are
    the other facts only the loop knows. Steps are numbered from the
    checkpoint's step + 1.

    ``scaler``: a ``torch.amp.GradScaler`` (its overflow skips are probing,
    recorded, not incidents); ``loss_scale``: a static scale the loop applies
    itself (it unscales the gradients before ``optimizer.step()``).
    ``policy``: ``hold`` (capture, then raise SentinelHold) or ``skip``
    (record, skip the update and continue; hold after ``skip_hold``
    consecutive skips). ``snapshot``: copy the parameters and the optimizer,
    scheduler and scaler state before each update, so that a non-finite update
    is rolled back (memory: one more copy of the parameters and of the
    optimizer state; ``True`` or ``"device"`` keeps it on the device,
    ``"host"`` in pinned host memory, copied on a side stream). ``replay_memory``: where a hold's replay makes room on
    the device: ``device`` (copies beside the real state), ``offload`` (the real
    gradients and optimizer state on the host while it runs, put back bit for
    bit) or ``auto`` (offload when the device's free memory is short; the
    default path on the CPU). ``telemetry``: the JSON-lines file (default
    ``<incident_dir>/<run_id>/telemetry.jsonl``; False for none).
    ``generators``: the loop's own ``torch.Generator`` objects that the forward
    draws from; their states, numpy's and Python's random are taken before
    each forward and restored for the replay (the run's are left as they were).
    ``host_random`` false skips numpy's and Python's (numpy's ``get_state``
    costs about 1 ms a forward): a replay that draws from them is then marked
    inexact. ``transient``: what a hold does when its replay on copies (the step
    run again from the same state and random state) does not come out as the
    live step did (``SentinelHold.reproduced`` NOT_REPRODUCED: a transient fault
    or a nondeterministic kernel): ``hold`` (the default) holds all the same;
    ``rerun`` holds only if the re-run failed again, else skips the step (its
    update never applied), keeps its bundle and capsule, warns
    STEP_NOT_REPRODUCED and goes on (one process; several ranks hold). The
    telemetry line's ``reproduced`` records it either way.
    ``capture_steps``: steps whose bundle is captured (a replay on
    copies, before the update, from the buffers before the forward) even when
    they go on, with the buffers their forward wrote; found in ``captured``
    (a proof of recovery needs its incident step's).
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        compute_loss: Callable[[Any, Any], Any],
        *,
        run_id: str,
        checkpoint: Mapping[str, Any],
        data: Mapping[str, Any],
        objective: Mapping[str, Any],
        loader_cursor: Cursor = None,
        scaler: Any = None,
        scheduler: Any = None,
        loss_scale: float | None = None,
        policy: Policy = "hold",
        transient: Transient = "hold",
        thresholds: Thresholds | None = None,
        snapshot: bool | SnapshotPlace = False,
        incident_dir: str | Path = "incident",
        telemetry: str | Path | Literal[False] | None = None,
        incident_owner: str = "ml-oncall",
        modules: Callable[[str, Any], bool] | None = None,
        process_group: Any = None,
        generators: Iterable[Any] = (),
        host_random: bool = True,
        replay_memory: ReplayMemory = "auto",
        capture_steps: Iterable[int] = (),
    ) -> None:
        _refuse_closure_optimizer(optimizer)
        if policy not in ("hold", "skip"):
            raise ValueError(f"policy is 'hold' or 'skip', not {policy!r}")
        if transient not in ("hold", "rerun"):
            raise ValueError(f"transient is 'hold' or 'rerun', not {transient!r}")
        if replay_memory not in REPLAY_MEMORY:
            raise ValueError(f"replay_memory is one of {REPLAY_MEMORY}, not {replay_memory!r}")
        facts = LoopFacts.of(
            run_id=run_id,
            incident_owner=incident_owner,
            checkpoint=checkpoint,
            data=data,
            objective=objective,
            loader_cursor=loader_cursor,
        )
        self.model, self.optimizer, self.compute_loss = model, optimizer, compute_loss
        self.scaler: Any = scaler if scaler is not None and scaler.is_enabled() else None
        self.scheduler = scheduler
        ranks = Ranks(process_group)
        sharded = is_fully_sharded(model)  # FSDP2: the checks read local shards
        if sharded and self.scaler is not None:
            raise ValueError(
                "a GradScaler under FSDP2 is not supported by the sentinel: use"
                " MixedPrecisionPolicy with bfloat16, or a static loss_scale"
            )
        self.generators = tuple(generators)  # the loop's own torch.Generators, replayed too
        self.host_random = host_random
        replayed, compiled = eager_module(model)
        objects = StepObjects(
            model=replayed,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=self.scaler,
            loss_scale=_static_scale(loss_scale, self.scaler),
            compute_loss=compute_loss,
            choose=modules or leaf,
            compiled=compiled,
            memory=replay_memory,
        )
        if snapshot not in (False, True, *SNAPSHOT_PLACES):
            raise ValueError(f"snapshot is True, False, 'device' or 'host', not {snapshot!r}")
        incident = Path(incident_dir)
        self._decider = StepDecider(
            objects=objects,
            facts=facts,
            ranks=ranks,
            policy=policy,
            transient=transient,
            thresholds=thresholds or Thresholds(),
            incident_dir=incident,
            local=_local_gradients(model, sharded, ranks),
            sharded=sharded,
            snapshot=self._state_snapshot(snapshot),
            telemetry=None
            if telemetry is False
            else TelemetryFile(_telemetry_path(telemetry, incident, facts, ranks)),
            capture_steps=frozenset(capture_steps),
        )
        self.last_step = self.facts.start_step  # the last step decided
        self._step: StepRecord | None = None  # forward seen, no decision yet
        # The step was not applied: its scaler.update and its scheduler.step pass.
        self._skip_update = self._skip_scheduler = False
        self._scheduler_per_step = True
        self._scheduler_calls = 0
        self._inside_scaler = False
        self._scaler_skips = False  # the decided step's GradScaler skips its update itself
        self.closed = False
        self._install()

    # The decision's own state and what it was given, read where the loop reads it.

    @property
    def facts(self) -> LoopFacts:
        return self._decider.facts

    @facts.setter
    def facts(self, restated: LoopFacts) -> None:
        """A statement restated mid-run (prove's change, said in the bundles from now on)."""
        self._decider.facts = restated

    @property
    def objects(self) -> StepObjects:
        return self._decider.objects

    @property
    def ranks(self) -> Ranks:
        return self._decider.ranks

    @property
    def sharded(self) -> bool:
        """FSDP2: the checks read local shards."""
        return self._decider.sharded

    @property
    def policy(self) -> Policy:
        return self._decider.policy

    @property
    def transient(self) -> Transient:
        return self._decider.transient

    @property
    def thresholds(self) -> Thresholds:
        return self._decider.thresholds

    @property
    def loss_scale(self) -> float | None:
        return self.objects.loss_scale

    @property
    def incident_dir(self) -> Path:
        return self._decider.incident_dir

    @property
    def capture_steps(self) -> frozenset[int]:
        """Steps whose bundle is captured whatever the verdict."""
        return self._decider.capture_steps

    @property
    def captured(self) -> dict[int, Path]:
        """The bundles of ``capture_steps``' steps, by step."""
        return self._decider.captured

    @property
    def last_known_good(self) -> dict[str, Any]:
        return self._decider.last_known_good

    @property
    def last_known_good_recovery(self) -> str:
        """``verified`` (a point the tool verified) or ``stated`` (the loop's word)."""
        return self._decider.last_known_good_recovery

    # ------------------------------------------------------------------ set-up

    def _state_snapshot(self, snapshot: bool | SnapshotPlace) -> StateSnapshot | None:
        if not snapshot:
            return None
        place: SnapshotPlace = "host" if snapshot == "host" else "device"
        return StateSnapshot(self.optimizer, self.scheduler, self.scaler, place)

    def _install(self) -> None:
        self._intercepts = Intercepts()
        self._intercepts.wrap(self.optimizer, "step", self._on_optimizer_step)
        if self.scaler is not None:
            self._intercepts.wrap(self.scaler, "step", self._on_scaler_step)
            self._intercepts.wrap(self.scaler, "update", self._on_scaler_update)
        if self.scheduler is not None:
            self._intercepts.subclass(self.scheduler, "step", self._on_scheduler_step)
        ref = weakref.ref(self)

        def flush_at_exit() -> None:
            sentinel = ref()
            if sentinel is not None and not sentinel.closed:
                sentinel._flush_quietly()

        self._at_exit = flush_at_exit
        atexit.register(flush_at_exit)

    # --------------------------------------------------------------- the loop

    def forward(self, batch: Any) -> Any:
        """``compute_loss(model, batch)``, with the RNG state and autocast regions
        taken before it (a replay repeats them) and a clone of the batch as given
        (``compute_loss`` may change it in place); call it once per micro-batch."""
        if self.closed:
            raise RuntimeError("the sentinel is closed")
        step = self._step or self._begin()
        # A clone: compute_loss may rewrite its batch in place, and the replay and
        # the input stage need the batch as given.
        rng = RngState.now(self.generators, taken_live=True, host=self.host_random)
        micro = MicroBatch(clone_batch(batch), rng, Autocast.now())
        sampling = step.sampler.hooked() if step.sampler is not None else nullcontext()
        outputs = step.outputs.hooked() if step.outputs is not None else nullcontext()
        with sampling, outputs:
            loss = self.compute_loss(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"compute_loss must return a scalar tensor, got {shape}")
        step.micro.append(micro)
        step.losses.append(loss.detach())
        return loss

    def clip_grad_norm_(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> Any:
        """``torch.nn.utils.clip_grad_norm_``, same arguments and result. Its norm is
        the gradient check (no second pass); the clipping is applied at the step,
        once the gradients are known finite, and repeated by a replay."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        step = self._step
        if step is None or not hasattr(torch.nn.utils, "get_total_norm"):
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite, foreach
            )
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if self.sharded:  # a DTensor norm, whole on every rank; the checks read its value
            total = replicated(total)
            step.clip = ClipCall(
                params, float(max_norm), float(norm_type), foreach, total, local(total)
            )
            return total
        step.clip = ClipCall(params, float(max_norm), float(norm_type), foreach, total)
        return total

    def checkpointed(
        self, checkpoint_id: str, *, verified_together: Iterable[str], step: int | None = None
    ) -> None:
        """The loop saved a checkpoint after step ``step`` (default: the last one);
        with all five parts verified together it becomes the last known-good state,
        as *stated* by the loop (RECOVERY_POINT_STATED; the bundle's checkpoint
        item says ``last_known_good_recovery: stated``): the tool checked none of
        it, :meth:`save_recovery_point` does. The last update is checked first: a
        checkpoint holding a non-finite update is never a recovery point."""
        if self._step is not None:
            raise RuntimeError("checkpointed() between a forward and its optimizer step")
        parts = list(verified_together)
        at = self.last_step if step is None else step
        point = recovery_point(checkpoint_id, at, parts)
        if point is None:
            warning = alert(
                "CHECKPOINT_NOT_RECOVERY_POINT",
                f"checkpoint {checkpoint_id} verified {sorted(parts)}, not all five parts;"
                f" the last known-good state stays {self.last_known_good['checkpoint_id']}",
            )
        else:
            warning = alert(
                "RECOVERY_POINT_STATED",
                f"checkpoint {checkpoint_id} is the last known-good state as the loop states it;"
                " the tool verified none of its parts (save_recovery_point does)",
            )
        self._decider.warn_next(warning)  # on the line of the step the checkpoint follows
        self._resolve_pending(checkpointing=checkpoint_id)  # holds on a non-finite update
        if point is not None:
            self._decider.known_good(point, "stated")

    def save_recovery_point(
        self,
        path: str | Path,
        *,
        data: Any = None,
        extra: Mapping[str, Any] | None = None,
        point_id: str | None = None,
    ) -> RecoveryPoint:
        """Write and verify a recovery point of the state after the last step:
        the sentinel's model, optimizer, scheduler, scaler and generators, the
        random states, and ``data`` (a loader or sampler with ``state_dict()``;
        default the loop's ``loader_cursor``, recorded as a cursor). The last
        update is checked first (a non-finite one holds: never a recovery
        point); the point becomes the last known-good state once verified."""
        if self._step is not None:
            raise RuntimeError("save_recovery_point() between a forward and its optimizer step")
        from nanrunbook.capture.torch.recovery import save_recovery_point

        self._resolve_pending(checkpointing=str(path))  # holds on a non-finite update
        saved = save_recovery_point(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            data=data if data is not None else self.facts.loader_cursor,
            extra=extra,
            step=self.last_step,
            run_id=self.facts.run_id,
            generators=self.generators,
            point_id=point_id,
        )
        self.resumed_from(saved)
        return saved

    def resumed_from(self, point: RecoveryPoint) -> None:
        """The last known-good state is ``point``, a recovery point the tool
        verified at the sentinel's last step (one it just saved), or, before a
        fresh sentinel's first step, the point a run resumed from with
        ``load_recovery_point``: its steps then go on from the point's."""
        if self._step is not None:
            raise RuntimeError("resumed_from() between a forward and its optimizer step")
        fresh = self.last_step == self.facts.start_step and self._decider.pending is None
        if point.step != self.last_step and not (fresh and point.step > self.last_step):
            raise ValueError(
                f"point {point.point_id} is step {point.step}, the run is at {self.last_step}"
            )
        self.last_step = point.step  # a fresh sentinel goes on from the point's step
        self._decider.known_good(point.last_known_good, "verified")

    def close(self) -> None:
        """Check the last update, write its line, and take the wrappers off."""
        if self.closed:
            return
        try:
            self._resolve_pending()
        finally:
            self._shut()

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is None:
            self.close()
        else:  # this rank alone may have raised: no collective the others would not reach
            self.ranks.alone = True
            self._flush_quietly()

    def _shut(self) -> None:
        self.closed = True
        self._intercepts.remove()
        self._decider.close()
        atexit.unregister(self._at_exit)

    def _flush_quietly(self) -> None:
        try:
            self._resolve_pending()
        except SentinelHold as hold:
            log.error("at exit: %s", hold)
        except Exception:
            log.exception("at exit: the last step's line could not be written")
        finally:
            self._shut()

    # ------------------------------------------------------------ the wrappers

    def _on_optimizer_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._inside_scaler or self.closed:
            return original(*args, **kwargs)
        if not self._decide(scaler_path=False):
            return None
        result = original(*args, **kwargs)
        self._after_update()
        return result

    def _on_scaler_step(
        self, original: Callable[..., Any], optimizer: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if self.closed or optimizer is not self.optimizer:
            return original(optimizer, *args, **kwargs)
        from torch.amp.grad_scaler import OptState

        state = self.scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.scaler.unscale_(optimizer)  # as GradScaler.step would do itself
        if not self._decide(scaler_path=True):
            return None
        self._inside_scaler = True
        try:
            result = original(optimizer, *args, **kwargs)
        finally:
            self._inside_scaler = False
        if not self._scaler_skips:
            self._after_update()
        return result

    def _on_scaler_update(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._skip_update and not self.closed:
            reset_scaler_step(self.scaler)  # the scale stays; only the step's bookkeeping goes
            return None
        return original(*args, **kwargs)

    def _on_scheduler_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._scheduler_calls += 1
        if self._skip_scheduler and self._scheduler_per_step and not self.closed:
            self._skip_scheduler = False  # only the skipped step's own call
            return None
        return original(*args, **kwargs)

    # ---------------------------------------------------------------- a step

    def _decide(self, *, scaler_path: bool) -> bool:
        """The forward's step, decided: go on with the update, or not."""
        step = self._step
        if step is None or not step.micro:
            raise RuntimeError(
                "optimizer.step() without sentinel.forward(batch) since the last step:"
                " route the loop's forward through the sentinel"
            )
        self._step, self.last_step = None, step.number
        try:
            decision = self._decider.decide(step, scaler_path=scaler_path)
        finally:  # a held step stood down too, should the loop go on after the hold
            self._skip_update = self._skip_scheduler = step.stood_down
        self._scaler_skips = decision.scaler_skips
        return decision.update

    def _after_update(self) -> None:
        self._decider.updated()

    def _resolve_pending(self, checkpointing: str | None = None) -> None:
        self._decider.resolve_pending(self.last_step, checkpointing)

    def _begin(self) -> StepRecord:
        self._scheduler_per_step = (
            self._scheduler_calls > 0 or self.last_step == self.facts.start_step
        )
        self._scheduler_calls = 0
        self._skip_update = self._skip_scheduler = False
        number = self.last_step + 1
        sampled = self._decider.sampled(number)
        self._step = StepRecord(
            number=number,
            time=time.time(),
            buffers=Buffers(self.model),
            sampler=ExtremesSampler(self.model, self.objects.choose) if sampled else None,
            outputs=OutputExtremes(self.objects.model),
        )
        return self._step

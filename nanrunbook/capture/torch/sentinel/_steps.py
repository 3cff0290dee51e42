"""One training step as the sentinel follows it: what it keeps to replay the step,
what it packs into the step's one host read, and what it reads back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from nanrunbook.capture.telemetry import (
    finite_or_none,
    headroom_bits,
    loss_class,
    mean_loss,
)
from nanrunbook.capture.torch.replay import Clipping, ExtremesSampler, MicroBatch, OutputExtremes
from nanrunbook.capture.torch.sentinel._checks import (
    Counted,
    GradNorms,
    Readout,
    exact_counts,
    joined,
    max_rows,
    nonfinite_flag,
)
from nanrunbook.capture.torch.sentinel._snapshot import Buffers
from nanrunbook.records import nonfinite_count
from nanrunbook.telemetry.record import (
    ActivationStats,
    GradientStats,
    HeadroomSource,
    LossClass,
    TelemetryWarning,
    UpdateStats,
)

__all__ = ["ClipCall", "GradFindings", "StepRecord", "update_extremes"]


@dataclass
class ClipCall:
    """A ``clip_grad_norm_`` the loop routed through the sentinel: the norm is
    computed at once (and is the gradient check); the clipping itself waits for
    the decision, so a tripped check still sees the gradients unclipped."""

    params: list[Any]
    max_norm: float
    norm_type: float
    foreach: bool | None
    total: Any
    local_total: Any = None  # under FSDP2: ``total`` (a DTensor) as a local tensor
    applied: bool = False

    @property
    def checked(self) -> Any:
        """The norm the checks read: a tensor on this rank."""
        return self.total if self.local_total is None else self.local_total

    def apply(self) -> None:
        if not self.applied:
            torch.nn.utils.clip_grads_with_norm_(
                self.params, self.max_norm, self.total, foreach=self.foreach
            )
            self.applied = True

    def bounds_every_gradient(self, params: list[Any]) -> bool:
        """Whether the total norm bounds every element of the step's gradients
        (|g_i| <= ||g||_p for any p > 0): it does when it was taken over all
        of ``params`` that have one."""
        clipped = {id(p) for p in self.params}
        return self.norm_type > 0 and all(id(p) in clipped for p in params if p.grad is not None)

    def recipe(self) -> Clipping:
        return Clipping(
            self.max_norm, self.norm_type, tuple(id(p) for p in self.params), self.foreach
        )


@dataclass
class GradFindings:
    """The gradients as the decision saw them."""

    counts: list[Counted] = field(default_factory=list)  # exact, when counted
    norm: float | None = None
    bounds: dict[str, float] = field(default_factory=dict)  # per dtype, over max abs
    bounds_from: HeadroomSource | None = None  # what bounds came from
    found_inf: bool | None = None
    tripped: bool = False  # the cheap check says non-finite
    local_finite: bool | None = None  # this rank's own, before the all-reduce (DDP)

    @property
    def nonfinite(self) -> int:
        return sum(nonfinite_count(c) for c in self.counts)

    def headroom_from(self, grad: GradientStats) -> HeadroomSource | None:
        """What :meth:`telemetry`'s headroom was taken from (None: no headroom)."""
        if grad.headroom_bits is None:
            return None
        return "max_abs" if self.counts else self.bounds_from

    def telemetry(self, fallback_dtype: str | None) -> GradientStats:
        """Exact magnitudes when counted; otherwise the per-tensor norms, which
        bound max abs from above, give a headroom that is a lower bound."""
        if self.counts:
            sources = [(c.max_abs, c.dtype) for c in self.counts]
        else:
            sources = [(bound, dtype) for dtype, bound in self.bounds.items()]
        worst_bits: float | None = None
        worst_dtype = fallback_dtype
        for magnitude, dtype in sources:
            bits = headroom_bits(magnitude, dtype)
            if bits is not None and (worst_bits is None or bits < worst_bits):
                worst_bits, worst_dtype = bits, dtype
        max_abs = max((c.max_abs for c in self.counts if c.max_abs is not None), default=None)
        return GradientStats(
            nan=sum(c.nan for c in self.counts),
            posinf=sum(c.posinf for c in self.counts),
            neginf=sum(c.neginf for c in self.counts),
            max_abs=finite_or_none(max_abs),
            dtype=worst_dtype,
            headroom_bits=worst_bits,
            norm=finite_or_none(self.norm),
        )


@dataclass
class StepRecord:
    """Everything kept of one step, from its first forward to its line."""

    number: int
    time: float
    buffers: Buffers
    sampler: ExtremesSampler | None
    micro: list[MicroBatch] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)  # detached, on their device
    clip: ClipCall | None = None
    # Filled at the decision.
    sampled_names: list[str] = field(default_factory=list)  # dtypes of exact gradient rows
    loss_values: list[float] = field(default_factory=list)
    grads: GradFindings = field(default_factory=GradFindings)
    scale: float | None = None
    activations: ActivationStats | None = None
    warnings: list[TelemetryWarning] = field(default_factory=list)
    lr: float | None = None
    stood_down: bool = False  # nothing of it steps: its scaler.update and scheduler.step pass
    # After the update: its flag (read at the next decision) and exact rows.
    updated: list[Any] = field(default_factory=list)
    before: list[Any] | None = None  # parameters before the update (sampled steps)
    update_flag: Any = None
    update_max: tuple[list[str], Any] | None = None  # sampled: max abs of the update
    update: UpdateStats | None = None
    weight_norm: float | None = None  # the updated parameters' L2 norm (the update flag)
    # Every step: the model's reduced-precision output extremes (on the device).
    outputs: OutputExtremes | None = None
    output: ActivationStats | None = None

    @property
    def loss(self) -> float | None:
        return mean_loss(self.loss_values)

    @property
    def loss_class(self) -> LossClass:
        return loss_class(self.loss_values)

    # ------------------------------------------------------------ the one read

    def pack_losses(self, readout: Readout) -> None:
        readout.add("loss", torch.stack([loss.reshape(()).double() for loss in self.losses]))

    def pack_sampled(self, readout: Readout, grads: list[Any]) -> list[str]:
        """On a sampled step: the gradients' max abs per dtype and the activation
        extremes; returns the dtype names of the maxima."""
        names, maxima = max_rows(grads)
        if names:
            readout.add("grad_max", maxima)
        sampler = self.sampler
        if sampler is not None and sampler.values:
            readout.add("act", torch.stack(joined(sampler.values)))
        return names

    def pack_outputs(self, readout: Readout) -> None:
        outputs = self.outputs
        if outputs is not None and outputs.values:
            device = outputs.values[0].device
            readout.add("out_max", torch.stack([v.to(device) for v in outputs.values]))

    def read_outputs(self, values: dict[str, list[float]]) -> None:
        """The output with the least headroom (non-finite ones named apart)."""
        outputs = self.outputs
        if outputs is None or "out_max" not in values:
            return
        pairs = list(zip(values["out_max"], outputs.dtypes, strict=True))
        finite = [(headroom_bits(v, d), v, d) for v, d in pairs if math.isfinite(v)]
        known = [(b, v, d) for b, v, d in finite if b is not None]
        bits, top, dtype = min(known, default=(None, None, None))
        self.output = ActivationStats(
            max_abs=top,
            where="output" if top is not None else None,
            dtype=dtype,
            headroom_bits=bits,
            nonfinite=("output",) if len(finite) < len(pairs) else (),
        )

    def read_activations(self, values: dict[str, list[float]]) -> None:
        sampler = self.sampler
        if sampler is None:
            return
        extremes = values.get("act", [])
        finite = [
            (v, n, d)
            for v, n, d in zip(extremes, sampler.names, sampler.dtypes, strict=True)
            if math.isfinite(v)
        ]
        nonfinite = tuple(
            n for v, n in zip(extremes, sampler.names, strict=True) if not math.isfinite(v)
        )
        top = max(finite, key=lambda item: item[0], default=None)
        self.activations = ActivationStats(
            max_abs=top[0] if top else None,
            where=top[1] if top else None,
            dtype=top[2] if top else None,
            headroom_bits=headroom_bits(top[0], top[2]) if top else None,
            nonfinite=nonfinite,
        )

    def activation_extremes(
        self, values: dict[str, list[float]]
    ) -> list[tuple[float | None, str | None]]:
        sampler = self.sampler
        if sampler is None:
            return []
        return [
            (v if math.isfinite(v) else None, d)
            for v, d in zip(values.get("act", []), sampler.dtypes, strict=True)
        ]

    # --------------------------------------------------------------- the update

    def watch_update(self, params: list[Any], before: list[Any] | None) -> None:
        """After ``step()``: the flag of the updated parameters, and on a sampled
        step (``before`` given) the exact rows of the update itself."""
        with torch.no_grad():
            self.updated = params
            self.update_flag = nonfinite_flag([p.detach() for p in params])
            if before is not None:
                self.update_max = update_extremes(params, before)

    def pack_update(self, readout: Readout) -> None:
        readout.add("update_flag", self.update_flag)
        if self.update_max is not None and self.update_max[0]:
            readout.add("update_max", self.update_max[1])

    def read_update(self, values: dict[str, list[float]]) -> bool:
        """Fill :attr:`update` from the read; True when the update is finite (an
        exact count settles a tripped flag, with a read of its own)."""
        max_abs = None
        if "update_max" in values and all(math.isfinite(v) for v in values["update_max"]):
            max_abs = max(values["update_max"])
        if math.isfinite(values["update_flag"][0]):
            self.weight_norm = values["update_flag"][0]  # the flag is their L2 norm
            self.update = UpdateStats(max_abs=max_abs)
            return True
        rows = exact_counts([p.detach() for p in self.updated])
        self.update = UpdateStats(
            nan=sum(c.nan for c in rows),
            posinf=sum(c.posinf for c in rows),
            neginf=sum(c.neginf for c in rows),
            max_abs=max_abs,
        )
        return not (self.update.nan or self.update.posinf or self.update.neginf)


def update_extremes(params: list[Any], before: list[Any]) -> tuple[list[str], Any]:
    """The update's largest magnitude, as :func:`max_rows` gives it for the float32
    deltas (one ``F32`` row), but with one parameter's delta alive at a time: the
    extra memory is that of the largest parameter, not of them all in float32."""
    maxima = [
        (p.detach().float() - b.float()).abs().amax()
        for p, b in zip(params, before, strict=True)
        if p.is_floating_point() and p.numel()
    ]
    if not maxima:
        return [], torch.zeros(0)
    return ["F32"], torch.stack(maxima).amax().reshape(1)


def grad_probe(
    readout: Readout, grads: list[Any], clip: ClipCall | None, found_inf: Any
) -> GradNorms | None:
    """Pack what the gradient check needs: the norm clipping computed (the loop's
    answer), else the scaler's found_inf (its answer), else a fused norm."""
    if clip is not None:
        readout.add("norm", clip.checked)
    if found_inf is not None:
        readout.add("found_inf", found_inf)
    if clip is not None or found_inf is not None:
        return None
    norms = GradNorms.of(grads)
    if norms is not None:
        readout.add("norm", norms.total)
        for dtype, bound in norms.bounds.items():
            readout.add(f"bound/{dtype}", bound)
    return norms

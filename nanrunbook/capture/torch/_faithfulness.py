"""What decides whether a replay repeats the live step: the random states torch's
fork does not cover (numpy's, Python's, the loop's own ``torch.Generator``s),
the determinism and TF32 flags, and the device the step ran on.

Binding details are strings or numbers (spec section 2): flags are written as
``"true"``/``"false"``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["HostRandom", "determinism_facts", "device_facts", "inexact_kernels", "kept"]


def _flag(value: Any) -> str:
    return "true" if value else "false"


@dataclass(frozen=True)
class HostRandom:
    """numpy's global state, Python's ``random`` state and the given generators'
    states; ``taken_live``: taken before the live forward (else at the replay,
    not known to be the live step's)."""

    numpy: Any  # None: not taken (numpy's get_state costs about 1 ms)
    python: Any
    generators: tuple[tuple[Any, Any], ...] = ()  # (generator, its state)
    taken_live: bool = False

    @classmethod
    def now(
        cls, generators: Sequence[Any] = (), *, taken_live: bool = False, streams: bool = True
    ) -> HostRandom:
        """``streams`` false: the generators only, not numpy's and Python's."""
        return cls(
            np.random.get_state() if streams else None,
            random.getstate() if streams else None,
            tuple((g, g.get_state()) for g in generators),
            taken_live,
        )

    def restore(self) -> None:
        if self.numpy is not None:
            np.random.set_state(self.numpy)
        if self.python is not None:
            random.setstate(self.python)
        for generator, state in self.generators:
            generator.set_state(state)

    def same_as_now(self) -> bool:
        """Nothing drew from numpy's or Python's random since this was taken."""
        now = np.random.get_state()
        numpy_same = all(
            np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
            for a, b in zip(self.numpy, now, strict=True)
        )
        return numpy_same and self.python == random.getstate()

    def fields(self) -> dict[str, Any]:
        """The random_state binding's details for these states."""
        source = "restored" if self.taken_live and self.numpy is not None else "current-at-replay"
        return {"numpy": source, "python_random": source, "generators": len(self.generators)}


@contextmanager
def kept(generators: Sequence[Any] = ()) -> Iterator[None]:
    """Put numpy's, Python's and the generators' states back afterwards: a replay
    never advances the run's own random streams (torch's fork covers torch's)."""
    saved = HostRandom.now(generators)
    try:
        yield
    finally:
        saved.restore()


def determinism_facts() -> dict[str, str]:
    """The flags that let kernels differ between two runs of one step."""
    matmul = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": _flag(torch.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": _flag(torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": _flag(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": _flag(torch.backends.cudnn.benchmark),
        "cudnn_allow_tf32": _flag(torch.backends.cudnn.allow_tf32),
        "matmul_allow_tf32": _flag(matmul.allow_tf32),
        "matmul_fp16_reduced_precision": _flag(matmul.allow_fp16_reduced_precision_reduction),
        "matmul_bf16_reduced_precision": _flag(matmul.allow_bf16_reduced_precision_reduction),
        "float32_matmul_precision": str(torch.get_float32_matmul_precision()),
    }


def inexact_kernels(device: Any) -> list[str]:
    """Why kernels on ``device`` may differ in a replay (CPU kernels are taken as
    deterministic; CUDA ones are not unless the loop asked)."""
    if torch.device(device).type != "cuda":
        return []
    reasons = []
    if not torch.are_deterministic_algorithms_enabled():
        reasons.append("non-deterministic CUDA kernels allowed (deterministic algorithms off)")
    if torch.backends.cudnn.benchmark:
        reasons.append("cudnn.benchmark may choose other kernels in the replay")
    return reasons


def _version(number: int) -> str:
    """A CUDA-style version integer (12020) as text (12.2)."""
    return f"{number // 1000}.{number % 1000 // 10}"


def device_facts(device: Any) -> dict[str, Any]:
    """What torch exposes about the device the step ran on; a CPU run records
    ``device: cpu``. Each fact is guarded: what torch cannot say is left out
    (the CUDA version is the environment item's own ``cuda``)."""
    place = torch.device(device)
    facts: dict[str, Any] = {"device": str(place)}
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit():
        facts["local_rank"] = int(local_rank)
    if place.type != "cuda" or not torch.cuda.is_available():
        return facts
    index = place.index if place.index is not None else torch.cuda.current_device()
    facts["device"] = f"cuda:{index}"
    facts["device_index"] = int(index)
    try:
        props = torch.cuda.get_device_properties(index)
        facts["gpu_name"] = str(props.name)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            facts["gpu_uuid"] = f"GPU-{uuid}"
        facts["compute_capability"] = f"{props.major}.{props.minor}"
    except (RuntimeError, AssertionError) as error:  # a device torch cannot query
        facts["device_error"] = str(error).splitlines()[0][:200] if str(error) else "unknown"
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)
    if driver is not None:
        with suppress(RuntimeError):
            facts["driver"] = _version(int(driver()))
    backend = torch.backends.cudnn
    cudnn = backend.version() if backend.is_available() else None  # type: ignore[no-untyped-call]
    if cudnn:
        facts["cudnn"] = str(cudnn)
    try:
        nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        facts["nccl"] = (
            ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
        )
    except (AttributeError, RuntimeError):
        pass
    return facts

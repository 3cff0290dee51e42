"""PyTorch capture: the training-loop sentinel, replays of a step on copies, and
torch tensors as safetensors bytes.

Needs the optional extra ``nanrunbook[torch]``; torch is imported only under
this package, and importing it registers torch tensors with the (framework-free)
:class:`~nanrunbook.capture.BundleWriter`.

* :class:`Sentinel` lives in the training loop: it checks every step's loss,
  gradients and update, holds the update on a non-finite value, captures the
  failing step's bundle and raises :class:`SentinelHold`, writes one telemetry
  line per step and warns early (see ``nanrunbook-sentinel(7)``).
* :func:`tensor_to_raw` turns a tensor of any device and any dtype safetensors
  names (bool, integers, F16/BF16/F32/F64, C64, the float8 variants and packed
  ``float4_e2m1fn_x2``) into :class:`~nanrunbook.capture.RawTensor` bytes.
* :func:`replay_step` runs one training step on deep copies of the model, the
  optimizer and the GradScaler, so the real run's state is untouched ("reproduce
  without an update"), and captures its five boundaries.
* :func:`probe` names a tensor made between modules so that a replay captures it
  in execution order.
* :class:`Capsule` opens a held step's capsule (written beside its bundle at a
  hold), verifies it, and replays the step after the process is gone, as
  recorded or with one mechanism changed (``nanrunbook replay``).
* :func:`shrink_step` shrinks a failing step by replays on copies: the first
  operation that went non-finite, a smallest batch of examples for it, and
  optionally a regression fixture; :class:`ShrinkOnHold` is the sentinel's
  hook for the same on a hold.
* :func:`save_recovery_point` writes a recovery point (model, optimizer,
  scheduler, scaler, data position, random states; DCP and a SHA-256 manifest,
  atomically) and :func:`load_recovery_point` verifies one, then restores it
  bit for bit; :func:`verify_recovery_point` and :func:`latest_recovery_point`
  read without unpickling.
"""

from nanrunbook.capture.incident import SentinelHold
from nanrunbook.capture.telemetry import Thresholds
from nanrunbook.capture.torch._convert import TORCH_DTYPES, tensor_to_raw
from nanrunbook.capture.torch.capsule import Capsule
from nanrunbook.capture.torch.recovery import (
    LoadedRecoveryPoint,
    RecoveryPoint,
    latest_recovery_point,
    load_recovery_point,
    prove_recovery,
    save_recovery_point,
    verify_recovery_point,
)
from nanrunbook.capture.torch.replay import probe, replay_step
from nanrunbook.capture.torch.sentinel import Sentinel
from nanrunbook.capture.torch.shrink import FailingStep, ShrinkOnHold, shrink_step

__all__ = [
    "TORCH_DTYPES",
    "Capsule",
    "FailingStep",
    "LoadedRecoveryPoint",
    "RecoveryPoint",
    "Sentinel",
    "SentinelHold",
    "ShrinkOnHold",
    "Thresholds",
    "latest_recovery_point",
    "load_recovery_point",
    "probe",
    "prove_recovery",
    "replay_step",
    "save_recovery_point",
    "shrink_step",
    "tensor_to_raw",
    "verify_recovery_point",
]

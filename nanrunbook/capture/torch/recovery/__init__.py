"""Recovery points the tool writes and verifies, instead of taking the loop's
word: :func:`save_recovery_point` (model, optimizer, scheduler, GradScaler,
data position and random states through torch.distributed.checkpoint, one
SHA-256 manifest written last, atomically), :func:`load_recovery_point`
(verify, then restore bit for bit) and :func:`prove_recovery` (resume, run
through the incident step with one change and N more steps under the
sentinel, and write the recovery record). Verification itself is torch-free:
``nanrunbook.capture.recovery.verify_recovery_point``.
"""

from nanrunbook.capture.recovery import (
    RecoveryPoint,
    RecoveryVerification,
    latest_recovery_point,
    verify_recovery_point,
)
from nanrunbook.capture.torch._entry import Built, EntryError
from nanrunbook.capture.torch.recovery._point import (
    LoadedRecoveryPoint,
    load_recovery_point,
    save_recovery_point,
    state_digest,
)
from nanrunbook.capture.torch.recovery._prove import prove_recovery

__all__ = [
    "Built",
    "EntryError",
    "LoadedRecoveryPoint",
    "RecoveryPoint",
    "RecoveryVerification",
    "latest_recovery_point",
    "load_recovery_point",
    "prove_recovery",
    "save_recovery_point",
    "state_digest",
    "verify_recovery_point",
]

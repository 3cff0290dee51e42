"""Every early-warning code nanrunbook can report, with its one-line meaning.

Warnings never change a decision or the verdict's exit code. The check's report
and the sentinel's telemetry use the same code where they mean the same thing.
Codes are stable: alerting rules match on them.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["WARNING_CODES"]

WARNING_CODES = MappingProxyType(
    {
        "AT_DTYPE_MAX": "a finite value equals its dtype's largest finite value (saturated)",
        "NEAR_DTYPE_MAX": (
            "a finite value is less than 1 bit (by default) below its dtype's, or the stage's"
            " compute dtype's, largest finite value"
        ),
        "BEYOND_COMPUTE_DTYPE": "a finite value the stage's compute dtype cannot represent",
        "GRADIENT_UNDERFLOW": (
            "a share of zero or subnormal F16/BF16 gradients above the threshold,"
            " or all-zero gradients under a loss scale"
        ),
        # Derived by `nanrunbook watch` from the telemetry's gradient headroom.
        "HEADROOM_FALLING": (
            "the trend of gradient headroom over the last window reaches the dtype's max"
            " within a window's steps"
        ),
        # The training-loop sentinel's (nanrunbook.capture.torch.Sentinel) telemetry.
        "GRAD_NORM_SPIKE": (
            "the gradient norm is above a multiple of the median of the recent window"
        ),
        # Divergence from the first few steps (nanrunbook.telemetry._early): the
        # sentinel's lines carry them; watch derives them again from the series.
        "LOSS_DIVERGENCE": (
            "the loss is several times its running minimum and far above its median"
            " (in MADs) of the steps seen so far"
        ),
        "GRAD_NORM_DIVERGENCE": (
            "the gradient norm is several times its running minimum and far above its"
            " median (in MADs) of the steps seen so far"
        ),
        "WEIGHT_NORM_GROWTH": (
            "the parameters' L2 norm is several times its running minimum and far above"
            " its median (in MADs) of the steps seen so far"
        ),
        "GRAD_NORM_OVERFLOW": (
            "the gradient norm overflows float32 while every gradient is finite"
        ),
        "LOSS_SCALE_BACKOFF_STREAK": "the dynamic loss scale backed off several steps in a row",
        "LOSS_SCALE_BELOW_FLOOR": "the dynamic loss scale fell below the floor",
        "SKIPPED_UPDATE_STREAK": "several consecutive steps were skipped without an update",
        # The check's own: a bundle that is one rank of several, checked alone.
        "SET_MEMBER_ALONE": (
            "one rank's bundle of a job of several ranks checked without its incident set;"
            " the set's verdict is the directory that holds it"
        ),
        "CHECKPOINT_NOT_RECOVERY_POINT": (
            "a checkpoint did not verify all five recovery parts together;"
            " the last known-good state stays the previous one"
        ),
        "RECOVERY_POINT_STATED": (
            "the loop stated a checkpoint as the last known-good state (checkpointed());"
            " the tool verified none of its parts"
        ),
        "TELEMETRY_LINES_LOST": (
            "telemetry lines could not be written (a full disk, say): how many, between"
            " which steps; training went on"
        ),
        "STEP_NOT_REPRODUCED": (
            "a non-finite step did not come back when run again from the same state and"
            " random state (transient='rerun'): skipped, its evidence kept, training went on"
        ),
    }
)

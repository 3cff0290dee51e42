"""Capture API: write evidence bundles from training code.

``BundleWriter`` takes numpy arrays, torch tensors (any device; the optional
``nanrunbook[torch]`` extra) or :class:`RawTensor` bytes for dtypes numpy lacks.
``nanrunbook.capture.torch`` adds ``replay_step``, which replays a failing step on
copies and captures its five boundaries.
"""

from nanrunbook.capture.writer import BundleWriter, RawTensor, as_raw

__all__ = ["BundleWriter", "RawTensor", "as_raw"]

"""Capture API: write evidence bundles from training code.

``BundleWriter`` takes numpy arrays, :class:`RawTensor` bytes for dtypes numpy
lacks, and a framework's tensors once its capture module is imported
(``nanrunbook.capture.torch``, the optional ``nanrunbook[torch]`` extra, which
also holds the training-loop sentinel and ``replay_step``). The writer imports
no framework.
"""

from nanrunbook.capture.writer import BundleWriter, RawTensor, as_raw, register_converter

__all__ = ["BundleWriter", "RawTensor", "as_raw", "register_converter"]

"""The sentinel inside the training frameworks that write the loop for the user.

One module per framework, each importing its framework (and torch) only there,
so that importing this package costs nothing:

* :mod:`nanrunbook.capture.adapters.transformers`: ``SentinelTrainer`` and
  ``SentinelTrainerMixin`` for ``transformers.Trainer`` (extra ``nanrunbook[hf]``).
* :mod:`nanrunbook.capture.adapters.lightning`: ``SentinelCallback`` for a
  PyTorch Lightning ``Trainer`` (extra ``nanrunbook[lightning]``).
* :mod:`nanrunbook.capture.adapters.accelerate`: ``watch_accelerate`` for an
  Accelerate loop (extra ``nanrunbook[accelerate]``).

Each adapter builds a :class:`nanrunbook.capture.torch.Sentinel` on the
framework's own model, optimizer and scheduler, and keeps every promise the
sentinel keeps in a plain loop (``nanrunbook-sentinel(7)``).
"""

"""The user's build entry (``--entry module:function``) and the command line's
mechanism changes (``--change MECHANISM=VALUE``): the one protocol of
``nanrunbook replay`` and ``nanrunbook prove``, and of every command that
rebuilds a training run from the user's own code.

The protocol: the entry is called with no argument and returns the run's
objects, as a dict or a dataclass instance with these fields:

* ``model`` (an ``nn.Module``), ``optimizer`` (a ``torch.optim.Optimizer``) and
  ``compute_loss`` (``compute_loss(model, batch)``, the loop's own), required;
* ``scheduler``, ``scaler`` (a ``torch.amp.GradScaler``), optional (None);
* ``modules`` (the sentinel's ``modules=`` predicate) and ``generators`` (the
  loop's own ``torch.Generator`` objects, in the sentinel's order), optional;
* ``loader`` (the run's batches in order; with ``state_dict()`` and
  ``load_state_dict()`` its position is restored) and ``sentinel`` (more
  keyword arguments for the ``Sentinel``: ``thresholds``, ``snapshot``...):
  what a resumed run needs (``prove`` requires ``loader``); a replay from a
  capsule takes the step's batch and recipe from the capsule and ignores them.

Nothing else is accepted: a misspelt field is an error, not a default.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanrunbook.capture._changes import Change, ChangeRefused, parse_change

__all__ = [
    "ENTRY_FIELDS",
    "Built",
    "EntryError",
    "build",
    "built_from",
    "built_objects",
    "load_entry",
    "parse_changes",
]

REQUIRED = ("model", "optimizer", "compute_loss")
OPTIONAL = ("scheduler", "scaler", "modules", "generators", "loader", "sentinel")
ENTRY_FIELDS = (*REQUIRED, *OPTIONAL)


class EntryError(ValueError):
    """The entry cannot be imported, is not callable, fails or returns the wrong
    things; or a change names no mechanism. A usage error (exit 2): its message
    is one line (an import's own error line included)."""


@dataclass(frozen=True)
class Built:
    """The objects an entry built, checked."""

    model: Any
    optimizer: Any
    compute_loss: Callable[[Any, Any], Any]
    scheduler: Any = None
    scaler: Any = None
    modules: Callable[[str, Any], bool] | None = None
    generators: tuple[Any, ...] = ()
    loader: Iterable[Any] | None = None
    sentinel: Mapping[str, Any] = field(default_factory=dict)


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def load_entry(spec: str) -> Callable[[], Any]:
    """The function ``module:function`` names (``module`` found from the current
    directory first, as ``python -m`` would find it)."""
    module_name, colon, function = spec.partition(":")
    if not colon or not module_name or not function:
        raise EntryError(f"--entry {spec!r}: expected module:function (e.g. train:build)")
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except BaseException as error:  # the user's code: whatever it raises is its message
        if isinstance(error, KeyboardInterrupt):
            raise
        raise EntryError(
            f"--entry {spec}: cannot import {module_name}: {_error_line(error)}"
        ) from None
    finally:
        if added:
            sys.path.remove(here)
    found: Any = module
    for part in function.split("."):
        if not hasattr(found, part):
            raise EntryError(f"--entry {spec}: {module_name} has no {function}")
        found = getattr(found, part)
    if not callable(found):
        raise EntryError(f"--entry {spec}: {function} is a {type(found).__name__}, not callable")
    return found  # type: ignore[no-any-return]


def _fields(value: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return dict(value)
    raise EntryError(
        f"the entry returned a {type(value).__name__}: expected a dict or a dataclass with"
        f" {', '.join(REQUIRED)} (and optionally {', '.join(OPTIONAL)})"
    )


def built_objects(value: Any, *, needs: Sequence[str] = ()) -> Built:
    """What an entry returned, checked against the protocol; ``needs`` names
    the optional fields the caller cannot do without."""
    fields = _fields(value)
    unknown = sorted(set(fields) - set(ENTRY_FIELDS))
    missing = [name for name in (*REQUIRED, *needs) if fields.get(name) is None]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if unknown:
        problems.append(f"unknown field(s) {', '.join(map(repr, unknown))}")
    if not problems:
        checks = (
            ("model", torch.nn.Module),
            ("optimizer", torch.optim.Optimizer),
        )
        for name, kind in checks:
            if not isinstance(fields[name], kind):
                problems.append(f"{name} is a {type(fields[name]).__name__}, not a {kind.__name__}")
        if not callable(fields["compute_loss"]):
            problems.append("compute_loss is not callable")
        scaler = fields.get("scaler")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            problems.append(f"scaler is a {type(scaler).__name__}, not a torch.amp.GradScaler")
        generators = fields.get("generators") or ()
        if not isinstance(generators, Iterable) or not all(
            isinstance(g, torch.Generator) for g in generators
        ):
            problems.append("generators is not a sequence of torch.Generator")
        loader = fields.get("loader")
        if loader is not None and not isinstance(loader, Iterable):
            problems.append(f"loader is a {type(loader).__name__}, not an iterable of batches")
        sentinel = fields.get("sentinel") or {}
        if not isinstance(sentinel, Mapping) or not all(isinstance(k, str) for k in sentinel):
            problems.append("sentinel is not a mapping of Sentinel keyword arguments")
    if problems:
        raise EntryError(f"the entry returned the wrong things: {'; '.join(problems)}")
    return Built(
        model=fields["model"],
        optimizer=fields["optimizer"],
        compute_loss=fields["compute_loss"],
        scheduler=fields.get("scheduler"),
        scaler=fields.get("scaler"),
        modules=fields.get("modules"),
        generators=tuple(fields.get("generators") or ()),
        loader=fields.get("loader"),
        sentinel=dict(fields.get("sentinel") or {}),
    )


def build(entry: Callable[[], Any], *, needs: Sequence[str] = ()) -> Built:
    """Call the entry and check what it returned (``needs``: as :func:`built_objects`)."""
    try:
        value = entry()
    except EntryError:
        raise  # a loader of the entry (load_entry inside it) already said what is wrong
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt):
            raise
        name = getattr(entry, "__qualname__", repr(entry))
        raise EntryError(f"the entry {name}() failed: {_error_line(error)}") from None
    return built_objects(value, needs=needs)


def built_from(value: Any, *, needs: Sequence[str] = ()) -> Built:
    """``value`` as a checked :class:`Built`: one already (its ``needs`` checked),
    the entry function (called: :func:`build`) or what an entry returned."""
    if isinstance(value, Built):
        missing = [name for name in needs if getattr(value, name) is None]
        if missing:
            raise EntryError(f"the entry returned the wrong things: missing {', '.join(missing)}")
        return value
    if callable(value):
        return build(value, needs=needs)
    return built_objects(value, needs=needs)


def parse_changes(texts: Sequence[str]) -> tuple[Change, ...]:
    """Each ``MECHANISM=VALUE``; EntryError (listing the valid forms) for one that
    names no mechanism or no valid value."""
    try:
        return tuple(parse_change(text) for text in texts)
    except ChangeRefused as error:
        raise EntryError(str(error)) from None

"""The sentinel's hold on a loop's own calls: ``optimizer.step``, ``scaler.step``,
``scaler.update`` and ``scheduler.step`` are wrapped on the instances (never on
their classes), so the loop keeps calling them as it did.

Each wrapper is a method bound to its instance, as the one it replaces, so a
learning-rate scheduler built afterwards can wrap it in turn. A scheduler is
different: its ``state_dict()`` is its instance ``__dict__``, so a wrapper there
would be saved into every checkpoint. Its ``step`` is overridden instead by
giving that one instance a subclass of its own class (``isinstance`` holds; the
state_dict stays what it was), undone by :meth:`Intercepts.remove`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

__all__ = ["Intercepts"]

Handler = Callable[..., Any]


class Intercepts:
    """Installed wrappers, each remembered so that :meth:`remove` puts back what
    was there before."""

    def __init__(self) -> None:
        self._installed: list[tuple[Any, str, Any, bool, Any]] = []
        self._classes: list[tuple[Any, type, type, str]] = []

    def wrap(self, obj: Any, name: str, handler: Handler) -> None:
        """``obj.<name>(*a, **k)`` becomes ``handler(original, *a, **k)``."""
        had_own = name in vars(obj)
        original = getattr(obj, name)

        def method(bound_to: Any, *args: Any, **kwargs: Any) -> Any:
            return handler(original, *args, **kwargs)

        method.__name__ = getattr(original, "__name__", name)
        method.__doc__ = getattr(original, "__doc__", None)
        # Markers others set on the original (a scheduler's _wrapped_by_lr_sched) stay.
        method.__dict__.update(getattr(original, "__dict__", {}))
        wrapper = types.MethodType(method, obj)
        setattr(obj, name, wrapper)
        self._installed.append((obj, name, original if had_own else None, had_own, method))

    def subclass(self, obj: Any, name: str, handler: Handler) -> None:
        """Like :meth:`wrap`, through a subclass made for ``obj`` alone."""
        cls = type(obj)
        inherited = getattr(cls, name)

        def method(bound_to: Any, *args: Any, **kwargs: Any) -> Any:
            return handler(inherited.__get__(bound_to, cls), *args, **kwargs)

        method.__name__ = name
        method.__doc__ = getattr(inherited, "__doc__", None)
        watched = type(cls.__name__, (cls,), {name: method, "__module__": cls.__module__})
        watched.__qualname__ = cls.__qualname__
        obj.__class__ = watched
        self._classes.append((obj, cls, watched, name))

    def remove(self) -> None:
        """Put back each original where the wrapper is still the one installed (a
        wrapper someone wrapped again stays; it then passes calls through)."""
        for obj, name, original, had_own, method in reversed(self._installed):
            current = vars(obj).get(name)
            if getattr(current, "__func__", None) is not method:
                continue
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self._installed.clear()
        for obj, cls, watched, name in reversed(self._classes):
            if type(obj) is watched:
                obj.__class__ = cls
                # A class lives in a reference cycle of its own: its method, which
                # holds the sentinel, would keep the sentinel and the model (under
                # DDP, the process group and its threads) until a garbage
                # collection, perhaps none before interpreter shutdown.
                delattr(watched, name)
        self._classes.clear()

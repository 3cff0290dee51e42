"""Output formats by name: ``text`` (rich), ``json``, ``kv``.

Each format is a :class:`~nanrunbook.output.base.Renderer` in a module of its
own; a command looks its renderer up here by the ``--format`` name. A format's
module is imported when it is first looked up: ``check --format kv`` need not
import the text renderer and rich (a few hundredths of a second of every run).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from nanrunbook.output.base import Renderer

__all__ = ["RENDERERS", "Renderer"]

# format name -> (module, class) of its renderer
_BY_NAME: dict[str, tuple[str, str]] = {
    "text": ("nanrunbook.output.text", "TextRenderer"),
    "json": ("nanrunbook.output.json", "JsonRenderer"),
    "kv": ("nanrunbook.output.kv", "KvRenderer"),
}


class _Renderers(Mapping[str, Renderer]):
    """The renderers by format name, each made on its first lookup."""

    def __init__(self) -> None:
        self._made: dict[str, Renderer] = {}

    def __getitem__(self, name: str) -> Renderer:
        made = self._made.get(name)
        if made is None:
            module, cls = _BY_NAME[name]
            made = self._made[name] = getattr(importlib.import_module(module), cls)()
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(_BY_NAME)

    def __len__(self) -> int:
        return len(_BY_NAME)


RENDERERS: Mapping[str, Renderer] = _Renderers()

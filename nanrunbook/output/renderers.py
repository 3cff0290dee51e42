"""Output formats by name: ``text`` (rich), ``json``, ``kv``.

Each format is a :class:`~nanrunbook.output.base.Renderer` in a module of its
own; a command looks its renderer up here by the ``--format`` name.
"""

from __future__ import annotations

from nanrunbook.output.base import Renderer
from nanrunbook.output.json import JsonRenderer
from nanrunbook.output.kv import KvRenderer, kv_where
from nanrunbook.output.text import TextRenderer

__all__ = ["RENDERERS", "JsonRenderer", "KvRenderer", "Renderer", "TextRenderer", "kv_where"]

RENDERERS: dict[str, Renderer] = {r.name: r for r in (TextRenderer(), JsonRenderer(), KvRenderer())}

"""The capture side's feature packages (``capture/torch/<feature>/``) use each
other through their faces: a package's ``__init__`` names are its face, its
``_``-modules and ``_``-names are its own. Helpers several features share are
torch-level private modules (``capture/torch/_*.py``), below every feature, and
the features' imports of each other (lazy ones included) form no circle.

Read from the source, not by importing it: a lazy import inside a function
counts as much as one at the top of a module."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanrunbook"
TORCH_SIDE = "nanrunbook.capture.torch"
FEATURES = frozenset({"capsule", "recovery", "replay", "sentinel", "sharded_replay", "shrink"})


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module's dotted name
    line: int
    target: str  # the imported module
    names: tuple[str, ...]  # what a ``from`` import takes from it (empty: ``import target``)

    @property
    def where(self) -> str:
        return f"{self.importer}:{self.line}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> Iterator[Import]:
    """Every import statement of the package, at any depth of any module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(importer, node.lineno, alias.name, ())
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                yield Import(importer, node.lineno, base, tuple(a.name for a in node.names))


def _feature(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 3 and module.startswith(TORCH_SIDE + ".") and parts[3] in FEATURES:
        return parts[3]
    return None


def _crossings() -> dict[tuple[str, str], list[str]]:
    """(importer, target) of each import of another feature's private module or
    name, with where it is."""
    found: dict[tuple[str, str], list[str]] = {}
    for each in _imports():
        owner = _feature(each.target)
        if owner is None or owner == _feature(each.importer):
            continue
        inside = each.target.split(".")[4:]
        private = [name for name in each.names if name.startswith("_")]
        if private:
            found.setdefault((each.importer, each.target), []).append(
                f"{each.where} ({', '.join(private)})"
            )
        elif any(part.startswith("_") for part in inside):
            found.setdefault((each.importer, each.target), []).append(each.where)
    return found


def test_no_feature_is_reached_through_its_private_modules_or_names() -> None:
    crossings = _crossings()
    assert not crossings, "through a private module or name, not the package's face:\n" + (
        "\n".join(
            f"{importer} imports {target} at {', '.join(where)}"
            for (importer, target), where in sorted(crossings.items())
        )
    )


def test_the_torch_level_helpers_are_below_every_feature() -> None:
    above = [
        f"{each.where} imports {each.target}"
        for each in _imports()
        if each.importer.startswith(TORCH_SIDE + "._") and _feature(each.target) is not None
    ]
    assert not above, "a torch-level private helper imports a feature:\n" + "\n".join(above)


def test_the_features_import_each_other_without_a_circle() -> None:
    uses: dict[str, dict[str, str]] = {feature: {} for feature in FEATURES}
    for each in _imports():
        importer, target = _feature(each.importer), _feature(each.target)
        if importer is not None and target is not None and importer != target:
            uses[importer].setdefault(target, each.where)

    def circle(path: list[str]) -> list[str] | None:
        for target in sorted(uses[path[-1]]):
            if target in path:
                return [*path[path.index(target) :], target]
            found = circle([*path, target])
            if found is not None:
                return found
        return None

    for start in sorted(FEATURES):
        found = circle([start])
        assert found is None, "a circle of features: " + ", ".join(
            f"{a} -> {b} ({uses[a][b]})" for a, b in itertools.pairwise(found)
        )

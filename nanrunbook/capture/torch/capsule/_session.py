"""One ``nanrunbook replay``: a capsule verified, loaded into the objects the
user's entry built, its step replayed as recorded and compared with the
incident bundle (``diff``), then once more per change, each compared with the
replay as recorded. Every bundle goes below ``out``; nothing is written into
the capsule or the incident bundle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanrunbook._version import __version__
from nanrunbook.capture._changes import Change
from nanrunbook.capture.torch._entry import Built, EntryError
from nanrunbook.capture.torch._state_dir import StateDirRejected
from nanrunbook.capture.torch.capsule._capsule import Capsule
from nanrunbook.diff import Comparison, diff_bundles, diff_document
from nanrunbook.exits import Exit, most_severe

__all__ = [
    "REPLAY_FORMAT",
    "CapsuleReplay",
    "ChangedReplay",
    "replay_capsule",
    "replay_document",
    "replay_head",
]

REPLAY_FORMAT = "nanrunbook-replay/1"


@dataclass(frozen=True)
class ChangedReplay:
    """One ``--change``: as given, its bundle, and ``diff`` against the replay as recorded."""

    change: str
    bundle: Path
    comparison: Comparison


@dataclass(frozen=True)
class CapsuleReplay:
    """What a replay of a capsule found."""

    capsule: Capsule
    bundle: Path  # the replay as recorded
    incident: Path | None  # the incident bundle beside the capsule, if there is one
    reproduction: Comparison | None  # diff of the incident bundle and the replay
    changes: tuple[ChangedReplay, ...]

    def exit_code(self, *, require_fixed: bool = False) -> int:
        """As ``diff``'s, the most severe of the comparisons: 0 when each is
        attributable (with ``require_fixed``: each change FIXED), else 1."""
        codes = [self.reproduction.exit_code()] if self.reproduction is not None else []
        codes += [c.comparison.exit_code(require_fixed=require_fixed) for c in self.changes]
        if require_fixed and not self.changes:
            codes.append(Exit.HOLD)  # nothing was changed: no recovery is proven
        return most_severe(codes)


def _outside(out: Path, *protected: Path | None) -> None:
    here = out.resolve()
    for path in protected:
        if path is not None and (here == path.resolve() or path.resolve() in here.parents):
            raise EntryError(f"--out {out} is inside {path}: a replay never writes there")
    if out.exists() or out.is_symlink():
        raise EntryError(f"--out {out} exists: a replay writes a new directory")


def _same_bundle(capsule: Capsule, incident: Path) -> None:
    """The bundle beside the capsule is the one it was written with (its manifest's
    evidence content id; ``diff`` then checks that id against the evidence)."""
    from nanrunbook import strictjson
    from nanrunbook.errors import EvidenceRejected, Violation

    try:
        found = strictjson.load_manifest_bytes((incident / "manifest.json").read_bytes())
    except (OSError, EvidenceRejected):
        return  # diff rejects it, naming why
    recorded = capsule.bundle_evidence_id
    if found.get("evidence_content_id") != recorded:
        message = f"its evidence content id is not {recorded}, which the capsule names"
        raise StateDirRejected([Violation("CAPSULE_BUNDLE_DIFFERS", "..", message)])


def _name(index: int, text: str) -> str:
    mechanism = text.partition("=")[0].strip() or "change"
    return f"change-{index}-{mechanism}"


def replay_capsule(
    capsule: Capsule, built: Built, changes: Sequence[tuple[str, Change]], out: Path
) -> CapsuleReplay:
    """Load, replay as recorded, compare; then each change. Raises
    StateDirRejected (the built objects do not fit, or the bundle beside the
    capsule is not its own), ComparisonRejected (a bundle
    cannot be judged), EntryError (``out`` is not a new directory outside the
    capsule and the incident bundle) or ValueError (a change cannot apply)."""
    incident = capsule.incident_bundle
    _outside(out, capsule.path, incident)
    if incident is not None:
        _same_bundle(capsule, incident)
    loaded = capsule.load(built)
    out.mkdir(parents=True)
    base = out / "replay"
    loaded.replay(base)
    reproduction = diff_bundles(incident, base) if incident is not None else None
    replays = []
    for index, (text, change) in enumerate(changes, 1):
        target = out / _name(index, text)
        try:
            loaded.replay(target, change)
        except ValueError as error:
            raise ValueError(f"--change {text}: {error}") from None
        replays.append(ChangedReplay(text, target, diff_bundles(base, target)))
    return CapsuleReplay(capsule, base, incident, reproduction, tuple(replays))


def replay_head(path: Path, run_id: str, step: int) -> dict[str, Any]:
    """What every replay document opens with: its format, the tool, the capsule and its run."""
    return {
        "replay_format": REPLAY_FORMAT,
        "tool": {"name": "nanrunbook", "version": __version__},
        "capsule": str(path),
        "run": {"run_id": run_id, "step": step},
    }


def replay_document(result: CapsuleReplay, *, require_fixed: bool = False) -> dict[str, Any]:
    """The whole replay as JSON (``replay --format json``)."""
    capsule = result.capsule
    held = capsule.reproduced
    return {
        **replay_head(capsule.path, capsule.run_id, capsule.step),
        "held_process": None if held is None else held.document(),
        "bundle": str(result.bundle),
        "incident_bundle": None if result.incident is None else str(result.incident),
        "reproduction": None if result.reproduction is None else diff_document(result.reproduction),
        "changes": [
            {"change": c.change, "bundle": str(c.bundle), "diff": diff_document(c.comparison)}
            for c in result.changes
        ],
        "exit_code": result.exit_code(require_fixed=require_fixed),
    }

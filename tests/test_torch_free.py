"""Torch is imported only under nanrunbook.capture.torch: every other module, the
check side, the CLI, telemetry and the capture side's framework-free parts
(capture.mechanisms and the adapters' package and private helpers included),
imports in a process where torch cannot be imported at all. A framework's
adapter (capture/adapters/<framework>.py) imports its framework and torch, and
only it does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A finder first on sys.meta_path that refuses torch, as an install without the
# torch extra would. Every module outside capture/torch is then imported.
SCRIPT = r"""
import importlib, importlib.abc, json, sys
from pathlib import Path

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked: {name}")
        return None

sys.meta_path.insert(0, NoTorch())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block torch")

import nanrunbook

package = Path(nanrunbook.__file__).parent
torch_side = package / "capture" / "torch"
adapters = package / "capture" / "adapters"
names = []
for path in sorted(package.rglob("*.py")):
    if torch_side in path.parents or path.name == "__main__.py":
        continue
    if path.parent == adapters and not path.name.startswith("_"):
        continue  # a framework's adapter imports its framework and torch, by design
    parts = path.relative_to(package.parent).with_suffix("").parts
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as error:
        failed[name] = str(error)
import nanrunbook.capture.mechanisms as mechanisms
changes = [type(c).__name__ for c in (mechanisms.WithoutAutocast(), mechanisms.LossScale(2.0),
           mechanisms.Reduction(), mechanisms.OtherBatch(None))]
print(json.dumps({"imported": names, "failed": failed, "changes": changes,
                  "torch_loaded": any(m == "torch" or m.startswith("torch.") for m in sys.modules)}))
"""


def run_python(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter; it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done


def test_every_module_outside_capture_torch_imports_without_torch() -> None:
    done = run_python(SCRIPT)
    result = json.loads(done.stdout)
    assert result["failed"] == {}
    assert not result["torch_loaded"]
    imported = set(result["imported"])
    for name in (
        "nanrunbook",
        "nanrunbook.capture",
        "nanrunbook.capture.mechanisms",
        "nanrunbook.capture.writer",
        "nanrunbook.capture.seal",
        "nanrunbook.capture.atomic",
        "nanrunbook.capture.facts",
        "nanrunbook.capture.incident",
        "nanrunbook.capture.adapters",
        "nanrunbook.capture.telemetry",
        "nanrunbook.telemetry",
        "nanrunbook.telemetry.sinks",
        "nanrunbook.cli",
        "nanrunbook.output.text",
        "nanrunbook.verdict.report",
        "nanrunbook.check",
        "nanrunbook.diff",
        "nanrunbook.capture.adapters",
        "nanrunbook.capture.adapters._forward_as_loss",
    ):
        assert name in imported, name
    assert result["changes"] == ["WithoutAutocast", "LossScale", "Reduction", "OtherBatch"]


def test_using_replay_changed_loads_the_torch_side() -> None:
    """The lazy names of capture.mechanisms are the torch side's functions."""
    script = (
        "import sys\n"
        "import nanrunbook.capture.mechanisms as m\n"
        "assert 'torch' not in sys.modules\n"
        "from nanrunbook.capture.mechanisms import autocast_off, replay_changed\n"
        "from nanrunbook.capture.torch import replay\n"
        "assert replay_changed is replay.replay_changed\n"
        "assert autocast_off is replay.autocast_off\n"
        "assert 'torch' in sys.modules\n"
        "try:\n"
        "    m.no_such_name\n"
        "except AttributeError as error:\n"
        "    print(error)\n"
    )
    done = run_python(script)
    assert "has no attribute 'no_such_name'" in done.stdout


def test_the_torch_side_imports_no_training_framework() -> None:
    """transformers, Lightning and Accelerate are imported by their adapters only."""
    script = (
        "import sys\n"
        "import nanrunbook.capture.torch, nanrunbook.capture.adapters, nanrunbook.cli\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in\n"
        "          ('transformers', 'lightning', 'pytorch_lightning', 'accelerate')]\n"
        "assert not loaded, loaded\n"
    )
    run_python(script)

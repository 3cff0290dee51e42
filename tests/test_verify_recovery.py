"""``nanrunbook verify-recovery``: exit 0 verified, 3 not, every violation, in
text (80 columns), kv and json; torch never imported, nothing unpickled."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanrunbook.capture.torch import save_recovery_point

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, columns: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(ROOT)
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run(
        [sys.executable, "-m", "nanrunbook", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.fixture(scope="module")
def point(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    target = tmp_path_factory.mktemp("points") / "step-12"
    save_recovery_point(
        target, model=model, optimizer=optimizer, step=12, run_id="run-cli", data={"offset": 96}
    )
    return target


def _copy(point: Path, target: Path) -> Path:
    subprocess.run(["cp", "-a", str(point), str(target)], check=True)
    return target


def test_a_point_verifies_in_every_format(point: Path) -> None:
    text = run("verify-recovery", str(point))
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("nanrunbook verify-recovery: VERIFIED - step 12")
    assert all(len(line) <= 80 for line in text.stdout.splitlines())
    kv = run("verify-recovery", str(point), "--format", "kv")
    assert kv.returncode == 0
    assert kv.stdout.splitlines()[:4] == [
        "recovery_point=VERIFIED",
        "point_id=run-cli.recovery-12",
        "run_id=run-cli",
        "step=12",
    ]
    document = json.loads(run("verify-recovery", str(point), "-f", "json").stdout)
    assert document["verified"] is True and document["violations"] == []
    assert document["parts"]["data_position"] == "cursor"


def test_every_violation_is_listed_and_exit_is_3(point: Path, tmp_path: Path) -> None:
    bad = _copy(point, tmp_path / "bad")
    data = next((bad / "state").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    (bad / "scheduler.json").unlink()
    (bad / "notes.txt").write_text("left here")
    done = run("verify-recovery", str(bad), "-f", "json")
    assert done.returncode == 3
    codes = sorted(v["code"] for v in json.loads(done.stdout)["violations"])
    assert codes == [
        "RECOVERY_PART_MISSING",
        "STATE_FILE_DIGEST_MISMATCH",
        "STATE_FILE_MISSING",
        "STATE_FILE_UNLISTED",
    ]
    text = run("verify-recovery", str(bad), columns="80")
    assert text.returncode == 3 and "REJECTED - 4 violations" in text.stdout
    assert all(len(line) <= 80 for line in text.stdout.splitlines())
    kv = run("verify-recovery", str(bad), "-f", "kv").stdout.splitlines()
    assert "recovery_point=REJECTED" in kv and "violations=4" in kv


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_point_is_rejected_and_runs_nothing(point: Path, tmp_path: Path) -> None:
    hostile = _copy(point, tmp_path / "hostile")
    marker = tmp_path / "ran"
    metadata = hostile / "state" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Hostile(marker)))
    manifest = json.loads((hostile / "manifest.json").read_text())
    data = metadata.read_bytes()
    manifest["files"]["state/.metadata"] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    (hostile / "manifest.json").write_text(json.dumps(manifest))
    done = run("verify-recovery", str(hostile), "-f", "kv")
    assert done.returncode == 3
    assert "violation=STATE_METADATA_REFUSED state/.metadata" in done.stdout.splitlines()
    assert not marker.exists()


@pytest.mark.parametrize("name", ["absent", "half"])
def test_no_point_at_all(tmp_path: Path, name: str) -> None:
    target = tmp_path / name
    if name == "half":
        (target / "state").mkdir(parents=True)  # what a killed writer leaves: no manifest
    done = run("verify-recovery", str(target), "-f", "kv")
    assert done.returncode == 3 and "Traceback" not in done.stderr
    expected = "STATE_DIR_NOT_FOUND" if name == "absent" else "STATE_MANIFEST_MISSING"
    assert "violations=1" in done.stdout and expected in done.stdout


def test_verify_imports_no_torch(point: Path) -> None:
    code = (
        "import io, sys\n"
        "from nanrunbook.cli.verify_recovery import verify_and_emit\n"
        f"assert verify_and_emit(__import__('pathlib').Path({str(point)!r}), 'kv', io.StringIO()) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr

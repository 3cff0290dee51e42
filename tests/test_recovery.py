"""Recovery points the tool writes and verifies (issue 28): save, verify,
resume bit for bit, and refuse a flipped byte, a missing part and a writer
killed mid-save, none of which is ever taken as the last known-good state."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from sentinel_support import Regressor, facts, mse, regression_batch, state_bits
from state_dir_support import relist
from torchdata.stateful_dataloader import StatefulDataLoader

from nanrunbook import check_bundle
from nanrunbook.capture.recovery import CODES as RECOVERY_CODES
from nanrunbook.capture.torch import (
    Sentinel,
    SentinelHold,
    latest_recovery_point,
    load_recovery_point,
    save_recovery_point,
    verify_recovery_point,
)
from nanrunbook.capture.torch._state_dir import StateDirRejected, StateOutline
from nanrunbook.codes import CODES

ROOT = Path(__file__).resolve().parent.parent
# torchdata 0.11 calls a torch function torch 2.13 deprecates, at every iterator.
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")
FEATURES = torch.arange(96 * 8, dtype=torch.float32).reshape(96, 8).sin()


class Run:
    """A small real training run: an MLP with dropout and batch norm, AdamW, a
    step schedule, a CPU GradScaler, a shuffling StatefulDataLoader with its own
    generator, and noise from torch's, numpy's and Python's global streams."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = Regressor()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 3, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        self.noise = torch.Generator().manual_seed(seed + 7)
        self.loader = StatefulDataLoader(
            FEATURES,
            batch_size=8,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        self.batches = iter(self.loader)
        self.seen: list[torch.Tensor] = []

    def step(self) -> None:
        x = next(self.batches)
        self.seen.append(x)
        y = x.sum(1) + 0.01 * torch.randn(len(x), generator=self.noise)
        y = y + float(np.random.rand()) * 1e-3 + random.random() * 1e-3 + torch.rand(()) * 1e-3
        self.optimizer.zero_grad()
        loss = ((self.model(x) - y) ** 2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()

    def parts(self) -> dict[str, Any]:
        """What a recovery point saves and restores of this run."""
        objects = {
            name: getattr(self, name) for name in ("model", "optimizer", "scheduler", "scaler")
        }
        return {**objects, "data": self.loader, "generators": [self.noise]}

    def save(self, path: Path, step: int) -> Any:
        return save_recovery_point(path, **self.parts(), step=step, run_id="run-28")

    def load(self, path: Path, *, check_digests: bool = False) -> Any:
        loaded = load_recovery_point(path, **self.parts(), check_digests=check_digests)
        self.batches = iter(self.loader)
        return loaded

    def bits(self) -> Any:
        return state_bits(self.model, self.optimizer, self.scheduler, self.scaler, same=False)


def _codes(path: Path) -> list[str]:
    return sorted(v.code for v in verify_recovery_point(path).violations)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run of 8 steps, a point saved after step 4."""
    tmp = tmp_path_factory.mktemp("reference")
    run = Run(0)
    for _ in range(4):
        run.step()
    point = run.save(tmp / "step-4", 4)
    for _ in range(4):
        run.step()
    return {"point": point, "path": tmp / "step-4", "bits": run.bits(), "seen": run.seen[4:]}


def test_every_code_is_in_the_catalogue() -> None:
    assert set(RECOVERY_CODES) <= set(CODES)


def test_a_saved_point_verifies(reference: dict[str, Any]) -> None:
    verification = verify_recovery_point(reference["path"])
    assert verification.verified, verification.violations
    assert (verification.step, verification.run_id, verification.world_size) == (4, "run-28", 1)
    assert verification.parts == {
        "model": "dcp",
        "optimizer": "dcp",
        "scheduler": "state_dict",
        "scaler": "state_dict",
        "data_position": "state_dict",
        "rng": "streams",
    }
    assert verification.point() == reference["point"]
    assert reference["point"].last_known_good["checkpoint_id"] == "run-28.recovery-4"


def test_a_resumed_run_is_bit_identical_to_the_uninterrupted_one(
    reference: dict[str, Any],
) -> None:
    run = Run(1)  # other weights, another shuffle, other random streams: all restored
    run.step()
    loaded = run.load(reference["path"], check_digests=True)
    assert loaded.digests_match
    for _ in range(4):
        run.step()
    assert len(run.seen[1:]) == len(reference["seen"])
    for got, expected in zip(run.seen[1:], reference["seen"], strict=True):
        assert torch.equal(got, expected)  # the loader's next batches
    assert run.bits() == reference["bits"]  # parameters, optimizer, scheduler, scaler


def _copy(source: Path, target: Path) -> Path:
    subprocess.run(["cp", "-a", str(source), str(target)], check=True)
    return target


def test_a_flipped_byte_fails_verify_and_load_and_is_never_last_known_good(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    good = _copy(reference["path"], tmp_path / "a-step-4")
    bad = _copy(reference["path"], tmp_path / "b-step-4")
    manifest = orjson.loads((bad / "manifest.json").read_bytes())
    manifest["header"]["step"] = 6  # newer than the good one, were it believed
    for part in manifest["header"]["parts"].values():
        part["step"] = 6
    (bad / "manifest.json").write_bytes(orjson.dumps(manifest))
    data = next((bad / "state").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))
    assert "STATE_FILE_DIGEST_MISMATCH" in _codes(bad)
    run = Run(2)
    before = run.bits()
    with pytest.raises(StateDirRejected) as info:
        run.load(bad)
    assert "STATE_FILE_DIGEST_MISMATCH" in info.value.codes
    assert run.bits() == before  # refused before anything changed
    latest = latest_recovery_point(tmp_path)
    assert latest is not None and Path(latest.path) == good


def _wide_run() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its Adam moments large enough (36 MiB) for two data files."""
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(3)))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_flipped_tensor_byte_in_a_large_point_refuses_resume_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A byte that DCP would decode without complaint (a tensor's, not the
    # zip's) is caught by its digest alone, before any tensor is read: the
    # run's objects keep every bit.
    torch.manual_seed(0)
    model, optimizer = _wide_run()
    save_recovery_point(tmp_path / "p", model=model, optimizer=optimizer, step=3, run_id="wide")
    files = sorted((tmp_path / "p" / "state").glob("*.distcp"))
    assert len(files) == 2  # written, hashed and verified on two threads
    raw = bytearray(files[1].read_bytes())
    raw[len(raw) // 2] ^= 0x01
    files[1].write_bytes(bytes(raw))
    read = []
    real_read = StateOutline.read
    monkeypatch.setattr(StateOutline, "read", lambda *a, **k: read.append(1) or real_read(*a, **k))
    torch.manual_seed(1)
    live, live_optimizer = _wide_run()
    before = state_bits(live, live_optimizer)
    with pytest.raises(StateDirRejected) as info:
        load_recovery_point(tmp_path / "p", model=live, optimizer=live_optimizer)
    assert info.value.codes == ("STATE_FILE_DIGEST_MISMATCH",)
    assert info.value.violations[0].where == f"state/{files[1].name}"
    assert read == []  # no tensor of the point was read
    assert state_bits(live, live_optimizer) == before


def test_a_missing_part_fails_verify_and_load(reference: dict[str, Any], tmp_path: Path) -> None:
    dropped = _copy(reference["path"], tmp_path / "dropped")
    (dropped / "scaler.json").unlink()
    assert _codes(dropped) == ["RECOVERY_PART_MISSING", "STATE_FILE_MISSING"]
    forged = _copy(
        reference["path"], tmp_path / "forged"
    )  # the part gone, the manifest made to fit
    (forged / "scaler.json").unlink()

    def drop(manifest: dict[str, Any]) -> None:
        manifest["files"].pop("scaler.json")
        manifest["header"]["parts"].pop("scaler")

    relist(forged, drop)
    assert _codes(forged) == ["RECOVERY_PART_MISSING"]
    with pytest.raises(StateDirRejected) as info:
        Run(2).load(forged)
    assert info.value.codes == ("RECOVERY_PART_MISSING",)
    assert latest_recovery_point(tmp_path) is None


def test_parts_of_other_steps_and_no_rng_are_refused(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    point = _copy(reference["path"], tmp_path / "p")
    scheduler = orjson.loads((point / "scheduler.json").read_bytes())
    scheduler["step"] = 3
    (point / "scheduler.json").write_bytes(orjson.dumps(scheduler))
    rng = orjson.loads((point / "rng.json").read_bytes())
    del rng["streams"]["numpy"]
    (point / "rng.json").write_bytes(orjson.dumps(rng))

    def garble(manifest: dict[str, Any]) -> None:
        manifest["header"]["parts"]["model"]["step"] = 2
        del manifest["header"]["torch_version"]

    relist(point, garble)
    assert _codes(point) == ["RECOVERY_HEADER_INVALID"]
    relist(point, lambda m: m["header"].update(torch_version="2.13.0"))
    assert _codes(point) == [
        "RECOVERY_RNG_MISSING",
        "RECOVERY_STEP_MISMATCH",
        "RECOVERY_STEP_MISMATCH",
    ]


def test_a_point_that_does_not_fit_the_run_is_refused_unchanged(
    reference: dict[str, Any],
) -> None:
    run = Run(3)
    run.model.head = torch.nn.Linear(32, 2)  # another shape
    before = run.bits()
    with pytest.raises(StateDirRejected) as info:
        load_recovery_point(
            reference["path"],
            model=run.model,
            optimizer=torch.optim.AdamW(run.model.parameters()),
            scheduler=None,
            scaler=run.scaler,
            data=run.loader,
            generators=[run.noise],
        )
    assert set(info.value.codes) == {"STATE_SHAPE_MISMATCH", "RECOVERY_PART_MISSING"}
    assert run.bits() == before


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from nanrunbook.capture.torch import save_recovery_point
    from nanrunbook.capture.torch import _state_dir

    target, marker, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if where == "manifest":  # stopped just before the manifest: every data file written
        real = _state_dir.write_synced
        def write_synced(path, chunks):
            if path.name == "manifest.json":
                marker.touch()
                time.sleep(60)
            real(path, chunks)
        _state_dir.write_synced = write_synced
    else:  # stopped once DCP has written the state, while the files are hashed
        real_digests = _state_dir._digests
        def digests(*args):
            marker.touch()
            time.sleep(60)
            return real_digests(*args)
        _state_dir._digests = digests
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(24)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    save_recovery_point(target, model=model, optimizer=optimizer, step=9, run_id="killed")
    """
)


@pytest.mark.parametrize("where", ["manifest", "hashing"])
def test_a_writer_killed_mid_save_leaves_no_point(tmp_path: Path, where: str) -> None:
    points = tmp_path / "points"
    points.mkdir()
    target = points / "step-9"
    marker = tmp_path / "started"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(target), str(marker), where], env=env
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and writer.poll() is None:
            if marker.exists():  # the writer waits there until it is killed
                break
            time.sleep(0.01)
        assert writer.poll() is None, "the writer finished before it could be killed"
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(timeout=30)
    assert not target.exists()  # nothing half-written at the point's path
    assert _codes(target) == ["STATE_DIR_NOT_FOUND"]
    (temporary,) = [p for p in points.iterdir() if p.name.startswith(".step-9.")]
    assert _codes(temporary) == ["STATE_MANIFEST_MISSING"]
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(24)])
    with pytest.raises(StateDirRejected) as info:
        load_recovery_point(temporary, model=model, optimizer=torch.optim.Adam(model.parameters()))
    assert info.value.codes == ("STATE_MANIFEST_MISSING",)
    assert latest_recovery_point(points) is None


def test_the_sentinel_takes_its_verified_point_as_last_known_good(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    sentinel = Sentinel(model, optimizer, mse, **facts("verified", tmp_path))
    (tmp_path / "points").mkdir()
    hold = None
    for i in range(1, 8):
        batch = regression_batch(i)
        if i == 6:
            batch["x"][0, 0] = float("nan")
        optimizer.zero_grad()
        try:
            sentinel.forward(batch).backward()
            optimizer.step()
            if i == 3:
                point = sentinel.save_recovery_point(tmp_path / "points" / "step-3")
                assert sentinel.last_known_good == point.last_known_good
        except SentinelHold as held:
            hold = held
            break
    sentinel.close()
    assert hold is not None and hold.step == 6
    assert hold.last_known_good["checkpoint_id"] == "verified.recovery-3"
    report = check_bundle(hold.bundle)
    assert report.manifest.last_known_good.step == 3
    manifest = json.loads((hold.bundle / "manifest.json").read_text())
    assert manifest["binding"]["checkpoint"]["last_known_good_recovery"] == "verified"
    verification = verify_recovery_point(tmp_path / "points" / "step-3")
    assert verification.verified and verification.parts is not None
    assert verification.parts["data_position"] == "cursor"  # the loop gave no loader
    lines = (tmp_path / "incident" / "verified" / "telemetry.jsonl").read_text().splitlines()
    assert all(not json.loads(line)["warnings"] for line in lines[:5])  # verified: no STATED


def test_a_restore_that_is_not_bit_for_bit_is_said(
    reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Run(4)
    run.step()  # param_groups of its own, which a lost restore would leave
    monkeypatch.setattr(run.optimizer, "load_state_dict", lambda state: None)
    loaded = run.load(reference["path"], check_digests=True)
    assert not loaded.restored_exactly and not loaded.digests_match
    assert set(loaded.restored_digests) == {"model", "optimizer"}

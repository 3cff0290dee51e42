"""A BundleWriter given a spool_dir streams each tensor to disk as it is observed:
the same bytes as the in-memory writer, about one tensor held at a time, and a
failed write leaves neither a partial bundle nor spool files behind."""

from __future__ import annotations

import errno
import functools
import importlib.util
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_capture import OWNER, finite, new_writer, observe_rest, tree_bytes
from test_capture_torch import IDENTITY, make_batch, trained, xent

import nanrunbook.capture.atomic as atomic
import nanrunbook.capture.writer as writer_module
from nanrunbook import EvidenceRejected, check_bundle
from nanrunbook.capture import BundleWriter
from nanrunbook.capture.torch import replay_step
from nanrunbook.capture.writer import SPOOL_PREFIX
from nanrunbook.contract import Caps

TENSOR_BYTES = 1 << 20
TENSORS = 24  # 24 MiB of tensors in all


def spool_in(directory: Path) -> Path:
    (directory / "spool").mkdir(exist_ok=True)
    return directory / "spool"


def spools(directory: Path) -> list[Path]:
    return sorted(directory.rglob(f"{SPOOL_PREFIX}*"))


def lazy_tensors(count: int = TENSORS) -> Iterator[tuple[str, Any, str]]:
    """One fresh 1 MiB array at a time: the caller holds none of them."""
    for i in range(count):
        yield f"x{i}", np.full(TENSOR_BYTES // 4, i + 0.5, "float32"), "probe"


def big_bundle(w: BundleWriter) -> BundleWriter:
    w.observe("input", lazy_tensors(), owner=OWNER, probe_source="p")
    observe_rest(w)
    return w


def test_streamed_bundle_is_byte_identical_to_the_in_memory_one(tmp_path: Path) -> None:
    memory = big_bundle(new_writer()).write(tmp_path / "memory")
    streamed = big_bundle(new_writer(spool_dir=spool_in(tmp_path))).write(tmp_path / "streamed")
    assert tree_bytes(streamed) == tree_bytes(memory)
    assert spools(tmp_path) == []  # the written bundle took the spool's place


def test_streamed_writer_writes_again(tmp_path: Path) -> None:
    """The API is unchanged: a written writer writes again (from the bundle it
    wrote, whose data the check verifies again), over it too."""
    memory = tree_bytes(big_bundle(new_writer()).write(tmp_path / "memory"))
    streamed = big_bundle(new_writer(spool_dir=tmp_path))
    streamed.write(tmp_path / "first")
    assert tree_bytes(streamed.write(tmp_path / "second")) == memory
    assert tree_bytes(streamed.write(tmp_path / "second", overwrite=True)) == memory
    assert tree_bytes(streamed.write(tmp_path / "first", overwrite=True)) == memory
    assert spools(tmp_path) == []


def test_fixture_bundles_stream_to_the_committed_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every valid fixture, built by the generator with a streaming writer and
    written, is the committed fixture byte for byte."""
    fixtures = Path(__file__).parent.parent / "fixtures"
    spec = importlib.util.spec_from_file_location("fixture_generator", fixtures / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    monkeypatch.setattr(
        generate, "BundleWriter", functools.partial(BundleWriter, spool_dir=spool_in(tmp_path))
    )
    for name, (build, _) in generate.VALID.items():
        written = build().write(tmp_path / name)
        assert tree_bytes(written) == tree_bytes(fixtures / name), name
    assert spools(tmp_path) == []


def test_replay_step_streams_the_same_bundle(tmp_path: Path) -> None:
    model, optimizer = trained()
    rng = torch.get_rng_state()
    memory = replay_step(model, optimizer, make_batch(3), xent, rng_state=rng, **IDENTITY)
    assert memory._spool is None
    memory.write(tmp_path / "memory")
    streamed = replay_step(
        model, optimizer, make_batch(3), xent, rng_state=rng, target=tmp_path / "b", **IDENTITY
    )
    assert streamed._spool is not None  # it streamed
    assert tree_bytes(tmp_path / "b") == tree_bytes(tmp_path / "memory")
    assert spools(tmp_path) == []


@pytest.mark.parametrize("where", ["header", "data", "manifest"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_streaming_write_leaves_no_bundle_and_no_spool(
    where: str, existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "b"
    before = tree_bytes(_small(target)) if existing else {}
    w = big_bundle(new_writer(spool_dir=tmp_path))
    assert len(spools(tmp_path)) == 1
    full = OSError(errno.ENOSPC, "No space left on device")
    real_copy = atomic.copy_range

    def half_header(path: Path, head: bytes, *_: Any) -> None:
        path.write_bytes(head[: len(head) // 2])
        raise full

    def half_data(source: int, offset: int, length: int, destination: int) -> None:
        real_copy(source, offset, length // 2, destination)
        raise full

    def no_manifest(path: Path, chunks: Any) -> None:
        raise full

    if where == "header":
        monkeypatch.setattr(writer_module, "write_synced_copy", half_header)
    elif where == "data":
        monkeypatch.setattr(atomic, "copy_range", half_data)
    else:
        monkeypatch.setattr(writer_module, "write_synced", no_manifest)
    with pytest.raises(OSError) as failed:
        w.write(target, overwrite=existing)
    assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == (["b"] if existing else [])
    if existing:
        assert tree_bytes(target) == before
    with pytest.raises(RuntimeError, match="spooled tensor bytes were removed"):
        w.write(tmp_path / "again")


def _small(target: Path) -> Path:
    w = new_writer()
    w.observe("input", [("a", finite(), "a")], owner=OWNER, probe_source="p")
    observe_rest(w)
    return w.write(target)


def test_a_refused_streaming_write_leaves_no_bundle_and_no_spool(tmp_path: Path) -> None:
    """Refused by the check on the finished files (a cap): nothing stays."""
    w = big_bundle(new_writer(spool_dir=tmp_path))
    with pytest.raises(EvidenceRejected):
        w.write(tmp_path / "b", caps=Caps(max_stage_tensors=2))
    assert list(tmp_path.iterdir()) == []


def test_a_stage_that_fails_midway_is_taken_back_from_the_spool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory, streamed = new_writer(), new_writer(spool_dir=spool_in(tmp_path))

    def broken() -> Iterator[tuple[str, Any, str]]:
        yield from lazy_tensors(2)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        streamed.observe("input", broken(), owner=OWNER, probe_source="p")
    assert streamed.recorded == ()
    for w in (memory, streamed):
        w.observe("input", lazy_tensors(2), owner=OWNER, probe_source="p")
        observe_rest(w)
    assert tree_bytes(streamed.write(tmp_path / "s")) == tree_bytes(memory.write(tmp_path / "m"))


def test_the_spool_goes_with_an_unwritten_writer(tmp_path: Path) -> None:
    w = big_bundle(new_writer(spool_dir=tmp_path))
    assert len(spools(tmp_path)) == 1
    del w
    assert spools(tmp_path) == []


def _peak_traced(build: Any) -> int:
    tracemalloc.start()
    try:
        build()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_streaming_holds_about_one_tensor_while_writing_many(tmp_path: Path) -> None:
    """Python-held bytes at peak, recording and writing 24 MiB of tensors: the
    in-memory writer holds them all, the streaming one about one tensor (the
    array, its bytes, and a small header)."""
    memory = _peak_traced(lambda: big_bundle(new_writer()).write(tmp_path / "m"))
    streamed = _peak_traced(
        lambda: big_bundle(new_writer(spool_dir=spool_in(tmp_path))).write(tmp_path / "s")
    )
    assert memory > TENSORS * TENSOR_BYTES  # the measure sees what is held
    assert streamed < 3 * TENSOR_BYTES, streamed


def test_a_sentinel_hold_streams_its_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real hold: the tensors go through the spool in the incident directory,
    the bundle checks, and no spool is left once the hold is raised."""
    from sentinel_support import Regressor, Sentinel, facts, mse, quiet_thresholds, regression_batch

    from nanrunbook.capture.torch import SentinelHold

    spooled: list[int] = []
    real_append = writer_module._Spool.append

    def append(spool: Any, data: bytes) -> None:
        spooled.append(len(data))
        real_append(spool, data)

    monkeypatch.setattr(writer_module._Spool, "append", append)
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    sentinel = Sentinel(
        model, optimizer, mse, thresholds=quiet_thresholds(), **facts("s", tmp_path)
    )
    batch = regression_batch(1)
    batch["x"][0, 0] = float("nan")
    with pytest.raises(SentinelHold) as held:
        optimizer.zero_grad()
        sentinel.forward(batch).backward()
        optimizer.step()
    sentinel.close()
    assert held.value.bundle is not None and held.value.report is not None
    assert check_bundle(held.value.bundle).decision.earliest_nonfinite_stage == "input"
    stored = (held.value.bundle / "tensors.safetensors").read_bytes()
    header = 8 + int.from_bytes(stored[:8], "little")
    assert spooled and sum(spooled) == len(stored) - header  # every tensor byte was spooled
    assert spools(tmp_path) == []


def test_an_existing_target_refused_keeps_the_spool(tmp_path: Path) -> None:
    """Refused before anything is put down (the target exists): the writer still
    writes elsewhere, as an in-memory one does."""
    w = big_bundle(new_writer(spool_dir=spool_in(tmp_path)))
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError):
        w.write(tmp_path / "b")
    check_bundle(w.write(tmp_path / "c"))


def test_a_streamed_replay_holds_one_stage_not_the_bundle(tmp_path: Path) -> None:
    """replay_step(target=...) of eight 512x512 layers under SGD: the gradients
    and the updates are each the parameter bytes; the old writer held both (and
    the rest) until the write, 2.4x the parameter bytes; streaming, the peak is
    the one stage the replay gathers, about 1x."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    params = sum(p.numel() * 4 for p in model.parameters())

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).square().mean()

    batch = torch.randn(4, 512)
    peak = _peak_traced(
        lambda: replay_step(model, optimizer, batch, loss, target=tmp_path / "b", **IDENTITY)
    )
    assert peak < 1.5 * params, peak / params
    assert spools(tmp_path) == []


def test_the_spool_makes_no_directory_of_the_callers(tmp_path: Path) -> None:
    w = new_writer(spool_dir=tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        w.observe("input", lazy_tensors(1), owner=OWNER, probe_source="p")
    assert list(tmp_path.iterdir()) == [] and w.recorded == ()

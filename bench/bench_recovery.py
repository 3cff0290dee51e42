"""What a recovery point costs against torch.distributed.checkpoint's own, in
the same run (issue 28's numbers):

* save: ``save_recovery_point`` against ``dcp.save`` of the same state plus one
  SHA-256 pass over the bytes it wrote (the budget: at most that sum);
* verify: ``verify_recovery_point`` (what ``nanrunbook verify-recovery`` runs)
  against one SHA-256 stream over the point's files (budget: 1.1x);
* resume: ``load_recovery_point`` (verify every file, check every part, read
  the tensors into the live ones, restore) against ``dcp.load`` into the live
  state dict (budget: 1.2x); and, unbudgeted, with ``check_digests=True``
  (what ``prove`` records: the point read once more, compared and digested);
* resume into a new process's objects (a model as built, an optimizer without
  state): ``load_recovery_point`` against DCP's own flow for it
  (``get_state_dict``, which makes the optimizer's state, ``dcp.load`` and
  ``set_state_dict``), unbudgeted.

The state is an MLP's parameters and its Adam moments (about ``--megabytes``
in all), on the CPU; files are in the page cache (each is read once before
the timed rounds), so the figures compare compute, not the disk. The jobs
alternate round by round (``--repeat`` rounds, medians), so a busy machine's
swings fall on each job and its floor alike. ::

    python bench/bench_recovery.py [--megabytes 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nanrunbook.capture.torch import load_recovery_point, save_recovery_point, verify_recovery_point

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sha_floor import sha_stream

warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


def build(megabytes: int) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    """An MLP whose parameters and Adam state total about ``megabytes`` MiB."""
    width = 1024
    layers = max(1, round(megabytes * 2**20 / 3 / 4 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def directory_sha(directory: Path) -> str:
    """One SHA-256 over every file below ``directory``, one 1 MiB buffer, one core."""
    return sha_stream(sorted(p for p in directory.rglob("*") if p.is_file()), 1 << 20)


Job = tuple[Callable[[], Any], Callable[[], Any]]  # what is timed, what runs untimed before


def alternated(jobs: dict[str, Job], repeat: int) -> dict[str, float]:
    """Median wall time of each job over ``repeat`` rounds, the jobs run one
    after another in each round (the order rotated), so a busy machine's swings
    fall on a job and its floor alike."""
    times: dict[str, list[float]] = {name: [] for name in jobs}
    names = list(jobs)
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, before = jobs[name]
            before()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _nothing() -> None:
    pass


def _as_built(model: torch.nn.Sequential) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``model``'s shape as a new process builds it, and its Adam
    with no state yet."""
    torch.manual_seed(1)
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    width = first.in_features
    built = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(len(model))))
    return built, torch.optim.Adam(built.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model, optimizer = build(args.megabytes)
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    try:
        dcp_dir, point = root / "dcp", root / "point"

        def clear(*paths: Path) -> Callable[[], None]:
            return lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]  # type: ignore[func-returns-value,return-value]

        def dcp_save_once() -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            dcp_save(state, storage_writer=FileSystemWriter(dcp_dir, sync_files=True), no_dist=True)

        def ours_save_once() -> None:
            save_recovery_point(point, model=model, optimizer=optimizer, step=1, run_id="bench")

        dcp_save_once()  # the directories dcp.load and every verify and resume read
        ours_save_once()
        size = sum(p.stat().st_size for p in point.rglob("*") if p.is_file())
        assert verify_recovery_point(point).verified

        def dcp_load_once() -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            dcp_load(state, storage_reader=FileSystemReader(dcp_dir), no_dist=True)

        def ours_load_once() -> None:
            load_recovery_point(point, model=model, optimizer=optimizer)

        def ours_load_digested() -> None:
            load_recovery_point(point, model=model, optimizer=optimizer, check_digests=True)

        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        fresh_dcp = root / "dcp-fresh"  # saved as DCP's flow saves it (parameter names)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp_save(
            {"model": model_state, "optimizer": optimizer_state},
            storage_writer=FileSystemWriter(fresh_dcp, sync_files=True),
            no_dist=True,
        )
        new: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = []

        def build_new() -> None:
            new[:] = [_as_built(model)]

        def ours_into_new() -> None:
            load_recovery_point(point, model=new[0][0], optimizer=new[0][1])

        def dcp_into_new() -> None:
            built, built_optimizer = new[0]
            model_state, optimizer_state = get_state_dict(built, built_optimizer)
            state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
            dcp_load(state, storage_reader=FileSystemReader(fresh_dcp), no_dist=True)
            set_state_dict(
                built,
                built_optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )

        saved_dcp, saved_point = root / "dcp-save", root / "point-save"

        def dcp_save_again() -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            writer = FileSystemWriter(saved_dcp, sync_files=True)
            dcp_save(state, storage_writer=writer, no_dist=True)

        def ours_save_again() -> None:
            save_recovery_point(saved_point, model=model, optimizer=optimizer, step=1, run_id="b")

        medians = alternated(
            {
                "dcp_save": (dcp_save_again, clear(saved_dcp)),
                "save": (ours_save_again, clear(saved_point)),
                "sha": (lambda: directory_sha(point), _nothing),
                "verify": (lambda: verify_recovery_point(point), _nothing),
                "dcp_load": (dcp_load_once, _nothing),
                "load": (ours_load_once, _nothing),
                "load_digested": (ours_load_digested, _nothing),
                "new_load": (ours_into_new, build_new),
                "new_dcp_load": (dcp_into_new, build_new),
            },
            args.repeat,
        )
        t_dcp_save, t_save, t_sha = medians["dcp_save"], medians["save"], medians["sha"]
        t_verify, t_dcp_load = medians["verify"], medians["dcp_load"]
        t_load, t_load_digested = medians["load"], medians["load_digested"]
        t_new, t_new_dcp = medians["new_load"], medians["new_dcp_load"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = size / 2**20
    print(f"state {mib:.0f} MiB ({size} bytes in the point), median of {args.repeat}, same run")
    print(f"SHA-256 stream over the point: {t_sha:.3f} s ({mib / t_sha:.0f} MiB/s)")
    budget = t_dcp_save + t_sha
    print(
        f"save    {t_save:.3f} s   dcp.save {t_dcp_save:.3f} s + one SHA-256 pass {t_sha:.3f} s"
        f" = {budget:.3f} s   ratio {t_save / budget:.2f} (budget 1.00)"
    )
    print(
        f"verify  {t_verify:.3f} s   one SHA-256 stream {t_sha:.3f} s"
        f"   ratio {t_verify / t_sha:.2f} (budget 1.10)"
    )
    print(
        f"resume  {t_load:.3f} s   dcp.load {t_dcp_load:.3f} s"
        f"   ratio {t_load / t_dcp_load:.2f} (budget 1.20)"
    )
    print(
        f"resume with the restored state's digests (check_digests=True, as prove)"
        f"  {t_load_digested:.3f} s   ratio {t_load_digested / t_dcp_load:.2f}"
    )
    print(
        f"resume into a new process's objects  {t_new:.3f} s   DCP's flow (get_state_dict,"
        f" dcp.load, set_state_dict) {t_new_dcp:.3f} s   ratio {t_new / t_new_dcp:.2f}"
    )


if __name__ == "__main__":
    main()

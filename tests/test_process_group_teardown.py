"""A job under the sentinel ends as it would without it: once the loop is over
and the sentinel closed, nothing of the tool holds the model, so
``destroy_process_group()`` frees the group and its gloo threads end with it.

A group that something still holds is torn down at interpreter shutdown
instead, where one of its threads can abort the process ("terminate called
without an active exception", SIGABRT: a crash to torchrun and Slurm). The
multi-rank tests check the same after every job (``end_process_group`` in
sentinel_support); these two isolate the two holders found."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import torch
from sentinel_support import facts, mse_column, regression_batch
from torch import nn

from nanrunbook.capture.torch import Sentinel, Thresholds


def test_a_closed_sentinel_is_freed_without_a_garbage_collection(tmp_path: Path) -> None:
    """The scheduler's ``step`` is watched through a class made for that one
    instance; a class is a reference cycle of its own, so its method must not
    keep the sentinel (and the model) once the sentinel is closed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    gc.disable()
    try:
        quiet = Thresholds(sample_every=0)
        stated = facts("teardown", tmp_path, scheduler=scheduler, thresholds=quiet)
        sentinel = Sentinel(model, optimizer, mse_column, **stated)
        for i in range(3):
            optimizer.zero_grad()
            sentinel.forward(regression_batch(i)).backward()
            optimizer.step()
            scheduler.step()
        sentinel.close()
        alive = weakref.ref(sentinel)
        del sentinel
        assert alive() is None, "something still holds the closed sentinel"
    finally:
        gc.enable()


WORKER = textwrap.dedent(
    """
    import glob, sys
    from datetime import timedelta
    import nanrunbook.capture.torch  # before init_process_group, as a job imports it
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    def train():
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        model(torch.ones(2, 4)).sum().backward()
    train()
    dist.destroy_process_group()
    names = [open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")]
    print(sorted(n for n in names if "gloo" in n))
    """
)


def test_a_ddp_job_s_group_ends_with_destroy_process_group(tmp_path: Path) -> None:
    """DistributedDataParallel imports ``torch.distributed.nn``, whose functions
    take the default group as a default argument: imported after
    init_process_group they would hold it for good. The sentinel's package
    imports it first, so the group (and its threads) ends with destroy."""
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"

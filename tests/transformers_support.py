"""Real ``transformers.Trainer`` runs for the adapter's tests: a
tiny GPT-2 built from a config (nothing downloaded), token or embedding
records made here, and every bit of the Trainer's state a step could change."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never a download, before transformers loads

import torch
from sentinel_support import facts, state_bits
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from nanrunbook.capture.adapters.transformers import SentinelTrainer

VOCAB = 64


def tiny_gpt2(seed: int = 0, width: int = 16, layers: int = 2, positions: int = 16) -> Any:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=positions,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def token_records(count: int = 64, length: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (count, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class EmbeddingRecords(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Records of input embeddings; after the ``corrupt_after``-th record this
    process reads (or in the ``corrupt_read``-th alone), one element is NaN (a
    corrupt record on one rank's shard)."""

    def __init__(
        self,
        corrupt_after: int | None = None,
        count: int = 64,
        width: int = 16,
        corrupt_read: int | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 8, width, generator=g)
        self.y = torch.randint(0, VOCAB, (count, 8), generator=g)
        self.corrupt_after, self.corrupt_read = corrupt_after, corrupt_read
        self.read = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.read += 1
        x = self.x[index].clone()
        after = self.corrupt_after is not None and self.read > self.corrupt_after
        if after or self.read == self.corrupt_read:
            x[2, 3] = float("nan")
        return {"inputs_embeds": x, "labels": self.y[index]}


def arguments(out: Path, **changes: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "max_steps": 6,
        "learning_rate": 1e-3,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        **changes,
    }
    return TrainingArguments(**settings)


def sentinel_facts(run_id: str) -> dict[str, Any]:
    objective = {"id": "causal-lm-xent", "reduction": "mean"}
    return facts(run_id, None, data={"id": "synthetic-tokens"}, objective=objective)


def inner_optimizer(trainer: Any) -> Any:
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    return optimizer


def trainer_bits(trainer: Any, same: bool = True) -> Any:
    """Every bit of the Trainer's state a step could change: model, optimizer,
    scheduler, and the counters (global step, epoch, tokens, flops, log)."""
    state = trainer.state
    return {
        "tensors": state_bits(
            trainer.model, inner_optimizer(trainer), trainer.lr_scheduler, same=same
        ),
        "counters": (
            state.global_step,
            state.epoch,
            state.num_input_tokens_seen,
            state.total_flos,
            len(state.log_history),
            trainer.current_flos,
        ),
    }


class StateBeforeEachStep(TrainerCallback):  # type: ignore[misc]
    """The Trainer's state at the start of each step, by the step's number."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.before: dict[int, Any] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.before[state.global_step + 1] = trainer_bits(self.trainer)


def make_trainer(
    out: Path,
    *,
    sentinel: dict[str, Any] | None,
    dataset: Any = None,
    watch_state: bool = True,
    **changes: Any,
) -> tuple[Any, StateBeforeEachStep]:
    """A Trainer (a SentinelTrainer with ``sentinel``) on a fresh tiny GPT-2;
    ``watch_state`` keeps its state before each step (a copy a step: runs that
    are only compared go without); ``per_batch_mean`` gives the model no ``num_items_in_batch``,
    so its loss is a micro-batch's mean and the Trainer divides it."""
    watch = StateBeforeEachStep()
    loss = changes.pop("compute_loss_func", None)
    width = changes.pop("width", 16)
    layers = changes.pop("layers", 2)
    positions = changes.pop("positions", 16)
    per_batch_mean = changes.pop("per_batch_mean", False)
    kwargs: dict[str, Any] = {
        "model": tiny_gpt2(width=width, layers=layers, positions=positions),
        "args": arguments(out, **changes),
        "train_dataset": token_records() if dataset is None else dataset,
        "callbacks": [watch] if watch_state else [],
        "compute_loss_func": loss,
    }
    trainer = (
        Trainer(**kwargs) if sentinel is None else SentinelTrainer(**kwargs, sentinel=sentinel)
    )
    if per_batch_mean:  # the model's mean loss, which training_step divides for accumulation
        trainer.model_accepts_loss_kwargs = False
    watch.trainer = trainer
    return trainer, watch


def first_nonfinite_step(trainer: Any) -> int | None:
    """The first step whose logged loss or gradient norm is non-finite (the log of
    a run with ``logging_nan_inf_filter=False`` and ``logging_steps=1``)."""
    for entry in trainer.state.log_history:
        values = [entry.get("loss"), entry.get("grad_norm")]
        if "step" in entry and any(v is not None and not math.isfinite(v) for v in values):
            return int(entry["step"])
    return None


def telemetry_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]

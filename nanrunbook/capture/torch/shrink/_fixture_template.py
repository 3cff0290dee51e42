"""The pytest file a fixture carries: a program that reads its fixture.json.

Kept as text: it runs in the user's test suite, with torch and pytest only
(nanrunbook is needed only for the bundle's test, which it skips without it).
``__DESCRIPTION__`` and ``__DIRECTORY__`` are filled in by the writer.
"""

from __future__ import annotations

__all__ = ["TEST_SOURCE"]

TEST_SOURCE = '''\
"""Regression test for a non-finite operation, written by nanrunbook's shrink.

__DESCRIPTION__

    pytest __DIRECTORY__/

Until the fix is in, every test passes: the operation still goes non-finite on
the pinned inputs ("reproduces"). Once the fix is in, test_current_code fails
because the current code gives finite values: flip FIXED below to True and it
passes ("fixed"). test_frozen_program keeps reproducing the incident as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# The one line to flip once the fix is in: the current code must then give finite values.
FIXED = False

HERE = Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixture.json").read_text(encoding="utf-8"))
OPERATION = FIXTURE["operation"]
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


def read_tensors(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
    """name -> (tensor, SHA-256 of its stored bytes) from a little-endian safetensors file."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        data = blob[base + begin : base + end]
        dtype = getattr(torch, DTYPES[entry["dtype"]])
        if data:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            tensor = raw.view(dtype).reshape(entry["shape"])
        else:
            tensor = torch.empty(entry["shape"], dtype=dtype)
        tensors[name] = (tensor, hashlib.sha256(data).hexdigest())
    return tensors


TENSORS = read_tensors(HERE / FIXTURE["inputs"]["file"])


def stored_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def build(spec: Any, leaves: list[torch.Tensor]) -> Any:
    """An argument rebuilt from its fixture.json form; tensors are appended to ``leaves``."""
    kind, value = next(iter(spec.items()))
    if kind == "tensor":
        tensor = TENSORS[value["name"]][0].clone()
        if value["requires_grad"]:
            tensor.requires_grad_(True)
        leaves.append(tensor)
        return tensor
    if kind in ("list", "tuple"):
        items = [build(item, leaves) for item in value]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {key: build(item, leaves) for key, item in value}
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return getattr(torch, value)
    if kind == "device":
        return torch.device(value)
    if kind == "slice":
        return slice(*value)
    if kind == "ellipsis":
        return Ellipsis
    return value


def flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in flat(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in flat(item)]
    return []


def nonfinite(tensors: list[torch.Tensor]) -> int:
    count = 0
    for t in tensors:
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.is_floating_point():
            count += int((~torch.isfinite(t.detach().float())).sum())
    return count


def run(program: Any, call: dict[str, Any], *, flat_inputs: bool) -> list[torch.Tensor]:
    """The operation on its pinned inputs, under the autocast and RNG state it ran
    with: its outputs, or for a backward operation the gradients it produced."""
    leaves: list[torch.Tensor] = []
    args, kwargs = build(call["args"], leaves), build(call["kwargs"], leaves)
    autocast = call["autocast"]
    context = (
        torch.autocast(autocast["device_type"], dtype=getattr(torch, autocast["dtype"]))
        if autocast
        else contextlib.nullcontext()
    )
    with torch.random.fork_rng(devices=[]), context:  # the other tests' RNG is left alone
        torch.set_rng_state(TENSORS[call["rng_state"]][0].clone())
        out = program(*leaves) if flat_inputs else program(*args, **kwargs)
    outputs = flat(out)
    if not OPERATION["backward"]:
        return outputs
    given = [None if name is None else TENSORS[name][0] for name in call["grad_output"]]
    # not strict: a node's outputs can be fewer than the function's (max's indices)
    pairs = [
        (o, g) for o, g in zip(outputs, given, strict=False) if g is not None and o.requires_grad
    ]
    params = list(program.parameters()) if isinstance(program, torch.nn.Module) else []
    wrt = [t for t in leaves if t.requires_grad] + [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(
        [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True
    )
    return [g for g in grads if g is not None]


def test_inputs_and_programs_are_the_captured_bits() -> None:
    for name, expected in FIXTURE["inputs"]["sha256"].items():
        assert TENSORS[name][1] == expected, f"{name}: stored bytes changed"
    for name, expected in FIXTURE["files"].items():
        digest = hashlib.sha256((HERE / name).read_bytes()).hexdigest()
        assert digest == expected, f"{name}: file changed"


def test_frozen_program_reproduces() -> None:
    frozen = FIXTURE["program"]["frozen"]
    if frozen is None:
        pytest.skip(FIXTURE["program"]["frozen_note"])
    program = torch.export.load(HERE / frozen).module()
    results = run(program, FIXTURE["inputs"]["op"], flat_inputs=True)
    assert nonfinite(results) > 0, "the incident's operation gave finite values: torch changed?"


def current_module(current: dict[str, Any]) -> torch.nn.Module:
    module = torch.load(HERE / current["file"], weights_only=False)
    state = dict(module.state_dict(keep_vars=True))
    for name, expected in current["state_sha256"].items():
        got = hashlib.sha256(stored_bytes(state[name])).hexdigest()
        assert got == expected, f"{name}: the module's state is not the captured one"
    return module


class Recorded(torch.nn.Module):
    """A stand-in for the model: returns its recorded outputs, one per call."""

    def __init__(self, outputs: list[Any]) -> None:
        super().__init__()
        self.outputs = iter(outputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return next(self.outputs)


def training_script(script: str) -> Any:
    """The training script compute_loss lives in, imported by its path under
    another name than __main__, so its main guard does not run."""
    path = Path(script)
    if not path.is_file():
        pytest.skip(f"the training script {script} is not on this machine")
    sys.path.insert(0, str(path.parent))  # its own imports, as when it ran
    spec = importlib.util.spec_from_file_location("nanrunbook_fixture_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_compute_loss(
    function: str, call: dict[str, Any], script: str | None = None
) -> list[torch.Tensor]:
    """The loop's compute_loss, as the code is now, on the pinned batch, with the
    model's recorded outputs: the loss, or for a backward operation the
    gradients of those outputs."""
    module, _, qualname = function.partition(":")
    compute_loss: Any = (
        training_script(script) if script is not None else importlib.import_module(module)
    )
    for part in qualname.split("."):
        compute_loss = getattr(compute_loss, part)
    leaves: list[torch.Tensor] = []
    batch = build(call["batch"], leaves)
    outputs = [build(spec, leaves) for spec in call["outputs"]]
    with torch.random.fork_rng(devices=[]), contextlib.ExitStack() as regions:
        torch.set_rng_state(TENSORS[call["rng_state"]][0].clone())
        for region in call["autocast"]:  # the autocast the loop opened around it
            regions.enter_context(
                torch.autocast(region["device_type"], dtype=getattr(torch, region["dtype"]))
            )
        loss = compute_loss(Recorded(outputs), batch)
    if not OPERATION["backward"]:
        return flat(loss)
    wrt = [t for t in flat(outputs) if t.requires_grad]
    grads = torch.autograd.grad(loss * call["loss_scale"], wrt, allow_unused=True)
    return [g for g in grads if g is not None]


def test_current_code() -> None:
    current = FIXTURE["program"]["current"]
    if current is None:
        pytest.skip(FIXTURE["program"]["current_note"])
    if current["kind"] == "compute_loss":
        loss_call = FIXTURE["inputs"]["loss"]
        count = nonfinite(run_compute_loss(current["function"], loss_call, current.get("script")))
    else:
        call = FIXTURE["inputs"][current["call"]]
        count = nonfinite(run(current_module(current), call, flat_inputs=False))
    if FIXED:
        assert count == 0, f"still {count} non-finite values: the fix is not in"
    else:
        assert count > 0, (
            "the current code gives finite values on the incident's inputs:"
            " if the fix is in, flip FIXED to True"
        )


def test_bundle_holds_at_the_same_stage() -> None:
    nanrunbook = pytest.importorskip("nanrunbook")
    report = nanrunbook.check_bundle(HERE / FIXTURE["bundle"]["path"])
    decision = report.decision
    assert (decision.decision, decision.earliest_nonfinite_stage) == ("HOLD", OPERATION["stage"])
'''

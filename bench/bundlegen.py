"""A large evidence bundle for the benchmarks, generated once and streamed to disk.

The bundle imitates a capture of a mid-size model's failing step: F32 input
features, BF16 forward activations, an F32 scalar loss, BF16 weight gradients
(one NaN in the middle layer's) with F32 bias gradients, and F32 / F16 optimizer
state, one safetensors file per stage. Tensor sizes stay those of one layer
(8 to 32 MiB); a bigger bundle has more layers, as a bigger model would.

Data is generated in slabs of a few MiB, hashed and counted while written: the
generator never holds a whole tensor. It is written into a temporary directory
and renamed into place once complete, so an interrupted run leaves nothing that
a later run would take for a finished bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

MiB = 1 << 20
GiB = 1 << 30
LAYOUT_VERSION = 1  # bump when the generated content changes
SLAB_ELEMENTS = 1 << 20
HIDDEN = 4096


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    probe: str
    nan_at: int | None = None  # element index to set to NaN

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.elements * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}[self.dtype]


def parse_size(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": MiB, "GIB": GiB, "K": 1 << 10, "M": MiB, "G": GiB, "": 1}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    unit = t[len(number) :]
    if unit not in units:
        raise ValueError(f"size {text!r}: use a number with KiB, MiB or GiB")
    return int(float(number) * units[unit])


def show_size(n: int) -> str:
    return f"{n / GiB:g}GiB" if n % GiB == 0 else f"{n / MiB:g}MiB"


def layout(size: int) -> dict[str, list[Spec]]:
    """Tensors per stage, in capture order, adding up to about ``size`` bytes."""
    per_layer = 1024 * HIDDEN * 2 + HIDDEN * 2048 * (2 + 4 + 2) + HIDDEN * 4
    layers = max(1, size // per_layer)
    rest = max(HIDDEN * 4, size - layers * per_layer - 1024 * 8 - 4)
    features = rest // (4 * HIDDEN) * HIDDEN
    nan_layer = layers // 2
    stages: dict[str, list[Spec]] = {
        "input": [
            Spec("batch/features", "F32", (features // HIDDEN, HIDDEN), "batch['x']"),
            Spec("batch/labels", "I64", (1024,), "batch['y']"),
        ],
        "forward": [],
        "loss": [Spec("loss", "F32", (), "loss before backward")],
        "backward": [],
        "optimizer": [],
    }
    for i in range(layers):
        stages["forward"].append(
            Spec(f"act/layers.{i}", "BF16", (1024, HIDDEN), f"layers.{i} output")
        )
    for i in reversed(range(layers)):  # gradients arrive last layer first
        nan_at = HIDDEN * 2048 // 2 + 12345 if i == nan_layer else None
        stages["backward"].append(
            Spec(f"grad/layers.{i}.weight", "BF16", (HIDDEN, 2048), "param.grad", nan_at)
        )
        stages["backward"].append(Spec(f"grad/layers.{i}.bias", "F32", (HIDDEN,), "param.grad"))
    for i in range(layers):
        stages["optimizer"].append(
            Spec(f"exp_avg/layers.{i}.weight", "F32", (HIDDEN, 2048), "state['exp_avg']")
        )
        stages["optimizer"].append(
            Spec(f"update/layers.{i}.weight", "F16", (HIDDEN, 2048), "lr * update")
        )
    return stages


def _slabs(spec: Spec, rng: np.random.Generator, perturbed: bool = False) -> Iterator[bytes]:
    """The tensor's data; ``perturbed`` flips the lowest bit of every 7th element
    (after drawing, so the random stream, and every other tensor, stay the same)."""
    import numpy as np

    done = 0
    total = spec.elements
    while done < total:
        n = min(SLAB_ELEMENTS, total - done)
        if spec.dtype == "I64":
            data = rng.integers(0, 1000, n, dtype="<i8")
        else:
            values = rng.standard_normal(n, dtype=np.float32)
            if spec.dtype == "F32":
                data = values.astype("<f4")
            elif spec.dtype == "F16":
                data = (values * np.float32(1e-3)).astype("<f2")
            else:  # BF16: the top half of each F32
                data = (values.view("<u4") >> 16).astype("<u2")
            if spec.nan_at is not None and done <= spec.nan_at < done + n:
                data = data.copy()
                nan = {"F32": 0x7FC0_0000, "BF16": 0x7FC0, "F16": 0x7E00}[spec.dtype]
                data.view(f"<u{data.itemsize}")[spec.nan_at - done] = nan
            if perturbed:
                data = data.copy()
                data.view(f"<u{data.itemsize}")[(-done) % 7 :: 7] ^= 1
        yield data.tobytes()
        done += n


def _write_file(
    path: Path, specs: list[Spec], rng: np.random.Generator, perturb: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    from nanrunbook.tensors.counting import Counter

    header: dict[str, Any] = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    entries = []
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for spec in specs:
            digest = hashlib.sha256()
            counter = Counter(spec.dtype)
            for slab in _slabs(spec, rng, spec.name in perturb):
                out.write(slab)
                digest.update(slab)
                counter.feed(slab)
            entries.append({"spec": spec, "sha256": digest.hexdigest(), "tally": counter.result()})
    return entries


def _binding() -> dict[str, Any]:
    return {
        "model": {"id": "model-bench-decoder", "parameters": 1},
        "checkpoint": {"id": "ckpt-step-9000"},
        "data": {"id": "data-bench-v1", "shard": "shard-0001"},
        "batch": {"id": "batch-9042", "size": 1024},
        "loader_cursor": {"id": "cursor-epoch1-pos9042"},
        "objective": {"id": "objective-xent", "reduction": "mean"},
        "optimizer": {"id": "adamw", "lr": 0.0003},
        "scheduler": {"id": "cosine-warmup-2000"},
        "scaler": {
            "id": "gradscaler-dynamic",
            "mode": "dynamic",
            "scale": 65536,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "found_inf": True,
            "step_skipped": True,
            "scale_after": 32768,
        },
        "random_state": {"id": "seed-1234"},
        "environment": {"id": "env-cpu-py311"},
        "topology": {"id": "single-process", "world_size": 1, "rank": 0},
        "precision": {"id": "bf16-mixed", "param_dtype": "F32", "compute_dtype": "BF16"},
    }


OWNERS = {
    "input": "data-oncall",
    "forward": "modeling-oncall",
    "loss": "modeling-oncall",
    "backward": "training-oncall",
    "optimizer": "training-oncall",
}


def generate(target: Path, size: int, seed: int = 0, perturb: tuple[str, ...] = ()) -> None:
    """Write the bundle for ``size`` bytes into ``target`` (which must not exist);
    the tensors named in ``perturb`` differ from the unperturbed bundle's in every
    7th element's lowest bit, every other byte is the same."""
    import numpy as np

    from nanrunbook.manifest.content_id import EVIDENCE_ID_KEY, evidence_content_id

    temp = target.with_name(target.name + ".partial")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    stages = []
    for stage, specs in layout(size).items():
        file = f"{stage}.safetensors"
        entries = _write_file(temp / file, specs, rng, frozenset(perturb))
        tallies = [e["tally"] for e in entries]
        record: dict[str, Any] = {
            "stage": stage,
            "status": "OBSERVED",
            "owner": OWNERS[stage],
            "telemetry_id": f"tel-9042-{stage}",
            "tensor_set": {"id": f"ts-9042-{stage}", "probe_source": f"bench capture of {stage}"},
            "resolution": "complete",
        }
        if stage == "backward":
            record["gradients"] = "unscaled"
        record["tensors"] = [
            {
                "name": e["spec"].name,
                "file": file,
                "dtype": e["spec"].dtype,
                "shape": list(e["spec"].shape),
                "sha256": e["sha256"],
                "probe": e["spec"].probe,
            }
            for e in entries
        ]
        record["counts"] = {
            key: sum(getattr(t, key) for t in tallies)
            for key in ("elements", "finite", "nan", "posinf", "neginf")
        }
        maxima = [
            t.max_abs
            for e, t in zip(entries, tallies, strict=True)
            if t.max_abs is not None and e["spec"].dtype != "I64"
        ]
        record["finite_max_abs"] = max(maxima) if maxima else None
        stages.append(record)
    manifest = _manifest(stages)
    manifest[EVIDENCE_ID_KEY] = evidence_content_id(manifest)
    (temp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(temp, target)


def _manifest(stages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": "nanrunbook-bundle/1",
        "contract_version": "training-incident-v1",
        "evidence_id": "run-bench.step-9042",
        "run": {"run_id": "run-bench", "step": 9042},
        "incident_owner": "ml-oncall",
        "binding": _binding(),
        "last_known_good": {
            "checkpoint_id": "ckpt-step-9000",
            "step": 9000,
            "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
        },
        "stages": stages,
    }


MANY_ELEMENTS = 16  # elements per tensor in the many-tensor bundle


def generate_many(target: Path, tensors: int, seed: int = 0) -> None:
    """A bundle of ``tensors`` small F32 tensors (16 elements each), spread evenly
    over the five stages, one file per stage, one NaN in the first gradient.

    It imitates a capture that records every leaf module and parameter: what
    costs here is the manifest side (JSON, fields, headers), not the data.
    """
    import numpy as np

    from nanrunbook.manifest.content_id import EVIDENCE_ID_KEY, evidence_content_id

    temp = target.with_name(target.name + ".partial")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per_stage = [tensors // 5 + (1 if i < tensors % 5 else 0) for i in range(5)]
    stages = [
        _many_tensor_stage(temp, stage, count, rng)
        for stage, count in zip(OWNERS, per_stage, strict=True)
    ]
    manifest = _manifest(stages)
    manifest[EVIDENCE_ID_KEY] = evidence_content_id(manifest)
    (temp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(temp, target)


def _many_tensor_stage(
    temp: Path, stage: str, count: int, rng: np.random.Generator
) -> dict[str, Any]:
    """One stage of ``generate_many``: its file written, its manifest record."""
    import numpy as np

    from nanrunbook.tensors.counting import tally_bytes

    file = f"{stage}.safetensors"
    values = rng.standard_normal((count, MANY_ELEMENTS), dtype=np.float32)
    if stage == "backward":
        values[0, 3] = np.nan
    names = [f"{stage}/layers.{i}.out" for i in range(count)]
    size = MANY_ELEMENTS * 4
    header = {
        name: {"dtype": "F32", "shape": [MANY_ELEMENTS], "data_offsets": [i * size, (i + 1) * size]}
        for i, name in enumerate(names)
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = values.astype("<f4").tobytes()
    (temp / file).write_bytes(struct.pack("<Q", len(text)) + text + data)
    tally = tally_bytes("F32", data)
    record: dict[str, Any] = {
        "stage": stage,
        "status": "OBSERVED",
        "owner": OWNERS[stage],
        "telemetry_id": f"tel-9042-{stage}",
        "tensor_set": {"id": f"ts-9042-{stage}", "probe_source": f"bench capture of {stage}"},
        "resolution": "complete",
    }
    if stage == "backward":
        record["gradients"] = "unscaled"
    record["tensors"] = [
        {
            "name": name,
            "file": file,
            "dtype": "F32",
            "shape": [MANY_ELEMENTS],
            "sha256": hashlib.sha256(data[i * size : (i + 1) * size]).hexdigest(),
            "probe": f"{name} output",
        }
        for i, name in enumerate(names)
    ]
    record["counts"] = {
        key: getattr(tally, key) for key in ("elements", "finite", "nan", "posinf", "neginf")
    }
    record["finite_max_abs"] = tally.max_abs
    return record


def ensure_many(cache: Path, tensors: int) -> Path:
    """The cached many-tensor bundle, generated on first use in a subprocess."""
    target = cache / f"bundle-{tensors}-tensors-v{LAYOUT_VERSION}"
    if not (target / "manifest.json").is_file():
        print(f"generating {target} (once) ...", flush=True)
        command = [sys.executable, __file__, "--tensors", str(target), str(tensors)]
        subprocess.run(command, check=True)
    return target


def ensure_bundle(cache: Path, size: int, perturb: tuple[str, ...] = ()) -> Path:
    """The cached bundle for ``size``, generated on first use in a subprocess (so
    the caller never loads numpy, and its memory stays out of children's RSS);
    ``perturb`` names tensors that differ (see :func:`generate`)."""
    name = f"bundle-{show_size(size)}-v{LAYOUT_VERSION}"
    if perturb:
        name += "-perturbed-" + hashlib.sha256(",".join(perturb).encode()).hexdigest()[:8]
    target = cache / name
    if not (target / "manifest.json").is_file():
        print(f"generating {target} (once) ...", flush=True)
        argv = [sys.executable, __file__, str(target), str(size), ",".join(perturb)]
        subprocess.run(argv, check=True)
    return target


def tensor_files(bundle: Path) -> list[Path]:
    return sorted(bundle.glob("*.safetensors"))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "--tensors":
        generate_many(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        names = tuple(n for n in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if n)
        generate(Path(sys.argv[1]), int(sys.argv[2]), perturb=names)

"""The capture writer: every dtype counted exactly, sealed, written atomically,
refusing what the check rejects with the check's own codes."""

from __future__ import annotations

import ast
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from fixtures_support import OWNER, binding, finite_writer

import nanrunbook.capture.atomic as atomic
import nanrunbook.capture.writer as writer_module
from nanrunbook import Caps, EvidenceRejected, check_bundle
from nanrunbook.capture import BundleWriter, RawTensor, as_raw
from nanrunbook.capture.writer import NUMPY_DTYPES
from nanrunbook.manifest.content_id import evidence_content_id
from nanrunbook.records import Counts
from nanrunbook.tensors.safetensors_write import safetensors_chunks

# The five parts a recovery point verifies together, stated as every caller must.
RECOVERY = ["model", "optimizer", "scheduler", "scaler", "data_position"]

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("input", "forward", "loss", "backward", "optimizer")


def new_writer(**changes: Any) -> BundleWriter:
    items = binding()
    for name, fields in changes.pop("binding", {}).items():
        if fields is None:
            del items[name]
        else:
            items[name] = fields
    arguments: dict[str, Any] = {
        "run_id": "run-test",
        "step": 10,
        "incident_owner": "ml-oncall",
        "binding": items,
        "last_known_good": {"checkpoint_id": "ckpt-9", "step": 9, "verified_together": RECOVERY},
    }
    arguments.update(changes)
    return BundleWriter(**arguments)


def finite(n: int = 4, offset: float = 0.0) -> np.ndarray:
    return np.arange(n, dtype="float32") + offset


def observe_rest(w: BundleWriter, start: int = 1, **backward: Any) -> None:
    for stage in STAGES[start:]:
        extra = backward if stage == "backward" else {}
        w.observe(
            stage, [(f"{stage}/t", finite(), "probe")], owner=OWNER, probe_source="p", **extra
        )


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def first_probe(bundle: Path) -> str:
    """The probe of the first input tensor, read back through the full check."""
    return check_bundle(bundle).manifest.stages[0].tensors[0].probe


def tree_bytes(bundle: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(bundle.iterdir())}


# ---- tensors: every dtype, counted exactly ---------------------------------------------

SPECIALS = [0.0, -0.0, 1.5, -2.25, np.nan, np.inf, -np.inf, 3.0e4, 1e-3, -np.nan]


def oracle(array: np.ndarray) -> Counts:
    """Counts by value through float32 (or complex64) conversion, independent of the
    bit-pattern engine the writer and the check share."""
    if array.dtype.kind in "biu":
        return Counts(array.size, array.size, 0, 0, 0)
    if array.dtype.kind == "c":
        real, imag = array.real.astype("float32"), array.imag.astype("float32")
        nan = np.isnan(real) | np.isnan(imag)
        inf = ~nan & (np.isinf(real) | np.isinf(imag))
        first_inf = np.where(np.isinf(real), real, imag)
        posinf = int((inf & (first_inf > 0)).sum())
        neginf = int((inf & (first_inf < 0)).sum())
        nonfinite = int(nan.sum()) + posinf + neginf
        return Counts(array.size, array.size - nonfinite, int(nan.sum()), posinf, neginf)
    values = array.astype("float32")
    nan, posinf, neginf = (
        int(np.isnan(values).sum()),
        int(np.isposinf(values).sum()),
        int(np.isneginf(values).sum()),
    )
    return Counts(array.size, array.size - nan - posinf - neginf, nan, posinf, neginf)


def sample(dtype_name: str) -> np.ndarray:
    if dtype_name == "bool":
        return np.array([True, False, True])
    dtype = np.dtype(getattr(ml_dtypes, dtype_name, dtype_name))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, 0, 1, info.max], dtype=dtype)
    if dtype.kind == "c":
        return np.array(
            [
                1 + 2j,
                complex(np.nan, 1),
                complex(np.inf, np.nan),
                complex(-np.inf, 2),
                complex(1, -np.inf),
            ],
            dtype=dtype,
        )
    with np.errstate(invalid="ignore", over="ignore"):
        return np.array(SPECIALS, dtype="float32").astype(dtype).reshape(2, 5)


def bundle_with_input(tmp: Path, tensor: Any) -> tuple[Path, Counts]:
    w = new_writer()
    counts = w.observe("input", [("x", tensor, "x")], owner=OWNER, probe_source="p")
    if counts.nonfinite:
        w.not_run_rest(owner=OWNER, reason="stopped at a non-finite input")
    else:
        observe_rest(w)
    return w.write(tmp / "bundle"), counts


@pytest.mark.parametrize("dtype_name", sorted(NUMPY_DTYPES))
def test_every_numpy_dtype_is_counted_exactly(dtype_name: str, tmp_path: Path) -> None:
    array = sample(dtype_name)
    bundle, counts = bundle_with_input(tmp_path, array)
    assert counts == oracle(array)
    report = check_bundle(bundle)
    assert report.stages[0].counts == counts  # the check's recount agrees
    entry = json.loads((bundle / "manifest.json").read_bytes())["stages"][0]["tensors"][0]
    assert entry["dtype"] == NUMPY_DTYPES[dtype_name]
    assert entry["shape"] == list(array.shape)
    assert as_raw(array).data == array.astype(array.dtype.newbyteorder("<")).tobytes()


def test_float4_is_packed_low_nibble_first(tmp_path: Path) -> None:
    array = np.array([1.0, -0.0, 6.0, -6.0, 0.5, 3.0], dtype=ml_dtypes.float4_e2m1fn)
    raw = as_raw(array)
    assert (raw.dtype, raw.shape) == ("F4", (6,))
    assert raw.data == bytes([0x82, 0xF7, 0x51])  # nibbles 2,8 | 7,15 | 1,5
    bundle, counts = bundle_with_input(tmp_path, array)
    assert counts == Counts(6, 6, 0, 0, 0)
    check_bundle(bundle)
    with pytest.raises(TypeError, match="two elements"):
        as_raw(np.zeros(3, dtype=ml_dtypes.float4_e2m1fn))


@pytest.mark.parametrize(
    "value",
    [
        np.zeros(2, dtype="complex128"),
        np.zeros(2, dtype=ml_dtypes.float6_e2m3fn),
        np.array(["a"]),
        np.array([object()]),
    ],
    ids=["complex128", "float6", "str", "object"],
)
def test_dtypes_without_a_safetensors_name_are_refused(value: np.ndarray) -> None:
    with pytest.raises(TypeError, match="no safetensors dtype"):
        as_raw(value)


def test_big_endian_and_non_contiguous_arrays_are_stored_little_endian_c_order() -> None:
    big = np.array([1.5, np.nan, -np.inf], dtype=">f4")
    assert as_raw(big).data == np.array([1.5, np.nan, -np.inf], dtype="<f4").tobytes()
    transposed = np.arange(6, dtype="<i8").reshape(2, 3).T
    raw = as_raw(transposed)
    assert raw.shape == (3, 2)
    assert raw.data == np.ascontiguousarray(transposed).tobytes()
    fortran = np.asfortranarray(np.arange(6, dtype="<f8").reshape(2, 3))
    assert as_raw(fortran).data == np.arange(6, dtype="<f8").tobytes()


def test_zero_dim_zero_element_and_raw_tensors(tmp_path: Path) -> None:
    w = new_writer()
    w.observe(
        "input",
        [
            ("scalar", np.float32(2.5), "s"),
            ("empty", np.zeros((0, 3), dtype="float16"), "e"),
            ("raw-f6", RawTensor("F6_E3M2", (4,), b"\x00\x01\x02"), "r"),
            ("python-list", [[1, 2], [3, 4]], "l"),
        ],
        owner=OWNER,
        probe_source="p",
    )
    observe_rest(w)
    bundle = w.write(tmp_path / "b")
    entries = json.loads((bundle / "manifest.json").read_bytes())["stages"][0]["tensors"]
    assert [(e["dtype"], e["shape"]) for e in entries] == [
        ("F32", []),
        ("F16", [0, 3]),
        ("F6_E3M2", [4]),
        ("I64", [2, 2]),
    ]
    assert check_bundle(bundle).stages[0].counts == Counts(9, 9, 0, 0, 0)
    raw = RawTensor("BF16", (1,), b"\x80\x7f")
    assert as_raw(raw) is raw


def test_observed_values_are_a_snapshot(tmp_path: Path) -> None:
    """An in-place change after observe() does not reach the evidence."""
    live = finite(4)
    w = new_writer()
    w.observe("input", [("x", live, "x")], owner=OWNER, probe_source="p")
    live[:] = np.nan
    observe_rest(w)
    report = check_bundle(w.write(tmp_path / "b"))
    assert report.decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"


# ---- stages, NOT_RUN and the content id ------------------------------------------------


def test_not_run_marks_later_stages_with_a_reason(tmp_path: Path) -> None:
    w = new_writer()
    w.observe("input", [("x", finite(), "x")], owner=OWNER, probe_source="p")
    w.observe(
        "forward", [("act", np.array([1.0, np.inf], "float32"), "a")], owner=OWNER, probe_source="p"
    )
    w.not_run("loss", owner="loss-owner", reason="the step stopped after a non-finite activation")
    w.not_run_rest(owner=OWNER, reason="not reached")
    assert w.recorded == STAGES
    bundle = w.write(tmp_path / "b")
    stages = json.loads((bundle / "manifest.json").read_bytes())["stages"]
    assert [s["status"] for s in stages] == [
        "OBSERVED",
        "OBSERVED",
        "NOT_RUN",
        "NOT_RUN",
        "NOT_RUN",
    ]
    assert stages[2]["reason"] == "the step stopped after a non-finite activation"
    assert stages[2]["owner"] == "loss-owner"
    assert stages[3]["gradients"] == "unscaled" and stages[4]["reason"] == "not reached"
    assert all(k not in s for s in stages[2:] for k in ("tensors", "counts", "resolution"))
    report = check_bundle(bundle)
    assert (report.decision.decision, report.decision.earliest_nonfinite_stage) == (
        "HOLD",
        "forward",
    )


def test_stages_recorded_out_of_order_are_written_in_contract_order(tmp_path: Path) -> None:
    w = new_writer()
    for stage in reversed(STAGES):
        w.observe(stage, [(f"{stage}/t", finite(), "p")], owner=OWNER, probe_source="p")
    assert [s["stage"] for s in w.manifest()["stages"]] == list(STAGES)
    check_bundle(w.write(tmp_path / "b"))
    with pytest.raises(ValueError, match="already recorded"):
        w.not_run("loss", owner=OWNER, reason="twice")
    with pytest.raises(ValueError, match="unknown stage"):
        new_writer().observe("gradients", [], owner=OWNER, probe_source="p")
    with pytest.raises(ValueError, match="only the backward"):
        new_writer().not_run("loss", owner=OWNER, reason="r", gradients="scaled")


def test_manifest_is_sealed_and_the_seal_binds_every_field(tmp_path: Path) -> None:
    w = finite_writer()
    manifest = w.manifest()
    assert manifest["evidence_content_id"] == evidence_content_id(manifest)
    w.incident_owner = "another-owner"
    assert w.manifest()["evidence_content_id"] != manifest["evidence_content_id"]
    bundle = w.write(tmp_path / "b")
    written = json.loads((bundle / "manifest.json").read_bytes())
    assert written == w.manifest()
    assert check_bundle(bundle).manifest.evidence_content_id == written["evidence_content_id"]


def test_numpy_scalars_in_the_binding_become_json_numbers(tmp_path: Path) -> None:
    w = new_writer(
        binding={"optimizer": {"id": "adamw", "lr": np.float32(0.5), "steps": np.int64(7)}}
    )
    observe_rest(w, start=0)
    bundle = w.write(tmp_path / "b")
    optimizer = json.loads((bundle / "manifest.json").read_bytes())["binding"]["optimizer"]
    assert optimizer == {"id": "adamw", "lr": 0.5, "steps": 7}


# ---- refusals: the check's codes, before anything is written ---------------------------


def dynamic(**fields: Any) -> dict[str, Any]:
    base = {
        "id": "gradscaler",
        "mode": "dynamic",
        "scale": 1024,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "found_inf": False,
        "step_skipped": False,
        "scale_after": 1024,
    }
    return base | fields


def _scale_not_one() -> tuple[BundleWriter, Caps | None]:
    w = new_writer(binding={"scaler": {"id": "none", "mode": "none", "scale": 2}})
    observe_rest(w, start=0)
    return w, None


def _not_run_without_nonfinite() -> tuple[BundleWriter, Caps | None]:
    w = new_writer()
    observe_rest(w, start=0)
    w._stages.pop()
    w.not_run("optimizer", owner=OWNER, reason="skipped for no reason")
    return w, None


def _found_inf_mismatch() -> tuple[BundleWriter, Caps | None]:
    w = new_writer(binding={"scaler": dynamic(found_inf=True, step_skipped=True, scale_after=512)})
    observe_rest(w, start=0)
    return w, None


def _identifier() -> tuple[BundleWriter, Caps | None]:
    w = new_writer(incident_owner="ml oncall; rm -rf /")
    observe_rest(w, start=0)
    return w, None


def _last_known_good() -> tuple[BundleWriter, Caps | None]:
    w = new_writer(
        last_known_good={"checkpoint_id": "ckpt-10", "step": 10, "verified_together": RECOVERY}
    )
    observe_rest(w, start=0)
    return w, None


def _duplicate_name() -> tuple[BundleWriter, Caps | None]:
    w = new_writer()
    for stage in STAGES:
        w.observe(stage, [("same", finite(), "p")], owner=OWNER, probe_source="p")
    return w, None


def _sub_resolution() -> tuple[BundleWriter, Caps | None]:
    w = new_writer()
    observe_rest(w, start=0)
    w._stages.pop()
    w.summarize(
        "optimizer",
        [("opt/state", "F32", (100,), "sampled")],
        Counts(10, 10, 0, 0, 0),
        owner=OWNER,
        probe_source="a 10% sample",
    )
    return w, None


def _missing_binding() -> tuple[BundleWriter, Caps | None]:
    w = new_writer(binding={"scheduler": None})
    observe_rest(w, start=0)
    return w, None


def _unsafe_scale() -> tuple[BundleWriter, Caps | None]:
    w = new_writer(binding={"scaler": dynamic(scale=3.0, scale_after=3.0)})
    observe_rest(w, start=0)
    return w, None


def _cap() -> tuple[BundleWriter, Caps | None]:
    w = new_writer()
    w.observe("input", [("a", finite(), "a"), ("b", finite(), "b")], owner=OWNER, probe_source="p")
    observe_rest(w)
    return w, Caps(max_stage_tensors=1)


REFUSALS: dict[str, Callable[[], tuple[BundleWriter, Caps | None]]] = {
    "SCALER_SCALE_NOT_ONE": _scale_not_one,
    "TRANSITION_NOT_RUN_WITHOUT_NONFINITE": _not_run_without_nonfinite,
    "SCALER_FOUND_INF_MISMATCH": _found_inf_mismatch,
    "IDENTIFIER_INVALID": _identifier,
    "LAST_KNOWN_GOOD_NOT_BEFORE_RUN": _last_known_good,
    "TENSOR_NAME_DUPLICATE": _duplicate_name,
    "SUMMARY_SUB_RESOLUTION": _sub_resolution,
    "FIELD_MISSING": _missing_binding,
    "SCALER_SCALE_UNSAFE": _unsafe_scale,
    "CAP_STAGE_TENSORS": _cap,
}


def materialize(w: BundleWriter, target: Path) -> Path:
    """The bundle the writer would have written, written without any judgement."""
    target.mkdir()
    if w._tensors:
        # A safetensors file cannot repeat a name; the manifest still does.
        unique = {c.name: c.tensor for c in reversed(w._tensors)}
        data = b"".join(safetensors_chunks(list(reversed(unique.items()))))
        (target / "tensors.safetensors").write_bytes(data)
    (target / "manifest.json").write_text(json.dumps(w.manifest(), indent=2))
    return target


@pytest.mark.parametrize("code", sorted(REFUSALS))
def test_writer_refuses_with_the_checks_codes(code: str, tmp_path: Path) -> None:
    w, caps = REFUSALS[code]()
    with pytest.raises(EvidenceRejected) as refused:
        w.write(tmp_path / "bundle", caps=caps)
    assert code in refused.value.codes
    assert listing(tmp_path) == []  # nothing at the target, no temporary left
    with pytest.raises(EvidenceRejected) as rejected:
        check_bundle(materialize(w, tmp_path / "raw"), caps=caps)
    assert set(refused.value.codes) == set(rejected.value.codes)


def test_the_writer_never_states_a_recovery_point_for_the_caller(tmp_path: Path) -> None:
    """A last_known_good without verified_together is refused, naming the field: the
    writer used to fill in all five parts, so a bundle claimed a recovery point that
    nobody had verified."""
    unstated = {"checkpoint_id": "ckpt-9", "step": 9}
    with pytest.raises(ValueError, match="last_known_good needs 'verified_together'"):
        new_writer(last_known_good=unstated)
    # What the caller states is what the bundle says, in the caller's order...
    stated = ["data_position", "scaler", "scheduler", "optimizer", "model"]
    w = new_writer(last_known_good={**unstated, "verified_together": stated})
    observe_rest(w, start=0)
    manifest = json.loads((w.write(tmp_path / "b") / "manifest.json").read_bytes())
    assert manifest["last_known_good"]["verified_together"] == stated
    # ...and a partial statement is not completed: the check refuses it as partial.
    partial = new_writer(last_known_good={**unstated, "verified_together": ["model"]})
    observe_rest(partial, start=0)
    with pytest.raises(EvidenceRejected) as refused:
        partial.write(tmp_path / "partial")
    assert refused.value.codes == ("LAST_KNOWN_GOOD_INCOMPLETE",)


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (float("nan"), "JSON_NONFINITE_NUMBER"),
        (float("inf"), "JSON_NONFINITE_NUMBER"),
        (2**60, "JSON_INTEGER_OUT_OF_RANGE"),
        (Path("/x"), "FIELD_TYPE"),
    ],
)
def test_values_without_an_exact_json_form_are_refused(
    value: Any, code: str, tmp_path: Path
) -> None:
    """orjson would write NaN as null; the writer refuses instead of changing evidence."""
    w = new_writer(binding={"optimizer": {"id": "adamw", "lr": value}})
    observe_rest(w, start=0)
    with pytest.raises(EvidenceRejected) as refused:
        w.write(tmp_path / "bundle")
    assert refused.value.codes == (code,)
    assert refused.value.violations[0].where == "$.binding.optimizer.lr"
    assert listing(tmp_path) == []


def test_recount_rejection_from_the_full_check_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault only the data reveals (the bytes differ from what was counted) is
    caught by the check the writer runs on the finished temporary bundle."""
    w = finite_writer()
    captured = w._tensors[0]
    w._tensors[0] = dataclasses.replace(
        captured,
        data=np.full(4, np.nan, "float32").tobytes(),
    )
    with pytest.raises(EvidenceRejected) as refused:
        w.write(tmp_path / "bundle")
    assert "DIGEST_MISMATCH" in refused.value.codes
    assert listing(tmp_path) == []


# ---- atomic writes and overwrite --------------------------------------------------------


def test_existing_bundle_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    first = finite_writer(probe="first").write(tmp_path / "b")
    before = tree_bytes(first)
    second = finite_writer(probe="second")
    with pytest.raises(FileExistsError):
        second.write(first)
    assert tree_bytes(first) == before
    second.write(first, overwrite=True)
    assert tree_bytes(first) != before
    assert first_probe(first) == "second"
    assert listing(tmp_path) == ["b"]  # no temporary, no old copy left


@pytest.mark.parametrize("kind", ["empty-dir", "dir-with-files", "file", "symlink"])
def test_overwrite_replaces_only_a_bundle(kind: str, tmp_path: Path) -> None:
    target = tmp_path / "target"
    if kind == "empty-dir":
        target.mkdir()
    elif kind == "dir-with-files":
        target.mkdir()
        (target / "notes.txt").write_text("precious")
    elif kind == "file":
        target.write_text("precious")
    else:
        real = finite_writer().write(tmp_path / "real")
        target.symlink_to(real)
    with pytest.raises(FileExistsError):
        finite_writer().write(target, overwrite=True)
    if kind == "dir-with-files":
        assert (target / "notes.txt").read_text() == "precious"
    if kind == "file":
        assert target.read_text() == "precious"
    if kind == "symlink":
        assert target.is_symlink()


def test_a_bundle_appearing_meanwhile_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "b"
    import nanrunbook.check

    real_check = nanrunbook.check.check_bundle

    def racing(path: Any, **kwargs: Any) -> Any:
        target.mkdir()
        (target / "manifest.json").write_text("someone else's")
        return real_check(path, **kwargs)

    monkeypatch.setattr(nanrunbook.check, "check_bundle", racing)
    with pytest.raises(FileExistsError):
        finite_writer().write(target)
    assert (target / "manifest.json").read_text() == "someone else's"
    assert listing(tmp_path) == ["b"]


def test_no_replace_rename_refuses_an_empty_directory(tmp_path: Path) -> None:
    """os.rename silently replaces an empty directory; the final rename must not."""
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    with pytest.raises(FileExistsError):
        assert atomic._renameat2(source, target, atomic._RENAME_NOREPLACE)
    assert source.is_dir() and target.is_dir()
    (source / "x").write_text("new")
    assert atomic._renameat2(source, target, atomic._RENAME_EXCHANGE)
    assert (target / "x").read_text() == "new" and source.is_dir() and not list(source.iterdir())


def failing_after(
    first_chunks: int, error: BaseException
) -> Callable[[Path, Iterable[bytes]], None]:
    """write_synced that writes ``first_chunks`` chunks of the file, then fails."""

    def write(path: Path, chunks: Iterable[bytes]) -> None:
        with open(path, "wb") as out:
            for index, chunk in enumerate(chunks):
                if index == first_chunks:
                    raise error
                out.write(chunk)

    return write


def big_writer(probe: str = "big", megabytes: int = 8) -> BundleWriter:
    w = new_writer()
    per = megabytes * 2**20 // 4 // 8
    w.observe(
        "input",
        [(f"x{i}", np.full(per, i, "float32"), probe) for i in range(8)],
        owner=OWNER,
        probe_source="p",
    )
    observe_rest(w)
    return w


@pytest.mark.parametrize(
    "error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()]
)
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_nothing_and_keeps_the_old_bundle(
    error: BaseException, existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "b"
    before = tree_bytes(finite_writer().write(target)) if existing else None
    monkeypatch.setattr(writer_module, "write_synced", failing_after(3, error))
    with pytest.raises(type(error)):
        big_writer().write(target, overwrite=existing)
    if existing:
        assert tree_bytes(target) == before
        check_bundle(target)
    else:
        assert not target.exists()
    assert listing(tmp_path) == (["b"] if existing else [])


KILLED_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    import nanrunbook.capture.writer as writer_module
    import nanrunbook.check
    from test_capture import big_writer

    target, where = sys.argv[1], sys.argv[2]
    real_chunks = writer_module.safetensors_chunks
    real_check = nanrunbook.check.check_bundle

    def announce():
        print("WRITING", flush=True)
        time.sleep(120)

    def slow_chunks(tensors):
        for index, chunk in enumerate(real_chunks(tensors)):
            yield chunk
            if where == "data" and index == 4:
                announce()

    def slow_check(path, **kwargs):
        if where == "check":
            announce()
        return real_check(path, **kwargs)

    writer_module.safetensors_chunks = slow_chunks
    nanrunbook.check.check_bundle = slow_check
    big_writer(probe="new", megabytes=int(sys.argv[3])).write(target, overwrite=True)
    print("DONE", flush=True)
    """
)


def run_child(tmp: Path, target: Path, where: str, megabytes: int = 16) -> subprocess.Popen[str]:
    script = tmp / "child.py"
    script.write_text(KILLED_CHILD.format(tests=str(Path(__file__).parent)))
    return subprocess.Popen(
        [sys.executable, str(script), str(target), where, str(megabytes)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("where", ["data", "check"])
@pytest.mark.parametrize("existing", [False, True])
def test_sigkill_mid_write_leaves_nothing_at_the_target(
    where: str, existing: bool, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    target = work / "b"
    before = tree_bytes(finite_writer(probe="old").write(target)) if existing else None
    child = run_child(tmp_path, target, where)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "WRITING"
        temporaries = [p for p in work.iterdir() if p.name.startswith(".b.")]
        assert len(temporaries) == 1 and any(temporaries[0].iterdir())  # caught mid-write
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    if existing:
        assert tree_bytes(target) == before
        assert first_probe(target) == "old"
    else:
        assert not target.exists()
    # What a kill leaves is a hidden temporary beside the target, never the target.
    assert [p.name for p in work.iterdir() if not p.name.startswith(".b.")] == (
        ["b"] if existing else []
    )


def test_sigkill_at_any_moment_leaves_the_old_bundle_or_the_new_one(tmp_path: Path) -> None:
    """No hooks: a real write of a 32 MiB bundle killed after growing delays. The
    target always holds a whole bundle that checks, the old one or the new one."""
    target = tmp_path / "b"
    finite_writer(probe="old").write(target)
    seen = set()
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_capture import big_writer
            print("START", flush=True)
            big_writer(probe="new", megabytes=32).write(sys.argv[1], overwrite=True)
            """
        )
    )
    for delay in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, None):
        child = subprocess.Popen(
            [sys.executable, str(script), str(target)], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "START"
            try:
                child.wait(timeout=delay if delay is not None else 120)
            except subprocess.TimeoutExpired:
                os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=60)
        if delay is None:
            assert child.returncode == 0  # the last one was left to finish
        probe = first_probe(target)
        assert probe in ("old", "new")
        seen.add(probe)
    assert seen == {"old", "new"}
    assert first_probe(target) == "new"


def test_the_writer_imports_no_framework() -> None:
    """The writer takes bytes and numpy; torch tensors need nanrunbook.capture.torch,
    which imports the writer (never the reverse) and registers its converter."""
    writer_source = (ROOT / "nanrunbook" / "capture" / "writer.py").read_text()
    imported: set[str] = set()
    for node in ast.walk(ast.parse(writer_source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not any(name.split(".")[0] in {"torch", "jax"} for name in imported), imported
    assert not any(name.startswith("nanrunbook.capture.torch") for name in imported), imported
    script = (
        "import sys, torch\n"
        "from nanrunbook.capture import as_raw\n"
        "assert 'nanrunbook.capture.torch' not in sys.modules\n"
        "try:\n"
        "    as_raw(torch.ones(2, dtype=torch.bfloat16))\n"
        "except TypeError as error:\n"
        "    print(error)\n"
        "import nanrunbook.capture.torch\n"
        "print(as_raw(torch.ones(2, dtype=torch.bfloat16)).dtype)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    refusal, dtype = done.stdout.strip().splitlines()
    assert "import the capture module" in refusal and "nanrunbook.capture.torch" in refusal
    assert dtype == "BF16"


def test_a_large_stage_is_sealed_in_parallel_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counting and hashing spread over threads give the manifest a sequential
    pass gives, entry for entry, in capture order."""
    rng = np.random.default_rng(3)
    tensors = [
        (f"t{i}", rng.standard_normal(1000 * (i % 5 + 1)).astype("<f4"), "p") for i in range(40)
    ]
    tensors[7][1][3] = np.nan

    def manifest(threshold: int) -> dict[str, Any]:
        monkeypatch.setattr(writer_module, "_PARALLEL_BYTES", threshold)
        w = new_writer()
        w.observe("input", tensors, owner=OWNER, probe_source="p")
        w.not_run_rest(owner=OWNER, reason="stopped")
        return w.manifest()

    assert manifest(0) == manifest(1 << 40)

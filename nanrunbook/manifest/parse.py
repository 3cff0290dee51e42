"""manifest.json to records: every field's type, form and presence (spec sections 2-5).

Parsing is kept apart from judging: this module reads what the manifest says and
the rules it can see within one record; :mod:`nanrunbook.manifest.rules` holds the rules
that relate records. A record is built only when nothing in it is wrong, so a
later rule never reasons over a half-read value, and every violation found is
still reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter
from types import MappingProxyType
from typing import Any

from nanrunbook.access import check_relative_path
from nanrunbook.codes import PARSE_CODES as CODES
from nanrunbook.contract import (
    BUNDLE_FORMAT,
    CONTRACT_VERSION,
    MAX_FREE_TEXT,
    MAX_TENSOR_NAME,
    STAGE_ORDER,
    Caps,
)
from nanrunbook.dtypes import DTYPES
from nanrunbook.errors import Violation
from nanrunbook.manifest import rules as rules
from nanrunbook.manifest.content_id import EVIDENCE_ID_FORM, EVIDENCE_ID_PREFIX
from nanrunbook.manifest.fields import Fields, Sink, is_integer, is_number, json_type
from nanrunbook.records import (
    Binding,
    Counts,
    LastKnownGood,
    Manifest,
    Scaler,
    StageRecord,
    TensorEntry,
    element_count,
    element_counts,
    frozen_records,
)
from nanrunbook.strictjson import MAX_SAFE_INTEGER, child_path, power_of_two_text

__all__ = ["CODES", "parse_manifest"]

SHA256_FORM = re.compile(r"[0-9a-f]{64}")

TOP_LEVEL_FIELDS = (
    "format",
    "contract_version",
    "evidence_id",
    "evidence_content_id",
    "run",
    "incident_owner",
    "binding",
    "last_known_good",
    "stages",
)
BINDING_ITEMS = (
    "model",
    "checkpoint",
    "data",
    "batch",
    "loader_cursor",
    "objective",
    "optimizer",
    "scheduler",
    "scaler",
    "random_state",
    "environment",
    "topology",
    "precision",
)
# Typed fields of binding items, beyond "id"; all are required.
TYPED_FIELDS = {
    "topology": ("world_size", "rank"),
    "precision": ("param_dtype", "compute_dtype"),
    "objective": ("reduction",),
    "scaler": ("mode", "scale"),
}
DYNAMIC_FIELDS = ("growth_factor", "backoff_factor", "found_inf", "step_skipped", "scale_after")
RECOVERY_PARTS = ("model", "optimizer", "scheduler", "scaler", "data_position")
REDUCTIONS = ("mean", "sum", "none")
SCALER_MODES = ("none", "static", "dynamic")
STATUSES = ("OBSERVED", "NOT_RUN")
RESOLUTIONS = ("complete", "summary")
GRADIENT_FORMS = ("unscaled", "scaled")


def parse_manifest(
    tree: dict[str, Any], caps: Caps | None = None
) -> tuple[Manifest | None, list[Violation]]:
    """Records from a strictly parsed manifest tree, and every violation seen.

    The manifest is returned only when no violation was found.
    """
    sink = Sink()
    top = Fields(sink, tree, "$", required=TOP_LEVEL_FIELDS)
    fmt, version, evidence_id, content_id, incident_owner = _identity(sink, top)
    run_id: str | None = None
    step: int | None = None
    if top.has("run"):
        run = Fields(sink, top.raw("run"), top.at("run"), required=("run_id", "step"))
        run_id = run.identifier("run_id")
        step = run.integer("step", minimum=0)
    lkg = _last_known_good(sink, top) if top.has("last_known_good") else None
    if lkg is not None and step is not None and lkg.step >= step:
        sink.add(
            "LAST_KNOWN_GOOD_NOT_BEFORE_RUN",
            top.at("last_known_good") + ".step",
            f"last known-good step {lkg.step} is not before run step {step}",
        )
    binding = _binding(sink, top.raw("binding"), top.at("binding")) if top.has("binding") else None
    read = _stages(sink, top) if top.has("stages") else None
    stages = _all_five(read)
    if stages is not None:
        sink.violations.extend(_across_records(stages, binding, caps or Caps()))
    elif read:  # a record with violations of its own: the others are still compared
        records = {index: record for index, record in enumerate(read) if record is not None}
        sink.violations.extend(rules.records_violations(records, "$.stages", caps or Caps()))

    if sink.violations:
        return None, sink.violations
    assert fmt and version and evidence_id and content_id and incident_owner
    assert run_id is not None and step is not None
    assert lkg is not None and binding is not None and stages is not None
    manifest = Manifest(
        format=fmt,
        contract_version=version,
        evidence_id=evidence_id,
        evidence_content_id=content_id,
        run_id=run_id,
        step=step,
        incident_owner=incident_owner,
        binding=binding,
        last_known_good=lkg,
        stages=stages,
    )
    return manifest, []


def _identity(sink: Sink, top: Fields) -> tuple[str | None, ...]:
    """format, contract_version, evidence_id, evidence_content_id, incident_owner."""
    fmt = top.string("format")
    if fmt is not None and fmt != BUNDLE_FORMAT:
        sink.add("FORMAT_UNSUPPORTED", top.at("format"), f"expected {BUNDLE_FORMAT!r}")
    version = top.string("contract_version")
    if version is not None and version != CONTRACT_VERSION:
        sink.add(
            "CONTRACT_VERSION_UNSUPPORTED",
            top.at("contract_version"),
            f"expected {CONTRACT_VERSION!r}",
        )
    evidence_id = top.identifier("evidence_id")
    content_id = top.string("evidence_content_id")
    if content_id is not None and not EVIDENCE_ID_FORM.fullmatch(content_id):
        sink.add(
            "EVIDENCE_CONTENT_ID_INVALID",
            top.at("evidence_content_id"),
            f"expected {EVIDENCE_ID_PREFIX}<64 lowercase hex>",
        )
        content_id = None
    return fmt, version, evidence_id, content_id, top.identifier("incident_owner")


def _across_records(
    stages: tuple[StageRecord, ...], binding: Binding | None, caps: Caps
) -> list[Violation]:
    """The rules that relate the stage records to one another and to the scaler."""
    found = rules.stage_set_violations(stages, "$.stages", caps)
    if binding is not None:
        gradients = next((s.gradients for s in stages if s.stage == "backward"), None)
        found.extend(rules.scaled_gradients_violations(binding.scaler, gradients, "$"))
        # Against the declared counts here, so a contradiction costs no data read.
        found.extend(rules.found_inf_violations(binding.scaler, stages, "$"))
    return found


def _last_known_good(sink: Sink, top: Fields) -> LastKnownGood | None:
    before = len(sink)
    lkg = Fields(
        sink,
        top.raw("last_known_good"),
        top.at("last_known_good"),
        required=("checkpoint_id", "step", "verified_together"),
    )
    checkpoint_id = lkg.identifier("checkpoint_id")
    step = lkg.integer("step", minimum=0)
    parts = lkg.array("verified_together")
    if parts is not None and not (
        len(parts) == len(RECOVERY_PARTS)
        and all(isinstance(p, str) for p in parts)
        and sorted(parts) == sorted(RECOVERY_PARTS)
    ):
        sink.add(
            "LAST_KNOWN_GOOD_INCOMPLETE",
            lkg.at("verified_together"),
            "a recovery point counts only if model, optimizer, scheduler, scaler and "
            "data_position were verified together, each listed once",
        )
    if len(sink) > before:
        return None
    assert checkpoint_id is not None and step is not None and parts is not None
    return LastKnownGood(checkpoint_id, step, tuple(parts))


def _binding(sink: Sink, value: Any, path: str) -> Binding | None:
    before = len(sink)
    top = Fields(sink, value, path, required=BINDING_ITEMS)
    items: dict[str, Fields] = {}
    ids: dict[str, str] = {}
    for name in BINDING_ITEMS:
        item, item_id = _binding_item(sink, top, name)
        if item is not None:
            items[name] = item
        if item_id is not None:
            ids[name] = item_id
    world_size = rank = None
    if "topology" in items:
        world_size, rank = _topology(sink, items["topology"])
    param_dtype = compute_dtype = None
    if "precision" in items:
        precision = items["precision"]
        param_dtype = _dtype(sink, precision, "param_dtype")
        compute_dtype = _dtype(sink, precision, "compute_dtype")
    reduction = items["objective"].choice("reduction", REDUCTIONS) if "objective" in items else None
    scaler = _scaler(sink, items["scaler"]) if "scaler" in items else None

    if len(sink) > before:
        return None
    assert world_size is not None and rank is not None and reduction is not None
    assert param_dtype is not None and compute_dtype is not None and scaler is not None
    return Binding(
        ids=MappingProxyType(ids),
        details=MappingProxyType(
            {name: MappingProxyType(dict(item.data)) for name, item in items.items()}
        ),
        world_size=world_size,
        rank=rank,
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        reduction=reduction,
        scaler=scaler,
    )


def _binding_item(sink: Sink, top: Fields, name: str) -> tuple[Fields | None, str | None]:
    """One binding item and its id: required fields, extra detail of a plain type."""
    if not top.has(name):
        return None, None
    item = Fields(
        sink,
        top.raw(name),
        top.at(name),
        required=("id", *TYPED_FIELDS.get(name, ())),
        open_ended=True,
    )
    if not item.ok:
        return None, None
    item_id = item.identifier("id")
    typed = {"id", *TYPED_FIELDS.get(name, ()), *(DYNAMIC_FIELDS if name == "scaler" else ())}
    for key, detail in item.data.items():
        # Extra detail: strings, integers or finite numbers (strictjson already
        # rejected non-finite literals).
        if key not in typed and not (isinstance(detail, str) or is_number(detail)):
            sink.add(
                "FIELD_TYPE",
                item.at(key),
                f"a binding detail must be a string or a number, got {json_type(detail)}",
            )
    return item, item_id


def _topology(sink: Sink, topo: Fields) -> tuple[int | None, int | None]:
    world_size = topo.integer("world_size", minimum=1)
    rank = topo.integer("rank", minimum=0)
    if world_size is not None and rank is not None and rank >= world_size:
        sink.add(
            "TOPOLOGY_INVALID", topo.at("rank"), f"rank {rank} is not below world_size {world_size}"
        )
    return world_size, rank


def _dtype(sink: Sink, fields: Fields, key: str) -> str | None:
    value = fields.string(key)
    if value is not None and value not in DTYPES:
        sink.add("DTYPE_UNKNOWN", fields.at(key), "not a safetensors dtype name")
        return None
    return value


def _scaler(sink: Sink, fields: Fields) -> Scaler | None:
    before = len(sink)
    mode = fields.choice("mode", SCALER_MODES)
    scale = fields.number("scale")
    dynamic: dict[str, Any] = {}
    if mode == "dynamic":
        for key in DYNAMIC_FIELDS:
            if not fields.has(key):
                sink.add("FIELD_MISSING", fields.at(key), f"dynamic scaler requires {key!r}")
        dynamic = {
            "growth_factor": fields.number("growth_factor"),
            "backoff_factor": fields.number("backoff_factor"),
            "found_inf": fields.boolean("found_inf"),
            "step_skipped": fields.boolean("step_skipped"),
            "scale_after": fields.number("scale_after"),
        }
    elif mode is not None:
        for key in DYNAMIC_FIELDS:
            if fields.has(key):
                sink.add(
                    "SCALER_FIELD_NOT_ALLOWED",
                    fields.at(key),
                    f"{key!r} belongs to mode dynamic only",
                )
    if len(sink) > before or mode is None or scale is None:  # a missing one is reported
        return None
    scaler = Scaler(mode=mode, scale=scale, **dynamic)
    problems = rules.scaler_violations(scaler, fields.path)
    sink.violations.extend(problems)
    return None if problems else scaler


def _stages(sink: Sink, top: Fields) -> list[StageRecord | None] | None:
    """Each stage record, None where it has violations of its own; None when
    ``stages`` is not an array."""
    records = top.array("stages")
    if records is None:
        return None
    path = top.at("stages")
    if len(records) != len(STAGE_ORDER):
        sink.add("STAGES_NOT_FIVE", path, f"expected exactly 5 stage records, got {len(records)}")
    return [_stage(sink, value, child_path(path, i)) for i, value in enumerate(records)]


def _all_five(read: list[StageRecord | None] | None) -> tuple[StageRecord, ...] | None:
    """The five records, when there are five and each was read without violation."""
    if read is None or len(read) != len(STAGE_ORDER) or any(r is None for r in read):
        return None
    return tuple(record for record in read if record is not None)


STAGE_FIELDS = (
    "resolution",
    "gradients",
    "tensors",
    "counts",
    "finite_max_abs",
    "reason",
)


def _stage(sink: Sink, value: Any, path: str) -> StageRecord | None:
    before = len(sink)
    rec = Fields(
        sink,
        value,
        path,
        required=("stage", "status", "owner", "telemetry_id", "tensor_set"),
        optional=STAGE_FIELDS,
    )
    if not rec.ok:
        return None
    stage = rec.choice("stage", STAGE_ORDER)
    status = rec.choice("status", STATUSES)
    owner = rec.identifier("owner")
    telemetry_id = rec.identifier("telemetry_id")
    tensor_set_id = probe_source = None
    if rec.has("tensor_set"):
        tset = Fields(
            sink, rec.raw("tensor_set"), rec.at("tensor_set"), required=("id", "probe_source")
        )
        tensor_set_id = tset.identifier("id")
        probe_source = tset.text("probe_source")

    gradients = _gradients(sink, rec, stage)
    resolution, tensors, counts, finite_max_abs, reason = _observation(sink, rec, status)
    if len(sink) > before:
        return None
    assert stage and status and owner and telemetry_id and tensor_set_id is not None
    assert probe_source is not None and tensors is not None
    record = StageRecord(
        stage=stage,
        status=status,
        owner=owner,
        telemetry_id=telemetry_id,
        tensor_set_id=tensor_set_id,
        probe_source=probe_source,
        resolution=resolution,
        gradients=gradients,
        tensors=tensors,
        counts=counts,
        finite_max_abs=finite_max_abs,
        finite_max_abs_declared=rec.has("finite_max_abs"),
        reason=reason,
    )
    problems = rules.stage_violations(record, path)
    sink.violations.extend(problems)
    return None if problems else record


def _gradients(sink: Sink, rec: Fields, stage: str | None) -> str | None:
    if stage == "backward" and not rec.has("gradients"):
        sink.add("FIELD_MISSING", rec.at("gradients"), "the backward record states its gradients")
    if stage is not None and stage != "backward" and rec.has("gradients"):
        sink.add(
            "STAGE_FIELD_NOT_ALLOWED", rec.at("gradients"), "only the backward record has gradients"
        )
    return rec.choice("gradients", GRADIENT_FORMS)


_Observation = tuple[
    str | None, tuple[TensorEntry, ...] | None, Counts | None, float | None, str | None
]


def _observation(sink: Sink, rec: Fields, status: str | None) -> _Observation:
    """resolution, tensors, counts, finite_max_abs and reason, as the status allows."""
    if status == "NOT_RUN":
        for key in ("resolution", "tensors", "counts", "finite_max_abs"):
            if rec.has(key):
                sink.add("STAGE_FIELD_NOT_ALLOWED", rec.at(key), f"a NOT_RUN stage has no {key!r}")
        if not rec.has("reason"):
            sink.add("FIELD_MISSING", rec.at("reason"), "a NOT_RUN stage states its reason")
        return None, (), None, None, rec.text("reason")
    if status != "OBSERVED":
        return None, (), None, None, None
    for key in ("resolution", "tensors", "counts"):
        if not rec.has(key):
            sink.add("FIELD_MISSING", rec.at(key), f"an OBSERVED stage requires {key!r}")
    resolution = rec.choice("resolution", RESOLUTIONS)
    tensors = _tensors(sink, rec, resolution)
    counts = _counts(sink, rec)
    finite_max_abs = None
    if rec.has("finite_max_abs") and rec.raw("finite_max_abs") is not None:
        finite_max_abs = rec.number("finite_max_abs")
    return resolution, tensors, counts, finite_max_abs, rec.text("reason")


def _counts(sink: Sink, rec: Fields) -> Counts | None:
    if not rec.has("counts"):
        return None
    before = len(sink)
    keys = ("elements", "finite", "nan", "posinf", "neginf")
    fields = Fields(sink, rec.raw("counts"), rec.at("counts"), required=keys)
    values = {key: fields.integer(key, minimum=0) for key in keys}
    if len(sink) > before:
        return None
    return Counts(**{k: v for k, v in values.items() if v is not None})


def _tensors(sink: Sink, rec: Fields, resolution: str | None) -> tuple[TensorEntry, ...] | None:
    entries = rec.array("tensors")
    if entries is None:
        return None
    if not entries:
        sink.add("TENSORS_EMPTY", rec.at("tensors"), "an OBSERVED stage lists at least one tensor")
        return None
    plain = _plain_tensors(entries, resolution)
    if plain is not None:
        return plain
    before = len(sink)
    path = rec.at("tensors")
    parsed = [
        _tensor(sink, entry, child_path(path, index), resolution)
        for index, entry in enumerate(entries)
    ]
    if len(sink) > before:
        return None
    return tuple(p for p in parsed if p is not None)


# The keys of a tensor entry, by resolution, in TensorEntry's order.
_ENTRY_FIELDS = {
    "complete": ("name", "dtype", "shape", "probe", "file", "sha256"),
    "summary": ("name", "dtype", "shape", "probe"),
}
_HEX_DIGITS = b"0123456789abcdef"
MAX_ELEMENTS = MAX_SAFE_INTEGER  # no cap can be higher (Caps), no count can declare more


def _plain_tensors(entries: list[Any], resolution: str | None) -> tuple[TensorEntry, ...] | None:
    """A stage's entries as a producer writes them, read column by column.

    Each test runs over a whole column in C (``map``, ``set``, ``join``) instead
    of field by field in Python. None unless every entry is plainly right: then
    :func:`_tensor` reads each entry again and words each problem. It accepts
    every entry this accepts, with the same result (tests/test_parse_fast.py).
    """
    fields = _ENTRY_FIELDS.get(resolution or "")
    if fields is None or set(map(type, entries)) != {dict}:
        return None
    if set(map(len, entries)) != {len(fields)}:
        return None
    try:  # a column at a time: no row tuples to build and take apart again
        columns = [list(map(itemgetter(key), entries)) for key in fields]
    except KeyError:
        return None
    names, dtypes, shapes, probes = columns[:4]
    if not (_texts(names, 1, MAX_TENSOR_NAME) and _texts(probes, 0, MAX_FREE_TEXT)):
        return None
    if set(map(type, dtypes)) != {str} or not DTYPES.keys() >= set(dtypes):
        return None
    if element_counts(shapes, MAX_ELEMENTS) is None:
        return None
    files: Iterable[str | None] = repeat(None)
    digests: Iterable[str | None] = repeat(None)
    if resolution == "complete":
        files, digests = columns[4], columns[5]
        if not (_hex_digests(digests) and _safe_files(files)):
            return None
    return tuple(
        frozen_records(TensorEntry, names, dtypes, map(tuple, shapes), probes, files, digests)
    )


def _texts(values: list[Any], shortest: int, longest: int) -> bool:
    """Strings, each printable and of a length within the bounds."""
    if set(map(type, values)) != {str}:
        return False
    lengths = set(map(len, values))
    return min(lengths) >= shortest and max(lengths) <= longest and _printable("".join(values))


_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))


def _printable(text: str) -> bool:
    """``str.isprintable``; for ASCII text (known without a scan) a ``translate``
    that keeps only C0 and DEL, some three times faster."""
    if text.isascii():
        return not text.encode("ascii").translate(None, _PRINTABLE_ASCII)
    return text.isprintable()


def _hex_digests(values: list[Any]) -> bool:
    """64 lowercase hex digits each (SHA256_FORM)."""
    if set(map(type, values)) != {str} or set(map(len, values)) != {64}:
        return False
    joined = "".join(values)
    return joined.isascii() and not joined.encode().translate(None, _HEX_DIGITS)


def _safe_files(values: list[Any]) -> bool:
    return set(map(type, values)) == {str} and not any(map(check_relative_path, set(values)))


def _tensor(sink: Sink, value: Any, path: str, resolution: str | None) -> TensorEntry | None:
    before = len(sink)
    required = ["name", "dtype", "shape", "probe"]
    if resolution == "complete":
        required += ["file", "sha256"]
    entry = Fields(sink, value, path, required=required, optional=("file", "sha256"))
    if not entry.ok:
        return None
    if resolution == "summary":
        for key in ("file", "sha256"):
            if entry.has(key):
                sink.add(
                    "ENTRY_FIELD_NOT_ALLOWED", entry.at(key), f"a summary entry has no {key!r}"
                )
    name = entry.tensor_name("name")
    dtype = _dtype(sink, entry, "dtype")
    probe = entry.text("probe")
    file = entry.string("file")
    if file is not None:
        for problem in check_relative_path(file):
            sink.add(problem.code, entry.at("file"), problem.message)
    sha256 = entry.string("sha256")
    if sha256 is not None and not SHA256_FORM.fullmatch(sha256):
        sink.add("DIGEST_INVALID", entry.at("sha256"), "expected 64 lowercase hex digits")
    shape = entry.array("shape")
    if shape is not None and not all(is_integer(d) and d >= 0 for d in shape):
        sink.add("SHAPE_INVALID", entry.at("shape"), "a shape is an array of integers >= 0")
    elif shape is not None and element_count(shape, MAX_ELEMENTS) is None:
        # Past every cap; stop before a product of thousands of digits is computed.
        sink.add(
            "CAP_STAGE_ELEMENTS",
            entry.at("shape"),
            f"the shape alone holds more than {power_of_two_text(MAX_ELEMENTS)} elements,"
            " above any cap",
        )
    if len(sink) > before:
        return None
    assert name is not None and dtype is not None and probe is not None and shape is not None
    return TensorEntry(
        name=name, dtype=dtype, shape=tuple(shape), probe=probe, file=file, sha256=sha256
    )

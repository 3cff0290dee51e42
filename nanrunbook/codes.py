"""Every violation code nanrunbook can emit, with its one-line meaning.

Codes are stable: scripts and CI gates match on them. The codes of the modules
below the top level are declared here, one table for each module that emits
them, which takes its table from here as its ``CODES``; the top-level
``strictjson`` and ``access`` declare theirs next to their rules. So the
catalogue imports nothing above it (its wording reads the bounds from
``contract`` and ``strictjson``), and :data:`CODES` gathers every table for the
man page, the schema and the tests that keep all three in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from nanrunbook import access, strictjson
from nanrunbook.contract import IDENTIFIER_PATTERN, MAX_FREE_TEXT, MAX_TENSOR_NAME, SCALE_RANGE

__all__ = [
    "CAPSULE_CODES",
    "CODES",
    "CONTENT_ID_CODES",
    "DECISION_CODES",
    "FIELD_CODES",
    "INCIDENT_SET_CODES",
    "MERGE_CODES",
    "PARSE_CODES",
    "RECOVERY_CODES",
    "RULE_CODES",
    "SAFETENSORS_CODES",
    "SEAL_CODES",
    "STATE_DIRECTORY_CODES",
    "VERIFY_CODES",
]

# manifest/fields.py: strict fields
FIELD_CODES: dict[str, str] = {
    "FIELD_MISSING": "a required field is absent",
    "FIELD_UNKNOWN": "a field the format does not define (only binding items may carry extra fields)",
    "FIELD_TYPE": "a field has the wrong JSON type (a boolean is not a number, 3.0 is not an integer)",
    "FIELD_OUT_OF_RANGE": "a number is outside the range its field allows",
    "VALUE_NOT_ALLOWED": "a field holds a value outside its fixed set of choices",
    "IDENTIFIER_INVALID": f"an identifier does not match ^{IDENTIFIER_PATTERN}$",
    "TEXT_INVALID": f"free text is not printable or is longer than {MAX_FREE_TEXT:,} characters",
    "TENSOR_NAME_INVALID": (
        f"a tensor name is not printable or not 1 to {MAX_TENSOR_NAME} characters long"
    ),
}

# manifest/parse.py: the manifest's records
PARSE_CODES: dict[str, str] = {
    "FORMAT_UNSUPPORTED": "format is not nanrunbook-bundle/1",
    "CONTRACT_VERSION_UNSUPPORTED": "contract_version is not training-incident-v1",
    "EVIDENCE_CONTENT_ID_INVALID": "evidence_content_id is not training-incident-evidence@sha256:<64 hex>",
    "DIGEST_INVALID": "a tensor sha256 is not 64 lowercase hex digits",
    "DTYPE_UNKNOWN": "a dtype name that safetensors does not define",
    "SHAPE_INVALID": "a shape array holds an item that is not an integer >= 0",
    "LAST_KNOWN_GOOD_INCOMPLETE": "verified_together is not exactly model, optimizer, scheduler, "
    "scaler and data_position, each once",
    "TOPOLOGY_INVALID": "rank is not below world_size",
    "STAGES_NOT_FIVE": "stages is an array of other than five records",
    "STAGE_FIELD_NOT_ALLOWED": "a stage field its status or stage forbids (NOT_RUN with tensors, "
    "gradients outside backward, ...)",
    "ENTRY_FIELD_NOT_ALLOWED": "a summary tensor entry carries file or sha256",
    "TENSORS_EMPTY": "an OBSERVED stage lists no tensors",
    "SCALER_FIELD_NOT_ALLOWED": "a dynamic-scaler field in mode none or static",
}

# manifest/content_id.py: the evidence content id
CONTENT_ID_CODES: dict[str, str] = {
    "EVIDENCE_CONTENT_ID_MISMATCH": "evidence_content_id differs from the recomputed id",
}

# manifest/rules.py: the contract rules
RULE_CODES: dict[str, str] = {
    "LAST_KNOWN_GOOD_NOT_BEFORE_RUN": "last_known_good.step is not below run.step",
    "STAGE_ORDER": "stages are not input, forward, loss, backward, optimizer in that order",
    "TRANSITION_INPUT_NOT_OBSERVED": "the input stage is not OBSERVED",
    "TRANSITION_NOT_RUN_WITHOUT_NONFINITE": "a stage is NOT_RUN but no earlier OBSERVED stage has a "
    "non-finite element",
    "TRANSITION_OBSERVED_AFTER_NOT_RUN": "a stage after a NOT_RUN stage is not NOT_RUN",
    "TELEMETRY_ID_DUPLICATE": "two stages share a telemetry_id",
    "TENSOR_SET_ID_DUPLICATE": "two stages share a tensor_set id",
    "TENSOR_NAME_DUPLICATE": "two tensor entries share a name",
    "COUNTS_NOT_RECONCILED": "finite + nan + posinf + neginf is not elements, or more elements "
    "are declared NaN or infinite than the stage's dtypes can encode",
    "COUNTS_ELEMENTS_MISMATCH": "counts.elements is not the sum of the stage's tensor sizes",
    "SUMMARY_SUB_RESOLUTION": "a summary covers fewer elements than its tensor set (a sample)",
    "FINITE_MAX_ABS_INVALID": "finite_max_abs is negative",
    "FINITE_MAX_ABS_EXCESSIVE": "finite_max_abs is above the largest finite value of the stage's "
    "floating dtypes",
    "FINITE_MAX_ABS_NULL_MISMATCH": "finite_max_abs is null although the stage has a finite floating "
    "element, or the reverse",
    "GRADIENTS_SCALED_WITHOUT_SCALER": "gradients are scaled but the scaler mode is none",
    "SCALER_SCALE_NOT_ONE": "scaler mode none with a scale other than 1",
    "SCALER_SCALE_UNSAFE": f"scale is not {SCALE_RANGE}",
    "SCALER_FACTOR_INVALID": "growth_factor is not > 1 or backoff_factor is not in (0, 1)",
    "SCALER_TRANSITION_INVALID": "found_inf, step_skipped and scale_after do not agree",
    "SCALER_FOUND_INF_MISMATCH": "found_inf disagrees with whether the backward stage has a "
    "non-finite element",
    "CAP_STAGE_TENSORS": "a stage lists more tensors than the cap",
    "CAP_STAGE_ELEMENTS": "a stage holds more elements than the cap",
    "CAP_BUNDLE_ELEMENTS": "the bundle holds more elements than the cap",
}

# tensors/safetensors.py: the tensor file's header
SAFETENSORS_CODES: dict[str, str] = {
    "HEADER_LENGTH_INVALID": (
        "the 8-byte header length is missing, zero, above the bound, or past the end of the file"
    ),
    "HEADER_NOT_UTF8": "a safetensors header is not UTF-8",
    "HEADER_INVALID_JSON": (
        "a safetensors header is not one JSON object from '{' to '}' (space padding allowed),"
        " uses NaN/Infinity, escapes a lone surrogate, or nests too deep"
    ),
    "HEADER_DUPLICATE_NAME": "a safetensors header names the same tensor twice",
    "HEADER_FIELD_UNKNOWN": "a tensor entry has a field other than dtype, shape, data_offsets",
    "HEADER_FIELD_INVALID": (
        "a tensor entry or __metadata__ is missing a field, repeats one, or has the wrong type"
    ),
    "HEADER_DTYPE_UNKNOWN": "a tensor entry has a dtype the safetensors format does not define",
    "HEADER_LENGTH_MISMATCH": "a tensor's byte range length does not match its dtype and shape",
    "HEADER_SUBBYTE_ALIGNMENT": (
        "a sub-byte dtype tensor's element count times bit width is not a multiple of 8"
    ),
    "HEADER_OFFSETS_INVALID": (
        "tensor byte ranges do not tile the data area exactly (gap, overlap or trailing bytes)"
    ),
    "FILE_TRUNCATED": "a tensor file is shorter than its header's byte ranges need (cut short)",
}

# tensors/verify.py: entries bound, recounted, compared
VERIFY_CODES: dict[str, str] = {
    "TENSOR_NOT_IN_FILE": "a manifest entry names a tensor its file does not hold",
    "TENSOR_UNBOUND": "a tensor file holds a tensor no manifest entry binds",
    "TENSOR_DTYPE_MISMATCH": "an entry's dtype differs from its file header",
    "TENSOR_SHAPE_MISMATCH": "an entry's shape differs from its file header",
    "DIGEST_MISMATCH": "a tensor's SHA-256 differs from its entry",
    "COUNTS_RECOUNT_MISMATCH": "declared counts differ from the recount of a complete stage",
    "FINITE_MAX_ABS_RECOUNT_MISMATCH": "declared finite_max_abs differs from the recount",
    "FILE_CHANGED": "a tensor file changed size while it was read",
}

# verdict/decision.py: the decision's own records
DECISION_CODES: dict[str, str] = {
    "RECORD_INCONSISTENT": "an evidence record handed to the decision contradicts itself "
    "(altered after it was checked)",
}

# verdict/incident_set.py: the set rules
INCIDENT_SET_CODES: dict[str, str] = {
    "SET_EMPTY": "an incident set holds no member bundle (a subdirectory with manifest.json)",
    "SET_CONTRACT_MISMATCH": "members declare, or were judged under, different contracts",
    "SET_RUN_MISMATCH": "members declare different run.run_id values",
    "SET_STEP_MISMATCH": "members declare different run.step values",
    "SET_WORLD_SIZE_MISMATCH": "members declare different binding.topology.world_size values",
    "SET_RANK_DUPLICATE": "two members declare the same binding.topology.rank",
    "SET_RANKS_MISSING": "no member declares some rank below world_size, and no member holds",
}

# verdict/merge.py: reports read back
MERGE_CODES: dict[str, str] = {
    "REPORT_UNREADABLE": "a report given to merge cannot be read (missing, not a regular file, "
    "larger than 1 GiB, I/O)",
    "REPORT_INVALID": "a report given to merge is not a nanrunbook check report in JSON "
    "(bad JSON, unknown report_format, a value of the wrong form)",
}

# capture/seal.py: sealing a manifest
SEAL_CODES: dict[str, str] = {
    "SEAL_VALUE_DIFFERS": (
        "seal: an existing sha256 or evidence_content_id differs from the value computed"
        " (replaced only with --force)"
    ),
    "SEAL_TENSOR_UNREADABLE": (
        "seal: a complete-stage tensor cannot be hashed (its file is missing, unsafe or"
        " malformed, or does not hold the tensor)"
    ),
    "SEAL_MANIFEST_CHANGED": "seal: manifest.json changed while it was being sealed",
}

# capture/_state_manifest.py: a state directory and its manifest
STATE_DIRECTORY_CODES: dict[str, str] = {
    "STATE_DIR_NOT_FOUND": "the state directory does not exist, or is not a directory",
    "STATE_MANIFEST_MISSING": (
        "the state directory has no manifest.json: it is incomplete (its writer never finished)"
    ),
    "STATE_MANIFEST_INVALID": "manifest.json cannot be read, is not strict JSON, or lacks a field",
    "STATE_FORMAT_UNKNOWN": "manifest.json names another kind of state directory, or a version",
    "STATE_PATH_UNSAFE": "a listed path is empty, absolute, or has a '..', '.' or empty component",
    "STATE_FILE_MISSING": "a file the manifest lists does not exist",
    "STATE_FILE_SYMLINK": "a listed file, or a directory on its path, is a symlink",
    "STATE_FILE_NOT_REGULAR": "a listed file is a directory, FIFO, device or socket",
    "STATE_FILE_UNREADABLE": "a listed file cannot be opened or read",
    "STATE_FILE_SIZE_MISMATCH": "a file's size differs from the manifest's",
    "STATE_FILE_DIGEST_MISMATCH": "a file's SHA-256 differs from the manifest's",
    "STATE_FILE_UNLISTED": "a file, symlink or directory is present that the manifest does not list",
    "STATE_METADATA_MISSING": "the manifest lists no DCP metadata (state/.metadata)",
    "STATE_METADATA_REFUSED": (
        "DCP's metadata pickle names a class outside DCP's own metadata records: never run"
    ),
    "STATE_RANKS_INVALID": (
        "a directory every rank wrote does not list each rank's files once, under its rank"
    ),
    "STATE_DOCUMENT_INVALID": "a JSON document of the directory is not strict JSON",
    "STATE_DATA_REFUSED": (
        "DCP's files hold an object weights-only loading refuses, or not what the metadata"
        " says: never run"
    ),
    "STATE_READ_INTERRUPTED": (
        "reading the verified tensors failed after the first was written: the state is partly"
        " the directory's; do not go on from it"
    ),
    "STATE_KEYS_DIFFER": "the state to load into and the saved state have different keys",
    "STATE_SHAPE_MISMATCH": "a saved tensor's shape differs from the one it would load into",
    "STATE_DTYPE_MISMATCH": "a saved tensor's dtype differs from the one it would load into",
}

# capture/recovery.py: a recovery point
RECOVERY_CODES: dict[str, str] = {
    "RECOVERY_HEADER_INVALID": (
        "the manifest's header lacks the step, run id, point id, torch version, world size"
        " or parts, or one is of the wrong form"
    ),
    "RECOVERY_PART_MISSING": (
        "one of model, optimizer, scheduler, scaler, data_position and rng is not in the"
        " point, or is not where the header says"
    ),
    "RECOVERY_STEP_MISMATCH": "a part was saved at another step than the point's",
    "RECOVERY_RNG_MISSING": "the random states lack torch's CPU, numpy's or Python's stream",
    "RECOVERY_WORLD_SIZE_MISMATCH": (
        "a point every rank wrote is loaded on another number of ranks (its per-rank"
        " random states and data positions have no rank to go to)"
    ),
}

# capture/torch/capsule/: a capsule, beyond its state directory
CAPSULE_CODES: dict[str, str] = {
    "CAPSULE_DOCUMENT_INVALID": (
        "a capsule document lacks a field or holds a value of the wrong kind"
    ),
    "CAPSULE_BUNDLE_DIFFERS": (
        "the bundle beside the capsule is not the one the capsule was written with"
        " (its evidence content id differs)"
    ),
    "CAPSULE_SHARDED": (
        "the capsule was written by every rank of an FSDP2 job: Capsule.open takes one"
        " process's; replay it under torchrun with its world size (replay_sharded)"
    ),
    "CAPSULE_OBJECTS_DIFFER": (
        "the objects the entry built differ from the capsule's (optimizer class, param"
        " groups, scheduler, scaler, generators): its state cannot be loaded into them"
    ),
}


def _gather(*tables: Mapping[str, str]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for table in tables:
        for code, meaning in table.items():
            if code in merged:
                raise RuntimeError(f"violation code {code} is declared twice")
            merged[code] = meaning
    return dict(sorted(merged.items()))


CODES = MappingProxyType(
    _gather(
        strictjson.CODES,
        FIELD_CODES,
        PARSE_CODES,
        CONTENT_ID_CODES,
        RULE_CODES,
        access.CODES,
        SAFETENSORS_CODES,
        VERIFY_CODES,
        DECISION_CODES,
        INCIDENT_SET_CODES,
        MERGE_CODES,
        SEAL_CODES,
        STATE_DIRECTORY_CODES,
        RECOVERY_CODES,
        CAPSULE_CODES,
    )
)

"""``merge``: an incident set's verdict from ``check --format json`` reports made elsewhere.

A set too big or too spread to check in one place is checked where its bundles
are: each node runs ``nanrunbook check --format json`` on the rank bundles on
its own disk (one bundle, several, or its part of the set directory), and the
reports are merged into the verdict that checking the whole set in one place
gives (spec section 11): the same members, the same rules, the same answer.

Every report is read as untrusted input: a value is used only if it has the form
the report format gives it (identifiers, stage names, integers in range), a
decision only if the report's own stage counts give it, and text is shown quoted
unless printable. A report that cannot be read, or is not a
nanrunbook report, counts as a rejected member that declares no rank: a HOLD
elsewhere still stands, and the set cannot continue without it.

The reports are streamed: one file is read, judged into its members' verdicts
and let go before the next is read. Without ``keep_reports`` a member keeps its
verdict and what it declares, not its report (only a JSON answer prints the
members' whole reports), so the peak memory does not grow with the reports' size.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import orjson

from nanrunbook.access import file_where
from nanrunbook.codes import MERGE_CODES as CODES
from nanrunbook.contract import CONTINUE, CONTRACT_ID_PREFIX, HOLD, STAGE_ORDER, contract_content_id
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.manifest.declared import NOTHING_DECLARED, Declared
from nanrunbook.manifest.fields import IDENTIFIER
from nanrunbook.strictjson import MAX_SAFE_INTEGER
from nanrunbook.verdict.incident_set import (
    REJECTED,
    SET_REPORT_FORMAT,
    IncidentSet,
    SetMember,
    judge_set,
    reference_value,
)
from nanrunbook.verdict.report import REPORT_FORMAT, rejection_document

__all__ = ["CODES", "MAX_REPORT_BYTES", "members_of_document", "merge_reports"]

MAX_REPORT_BYTES = 1 << 30  # a set's report holds every member's; this is far above one


_CONTENT_ID = re.compile(re.escape(CONTRACT_ID_PREFIX) + "[0-9a-f]{64}")
_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


def merge_reports(
    paths: Iterable[str | os.PathLike[str]],
    *,
    keep_reports: bool = True,
    folded: Callable[[SetMember], None] | None = None,
) -> IncidentSet:
    """The set verdict from report files written by ``check --format json``: each
    holds a bundle's report or rejection, a set's report, or a list of them (``check``
    of several paths). Never raises for what the files hold. ``keep_reports``
    false: each member's ``document`` keeps only its ``bundle`` (what a text or kv
    answer shows of it), and a report is let go once its members are judged.
    ``folded`` is called with each member, its whole report in hand, in the order
    the files hold them, before it is let go (a json answer spools them so)."""
    sources: list[str] = []
    members: list[SetMember] = []
    for path in paths:
        sources.append(str(path))
        found = _members_of_file(Path(path))
        if folded is not None:
            for member in found:
                folded(member)
        members.extend(found if keep_reports else (m.verdict_only() for m in found))
        del found  # the parsed report goes before the next file is read
    content_id = reference_value(members, lambda m: m.contract_content_id)
    return judge_set(
        members,
        contract_content_id=content_id or contract_content_id(),
        merged_from=sources,
    )


def _members_of_file(path: Path) -> list[SetMember]:
    name = file_where(path.name or str(path))
    try:
        raw = _read(path)
    except IsADirectoryError:
        reason = (
            f"report {quote(str(path))} is a directory: merge reads the JSON reports"
            " 'nanrunbook check --format json' writes; judge a bundle or an incident set"
            f" directory with nanrunbook check {quote(str(path))}"
        )
        return [_invalid(name, "$", reason, "REPORT_UNREADABLE")]
    except OSError as err:
        reason = err.strerror or type(err).__name__
        return [_invalid(name, "$", f"report {quote(str(path))}: {reason}", "REPORT_UNREADABLE")]
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        return [_invalid(name, "$", f"report {quote(str(path))} is not JSON: {err}")]
    return members_of_document(document, name)


def _read(path: Path) -> bytes:
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(0, "not a regular file")
        # Sized by the file, not the bound: read(bound) allocates the bound at once
        # (a GiB per report, though the pages stay untouched), and it grows if the
        # file does while it is read.
        limit = MAX_REPORT_BYTES + 1
        chunks, size, want = [], 0, min(info.st_size + 1, limit)
        while size < limit:
            chunk = handle.read(min(want, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            want = 1 << 20
        data = b"".join(chunks)
    if len(data) > MAX_REPORT_BYTES:
        raise OSError(0, "larger than 1 GiB")
    return data


def members_of_document(document: Any, source: str, path: str = "$") -> list[SetMember]:
    """The members a parsed report document holds; ``source`` names a member whose
    own name cannot be read (the report file)."""
    if isinstance(document, list):
        return [
            member
            for index, item in enumerate(document)
            for member in members_of_document(item, source, f"{path}[{index}]")
        ]
    if not isinstance(document, dict):
        return [_invalid(source, path, "expected a report object")]
    form = document.get("report_format")
    if form == SET_REPORT_FORMAT:
        entries = document.get("members")
        if not isinstance(entries, list):
            return [_invalid(source, f"{path}.members", "a set report lists its members")]
        return [_entry(entry, source, f"{path}.members[{i}]") for i, entry in enumerate(entries)]
    if form == REPORT_FORMAT:
        return [_member(document, _bundle_name(document) or source, path)]
    shown = quote(form) if isinstance(form, str) else "none"
    return [_invalid(source, path, f"report_format {shown} is not one merge reads")]


def _entry(entry: Any, source: str, path: str) -> SetMember:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return _invalid(source, path, "a member entry has a name and a report")
    name = entry["name"]
    return _member(
        entry.get("report"), name if name.isprintable() else quote(name), f"{path}.report"
    )


def _bundle_name(document: Mapping[str, Any]) -> str | None:
    bundle = document.get("bundle")
    if not isinstance(bundle, str):
        return None
    name = PurePosixPath(bundle).name or bundle
    return file_where(name) if name.isprintable() else quote(name)


class _Invalid(Exception):
    """A report value without the form the report format gives it."""


def _member(document: Any, name: str, path: str) -> SetMember:
    try:
        if not isinstance(document, dict) or document.get("report_format") != REPORT_FORMAT:
            raise _Invalid("expected a bundle's report")
        decision = document.get("decision")
        if decision in (HOLD, CONTINUE):
            return _accepted(document, name, decision)
        if decision == REJECTED:
            return _rejected(document, name)
        raise _Invalid("decision is not HOLD, CONTINUE_BOUNDED_DIAGNOSTICS or REJECTED")
    except _Invalid as problem:
        return _invalid(name, path, str(problem))


def _accepted(document: Mapping[str, Any], name: str, decision: str) -> SetMember:
    run = _object(document, "run")
    topology = _object(_object(document, "binding"), "topology")
    declared = Declared(
        contract_version=_identifier(document, "contract_version"),
        run_id=_identifier(run, "run_id"),
        step=_integer(run, "step", 0, MAX_SAFE_INTEGER),
        world_size=_integer(topology, "world_size", 1, MAX_SAFE_INTEGER),
        rank=_integer(topology, "rank", 0, MAX_SAFE_INTEGER),
    )
    assert declared.rank is not None and declared.world_size is not None
    if declared.rank >= declared.world_size:
        raise _Invalid("binding.topology.rank is not below world_size")
    stage = document.get("earliest_nonfinite_stage")
    if (decision == HOLD) != (stage in STAGE_ORDER) or (decision == CONTINUE and stage is not None):
        raise _Invalid("earliest_nonfinite_stage does not agree with the decision")
    if _earliest_nonfinite(document) != stage:
        # The decision is the stage counts' (spec section 8): a report that says
        # otherwise was edited, and its word is not taken.
        raise _Invalid("the decision does not agree with the report's stage counts")
    tensor = document.get("first_nonfinite_tensor")
    if tensor is not None and not isinstance(tensor, str):
        raise _Invalid("first_nonfinite_tensor is not a string")
    if isinstance(tensor, str) and not tensor.isprintable():
        tensor = quote(tensor)
    content_id = _content_id(document)
    warnings = _warning_codes(document.get("warnings", []))
    return SetMember(
        name, declared, decision, stage, tensor, content_id, (), document, warnings=warnings
    )


def _earliest_nonfinite(document: Mapping[str, Any]) -> str | None:
    """The first stage whose counts hold a non-finite element, by the report's own
    ``stages``: the five, in order, each with counts (null when NOT_RUN)."""
    stages = document.get("stages")
    if not isinstance(stages, list) or [
        item.get("stage") if isinstance(item, dict) else None for item in stages
    ] != list(STAGE_ORDER):
        raise _Invalid("stages is not the five stages in order")
    for item in stages:
        counts = item.get("counts")
        if counts is None:
            continue
        if not isinstance(counts, dict):
            raise _Invalid(f"the {item['stage']} stage's counts is not an object")
        nonfinite = [
            _integer(counts, key, 0, MAX_SAFE_INTEGER) for key in ("nan", "posinf", "neginf")
        ]
        if any(nonfinite):
            return str(item["stage"])
    return None


def _warning_codes(value: Any) -> tuple[str, ...]:
    """The codes of a report's early warnings (none in a report from before them)."""
    if not isinstance(value, list):
        raise _Invalid("warnings is not a list")
    codes = [item.get("code") if isinstance(item, dict) else None for item in value]
    if not all(isinstance(code, str) and _CODE.fullmatch(code) for code in codes):
        raise _Invalid("a warning code is not an upper-case code")
    return tuple(str(code) for code in codes)


def _rejected(document: Mapping[str, Any], name: str) -> SetMember:
    violations = document.get("violations")
    if not isinstance(violations, list) or not violations:
        raise _Invalid("a rejection lists its violations")
    found = tuple(_violation(item) for item in violations)
    declared = _declared(document.get("declared"))
    content_id = _content_id(document)
    return SetMember(name, declared, REJECTED, None, None, content_id, found, document)


def _violation(item: Any) -> Violation:
    if not isinstance(item, dict):
        raise _Invalid("a violation is an object")
    code, where, message = item.get("code"), item.get("where"), item.get("message")
    if not isinstance(code, str) or not _CODE.fullmatch(code):
        raise _Invalid("a violation code is not an upper-case code")
    if not isinstance(where, str) or not isinstance(message, str):
        raise _Invalid("a violation's where and message are strings")
    return Violation(code, _printable(where), _printable(message))


def _declared(value: Any) -> Declared:
    """What a rejected member declares, read as ``declared_values`` reads a manifest:
    a value of the wrong form is not declared; a report without the key declares nothing."""
    if not isinstance(value, dict):
        return NOTHING_DECLARED
    world_size = _optional(lambda: _integer(value, "world_size", 1, MAX_SAFE_INTEGER))
    rank = _optional(lambda: _integer(value, "rank", 0, MAX_SAFE_INTEGER))
    if rank is not None and (world_size is None or rank >= world_size):
        rank = None
    return Declared(
        contract_version=_optional(lambda: _identifier(value, "contract_version")),
        run_id=_optional(lambda: _identifier(value, "run_id")),
        step=_optional(lambda: _integer(value, "step", 0, MAX_SAFE_INTEGER)),
        world_size=world_size,
        rank=rank,
    )


def _optional(read: Any) -> Any:
    try:
        return read()
    except _Invalid:
        return None


def _object(value: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    found = value.get(key)
    if not isinstance(found, dict):
        raise _Invalid(f"{key} is not an object")
    return found


def _identifier(value: Mapping[str, Any], key: str) -> str:
    found = value.get(key)
    if not isinstance(found, str) or not IDENTIFIER.fullmatch(found):
        raise _Invalid(f"{key} is not an identifier")
    return found


def _integer(value: Mapping[str, Any], key: str, low: int, high: int) -> int:
    found = value.get(key)
    if not isinstance(found, int) or isinstance(found, bool) or not low <= found <= high:
        raise _Invalid(f"{key} is not an integer from {low} to {high}")
    return found


def _content_id(document: Mapping[str, Any]) -> str:
    found = document.get("contract_content_id")
    if not isinstance(found, str) or not _CONTENT_ID.fullmatch(found):
        raise _Invalid("contract_content_id is not a contract content id")
    return found


def _printable(text: str) -> str:
    return text if text.isprintable() else quote(text)


def _invalid(name: str, where: str, message: str, code: str = "REPORT_INVALID") -> SetMember:
    """A report that cannot be read as one: a rejected member that declares no rank."""
    error = EvidenceRejected([Violation(code, where, message)])
    document = rejection_document(error, name, contract_content_id())
    return SetMember(name, NOTHING_DECLARED, REJECTED, None, None, None, error.violations, document)

"""Facts of the shared vocabulary with one home (issue 26): the non-finite
count of counts by class, the warning record, the names of an origin."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanrunbook"
CLASSES = {"nan", "posinf", "neginf"}


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _summed(node: ast.BinOp) -> set[str]:
    """The attribute names of an addition chain's operands (``a.nan + a.posinf``)."""
    names: set[str] = set()
    for side in (node.left, node.right):
        if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Add):
            names |= _summed(side)
        elif isinstance(side, ast.Attribute):
            names.add(side.attr.lstrip("_"))
    return names


def test_nan_posinf_and_neginf_are_summed_in_one_place() -> None:
    """records.nonfinite_count is the one sum; every counts record's
    ``nonfinite`` (manifest counts, a tally, a telemetry line's gradient and
    update, a shrink's tensor, the sentinel's findings) goes through it."""
    sums = [
        f"{name}:{node.lineno}"
        for name, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
        if _summed(node) >= CLASSES
    ]
    assert [where.split(":")[0] for where in sums] == ["nanrunbook/records.py"], sums


def test_every_counts_record_counts_nonfinite_the_same() -> None:
    from nanrunbook.records import Counts, nonfinite_count
    from nanrunbook.telemetry.record import GradientStats, UpdateStats
    from nanrunbook.tensors.counting import Tally, tally_bytes

    records = [
        Counts(9, 3, 1, 2, 3),
        Tally(9, 3, 1, 2, 3, None),
        GradientStats(nan=1, posinf=2, neginf=3),
        UpdateStats(nan=1, posinf=2, neginf=3),
    ]
    assert [r.nonfinite for r in records] == [6] * 4
    assert [nonfinite_count(r) for r in records] == [6] * 4
    counted = tally_bytes("F32", b"\x00\x00\xc0\x7f" + b"\x00\x00\x80\x7f" + b"\x00\x00\x80?")
    assert (counted.nonfinite, counted.finite, counted.elements) == (2, 1, 3)


def test_one_warning_record_for_the_check_and_the_telemetry_line() -> None:
    """A check's warning about a bundle tensor and a telemetry line's warning are
    one frozen record; a line's names no tensor (its step says where)."""
    import dataclasses

    import orjson

    from nanrunbook.records import EarlyWarning
    from nanrunbook.telemetry import TelemetryRecord, TelemetryWarning
    from nanrunbook.telemetry.record import GradientStats, parse_record, record_line

    assert TelemetryWarning is EarlyWarning
    line = TelemetryWarning("GRAD_NORM_SPIKE", "norm 9x the median")
    assert (line.stage, line.tensor, line.index) == (None, None, None)
    assert dataclasses.is_dataclass(line)
    try:
        line.code = "X"  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("the warning record is not frozen")
    record = TelemetryRecord(
        run_id="r", rank=0, world_size=1, step=3, time=1.0, loss=0.5, loss_class="finite",
        grad=GradientStats(), update=None, scale=None, found_inf=None, skipped=False,
        held=False, warnings=(line,), bundle=None,
    )  # fmt: skip
    written = record_line(record)
    assert orjson.loads(written)["warnings"] == [
        {"code": "GRAD_NORM_SPIKE", "message": "norm 9x the median"}
    ]
    assert parse_record(orjson.loads(written)).warnings == (line,)


def test_the_origin_names_are_written_once() -> None:
    """ONE_RANK, SOME_RANKS, ALL_RANKS and NONE are records.py's; an incident
    set and watch's summary use its names."""
    from nanrunbook.records import ORIGINS, origin_of
    from nanrunbook.telemetry.summary import NonFiniteStep
    from nanrunbook.verdict import incident_set

    spelled = [
        f"{name}:{node.lineno}"
        for name, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in {"ONE_RANK", "SOME_RANKS", "ALL_RANKS"}
        if name != "nanrunbook/records.py"
    ]
    assert spelled == [], spelled
    assert incident_set.ORIGINS is ORIGINS
    assert ORIGINS == ("ONE_RANK", "SOME_RANKS", "ALL_RANKS", "NONE")
    assert [origin_of(r, 4) for r in ((), (1,), (0, 2), (0, 1, 2, 3))] == [
        "NONE",
        "ONE_RANK",
        "SOME_RANKS",
        "ALL_RANKS",
    ]
    assert NonFiniteStep(1, 0, "loss:nan").origin == "ONE_RANK"

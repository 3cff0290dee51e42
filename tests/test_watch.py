"""nanrunbook watch on telemetry from real CPU training runs (tests/telemetry_runs.py):
what the summariser derives, the exit codes, the plots, and bad input."""

from __future__ import annotations

import json
import os
import random
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import telemetry_runs
from typer.testing import CliRunner

from nanrunbook.cli import app
from nanrunbook.exits import Exit
from nanrunbook.telemetry import (
    GradientStats,
    JsonlSink,
    TelemetryRecord,
    TelemetryUnreadable,
    TelemetryWarning,
    parse_record,
    read_telemetry,
    record_line,
    summarise_file,
)
from nanrunbook.telemetry.reader import MAX_LINE_BYTES, BadLine, IncompleteLine
from nanrunbook.telemetry.summary import BAD_LINES_KEPT, Summariser, WatchSummary

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return telemetry_runs.write_all(tmp_path_factory.mktemp("runs"))


def watch(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["watch", *args], prog_name="nanrunbook", env={"COLUMNS": "80"})
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout


def kv(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, value = line.split("=", 1)
        found.setdefault(key, []).append(value)
    return found


# ------------------------------------------------------------ the three real runs


def test_blowup_warns_before_its_first_nonfinite_step(runs: dict[str, Path]) -> None:
    summary = summarise_file(runs["blowup"])
    assert summary.status == "ALARM"
    first = summary.first_nonfinite
    assert first is not None and first.part == "loss:posinf"
    assert summary.holds.steps == (first.step,) == (summary.last_step,)
    # Derived: the lines carry no warning before the overflow. The loss's rise
    # warns first (from its second step), the headroom trend after.
    falling = next(w for w in summary.warnings if w.code == "HEADROOM_FALLING")
    assert falling.source == "watch"
    assert falling.first_step < first.step - 5
    diverging = next(w for w in summary.warnings if w.code == "LOSS_DIVERGENCE")
    assert diverging.source == "watch" and "running minimum" in diverging.message
    assert summary.first_warning_step == diverging.first_step < falling.first_step
    # The gradient max abs really rose: its last bucket is orders above its first.
    maxima = [b.grad_max_abs for b in summary.series if b.grad_max_abs is not None]
    assert maxima[-1] > 1e12 * maxima[0]
    trend = summary.headroom
    assert trend is not None and trend.direction == "falling" and trend.dtype == "F32"
    assert summary.exit_code() is Exit.HOLD


def test_scaler_run_shows_its_backoff_streak_and_is_not_an_incident(runs: dict[str, Path]) -> None:
    summary = summarise_file(runs["scaler"])
    scale = summary.scale
    assert scale is not None and scale.first == 2.0**24
    streak = scale.longest_backoff_streak
    assert streak is not None and streak.length >= 3
    assert streak.first_step == 1  # the scale lowered after the first overflow at step 0
    # Every overflow was absorbed by the scaler: skipped, backed off, no incident.
    assert summary.scaler_overflows.count == summary.skips.count >= streak.length
    assert scale.backoffs.count == summary.skips.count
    assert [s + 1 for s in summary.skips.steps] == list(scale.backoffs.steps)
    assert summary.nonfinite.count == 0 and summary.first_nonfinite is None
    assert summary.holds.count == 0
    assert summary.status == "OK"
    code, out = watch(str(runs["scaler"]), "-f", "kv", "--fail-on-warnings")
    assert code == 0
    values = kv(out)
    assert values["longest_backoff_streak"] == [f"{streak.length} {streak.first_step}"]
    assert values["backoffs"] == [str(scale.backoffs.count)]


def test_healthy_run_says_nothing(runs: dict[str, Path]) -> None:
    summary = summarise_file(runs["healthy"])
    assert summary.warnings == ()
    assert summary.first_nonfinite is None and summary.holds.count == 0
    assert summary.skips.count == 0 and summary.bad_lines == 0
    assert summary.status == "OK"
    assert summary.records == 80 and (summary.first_step, summary.last_step) == (0, 79)
    assert watch(str(runs["healthy"]), "--fail-on-warnings")[0] == 0


@pytest.mark.parametrize("fmt", ["text", "json", "kv"])
def test_exit_codes_by_format(runs: dict[str, Path], fmt: str) -> None:
    assert watch(str(runs["blowup"]), "-f", fmt)[0] == Exit.HOLD
    assert watch(str(runs["blowup"]), "-f", fmt, "--fail-on-warnings")[0] == Exit.HOLD
    assert watch(str(runs["healthy"]), "-f", fmt)[0] == Exit.CONTINUE


def test_warnings_only_exit_5_with_fail_on_warnings(runs: dict[str, Path], tmp_path: Path) -> None:
    """A code this version does not know is still a warning, shown by its code."""
    records = [r for r in read_telemetry(runs["healthy"])]
    path = tmp_path / "warned.jsonl"
    with JsonlSink(path) as sink:
        for record in records:
            assert not isinstance(record, (BadLine, IncompleteLine))
            if record.step == 40:
                note = TelemetryWarning("GRAD_NORM_SPIKE_FROM_THE_FUTURE", "norm 9x the median")
                record = replace(record, warnings=(note,))
            sink.emit(record)
    assert watch(str(path))[0] == Exit.CONTINUE
    code, out = watch(str(path), "--fail-on-warnings", "-f", "kv")
    assert code == Exit.WARNINGS
    assert kv(out)["warning"] == ["GRAD_NORM_SPIKE_FROM_THE_FUTURE 40 1 telemetry"]
    assert kv(out)["status"] == ["WARNINGS"]
    code, out = watch(str(path), "--no-plots")
    out = " ".join(out.split())  # lines wrap at 80 columns
    assert "GRAD_NORM_SPIKE_FROM_THE_FUTURE" in out and "norm 9x the median" in out


def test_kv_and_json_agree_with_the_summary(runs: dict[str, Path]) -> None:
    summary = summarise_file(runs["blowup"])
    _, out = watch(str(runs["blowup"]), "-f", "kv")
    values = kv(out)
    assert summary.first_nonfinite is not None
    assert values["first_nonfinite_step"] == [str(summary.first_nonfinite.step)]
    assert values["first_warning_step"] == [str(summary.first_warning_step)]
    assert int(values["first_warning_step"][0]) < int(values["first_nonfinite_step"][0])
    assert values["status"] == ["ALARM"]
    _, out = watch(str(runs["blowup"]), "-f", "json")
    document = json.loads(out)
    assert document["watch_format"] == "nanrunbook-watch/1"
    assert document["first_nonfinite"]["step"] == summary.first_nonfinite.step
    assert document["first_warning_step"] == summary.first_warning_step
    assert document["holds"]["steps"] == list(summary.holds.steps)
    assert len(document["series"]) == len(summary.series)


def test_since_sets_earlier_records_aside(runs: dict[str, Path]) -> None:
    summary = summarise_file(runs["scaler"], since=10)
    assert summary.first_step == 10 and summary.records == 70 and summary.before_since == 10
    assert min(summary.skips.steps) >= 10
    code, out = watch(str(runs["scaler"]), "--since", "10", "-f", "kv")
    assert code == 0 and kv(out)["first_step"] == ["10"]


# ------------------------------------------------------------------- plots


@pytest.mark.parametrize("run", telemetry_runs.RUNS)
def test_terminal_plots_fit_80_columns(runs: dict[str, Path], run: str) -> None:
    _, out = watch(str(runs[run]))
    lines = out.splitlines()
    plot_start = next(i for i, line in enumerate(lines) if line.startswith("loss"))
    assert all(len(line) <= 80 for line in lines[plot_start:]), max(lines, key=len)
    titles = [line for line in lines if line.startswith(("loss", "gradient", "skipped"))]
    assert any("headroom" in t for t in titles) and any("max abs" in t for t in titles)
    assert sum("⠀" in line or "⣀" in line for line in lines) >= 24  # braille canvases
    if run == "scaler":
        assert any(line.startswith("loss scale, log2") for line in lines)


def test_no_plots_leaves_them_out(runs: dict[str, Path]) -> None:
    _, out = watch(str(runs["blowup"]), "--no-plots")
    assert "⠀" not in out and "HEADROOM_FALLING" in out


def test_plot_file_is_svg_with_a_line_per_series(runs: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "plots.svg"
    code, _ = watch(str(runs["scaler"]), "--plot-file", str(target), "-f", "kv")
    assert code == 0
    root = ET.parse(target).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    polylines = root.findall(".//{http://www.w3.org/2000/svg}polyline")
    assert len(polylines) >= 5  # loss min and max, max abs, headroom, scale
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any(t.startswith("loss scale") for t in texts)
    assert sum(t == "s" for t in texts) == summarise_file(runs["scaler"]).skips.count


def test_plot_file_escapes_the_file_name(runs: dict[str, Path], tmp_path: Path) -> None:
    hostile = tmp_path / "<b>&'run\".jsonl"
    hostile.write_bytes(runs["blowup"].read_bytes())
    target = tmp_path / "out.svg"
    assert watch(str(hostile), "--plot-file", str(target), "-f", "kv")[0] == 1
    heading = ET.parse(target).getroot().find(".//{http://www.w3.org/2000/svg}text")
    assert heading is not None and "<b>&'run\".jsonl" in (heading.text or "")


def test_plot_file_must_be_svg_in_a_directory(runs: dict[str, Path], tmp_path: Path) -> None:
    assert watch(str(runs["blowup"]), "--plot-file", str(tmp_path / "p.png"))[0] == Exit.USAGE
    missing = tmp_path / "no" / "p.svg"
    assert watch(str(runs["blowup"]), "--plot-file", str(missing))[0] == Exit.USAGE


# ---------------------------------------------------------------- bad input


def _garbage_laden(clean: Path, target: Path) -> list[int]:
    """The clean file's lines with garbage between them; the garbage's line numbers."""
    junk = [
        b"\x00\xff\xfe binary junk",
        b'{"format": "someone-elses/3", "step": 1}',
        b'{"format": "nanrunbook-telemetry/1", "step": "seven"}',
        b"[1, 2, 3]",
        b'{"format": "nanrunbook-telemetry/1", "run_id": "x", "rank": 0, "world_',
        b"NaN",
        b"x" * (MAX_LINE_BYTES + 10),
    ]
    rng = random.Random(7)
    lines = clean.read_bytes().splitlines()
    out: list[bytes] = []
    bad: list[int] = []
    for line in lines:
        if rng.random() < 0.3:
            out.append(junk[len(bad) % len(junk)])
            bad.append(len(out))
        if rng.random() < 0.1:
            out.append(b"   ")  # blank: skipped silently
        out.append(line + (b"\r" if rng.random() < 0.1 else b""))
    target.write_bytes(b"\n".join(out) + b"\n")
    return bad


def test_garbage_lines_are_counted_and_located(runs: dict[str, Path], tmp_path: Path) -> None:
    dirty = tmp_path / "dirty.jsonl"
    bad = _garbage_laden(runs["blowup"], dirty)
    clean, summary = summarise_file(runs["blowup"]), summarise_file(dirty)
    assert summary.bad_lines == len(bad) >= 5
    assert [b.line for b in summary.bad_examples] == bad[:BAD_LINES_KEPT]
    kinds = {b.kind for b in summary.bad_examples}
    assert {"NOT_JSON", "FOREIGN_FORMAT", "INVALID_FIELD"} <= kinds
    # The records around the garbage say what they said without it.
    assert summary.records == clean.records
    assert summary.first_nonfinite == clean.first_nonfinite
    assert summary.first_warning_step == clean.first_warning_step
    code, out = watch(str(dirty), "--no-plots")
    assert code == Exit.HOLD
    for line in bad[:BAD_LINES_KEPT]:
        assert f"line {line} " in out


def test_garbage_in_a_healthy_run_is_a_warning(runs: dict[str, Path], tmp_path: Path) -> None:
    dirty = tmp_path / "dirty.jsonl"
    _garbage_laden(runs["healthy"], dirty)
    assert watch(str(dirty))[0] == Exit.CONTINUE
    assert watch(str(dirty), "--fail-on-warnings")[0] == Exit.WARNINGS


def test_a_file_cut_mid_line_reports_an_incomplete_line(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    data = runs["blowup"].read_bytes()
    cut = tmp_path / "cut.jsonl"
    lines = data.count(b"\n")
    cut.write_bytes(
        data[: data.rindex(b"\n", 0, len(data) - 1) + 40]
    )  # 40 bytes into the last line
    summary = summarise_file(cut)
    assert summary.incomplete == IncompleteLine(lines, 39)
    assert summary.records == lines - 1 and summary.bad_lines == 0
    assert (
        summary.status == "WARNINGS"
    )  # the held step is not yet readable: headroom warning stands
    code, out = watch(str(cut), "-f", "kv")
    assert kv(out)["incomplete_line"] == [str(lines)] and code == Exit.CONTINUE


def test_a_last_line_without_newline_still_counts(runs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "no-newline.jsonl"
    path.write_bytes(runs["blowup"].read_bytes().rstrip(b"\n"))
    summary = summarise_file(path)
    assert summary.incomplete is None and summary.holds.count == 1


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: os.mkfifo(p), "not a regular file"),
    ],
    ids=["missing", "directory", "fifo"],
)
def test_unreadable_paths_exit_3(tmp_path: Path, make: object, reason: str) -> None:
    path = tmp_path / "telemetry.jsonl"
    make(path)  # type: ignore[operator]
    with pytest.raises(TelemetryUnreadable, match=reason):
        summarise_file(path)
    result = runner.invoke(app, ["watch", str(path)], prog_name="nanrunbook")
    assert result.exit_code == Exit.REJECTED
    assert reason in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "content", [b"", b"\n\n  \n", b"garbage\n{}\n[]\n"], ids=["empty", "blank", "garbage"]
)
def test_nothing_parseable_exits_3(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(content)
    result = runner.invoke(app, ["watch", str(path), "-f", "kv"], prog_name="nanrunbook")
    assert result.exit_code == Exit.REJECTED
    assert "status=EMPTY" in result.stdout
    assert "no telemetry record" in result.stderr


def test_usage_errors_exit_2(runs: dict[str, Path]) -> None:
    blowup = str(runs["blowup"])
    for args in (
        [""],
        [blowup, "--since", "-3"],
        [blowup, "--window", "2"],
        [blowup, "--until-step", "5"],
        [blowup, "--stop-after-idle", "1"],
        [blowup, "--follow", "--stop-after-idle", "soon"],
        [blowup, "--format", "yaml"],
    ):
        assert watch(*args)[0] == Exit.USAGE, args


# ---------------------------------------------------- the record and the reader


def test_every_line_of_a_real_run_round_trips(runs: dict[str, Path]) -> None:
    for raw in runs["scaler"].read_bytes().splitlines():
        record = parse_record(orjson.loads(raw))
        assert record_line(record) == raw + b"\n"


def test_unknown_fields_at_the_end_are_ignored(runs: dict[str, Path]) -> None:
    raw = runs["healthy"].read_bytes().splitlines()[0]
    document = orjson.loads(raw)
    later = {**document, "from_a_later_writer": {"max_abs": 3.0}}
    assert parse_record(later) == parse_record(document)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"step": -1}, "step"),
        ({"step": True}, "step"),
        ({"rank": 4, "world_size": 2}, "rank"),
        ({"loss": None}, "loss"),  # null with loss_class finite
        ({"loss_class": "huge"}, "loss_class"),
        ({"grad": {"nan": 0}}, "grad.posinf"),
        ({"skipped": "no"}, "skipped"),
        ({"warnings": [{"code": "lower case", "message": ""}]}, "warnings"),
        ({"update": {"nan": 0, "posinf": 0, "neginf": 0, "max_abs": "big"}}, "update.max_abs"),
    ],
)
def test_invalid_fields_are_named(
    runs: dict[str, Path], change: dict[str, object], where: str
) -> None:
    document = orjson.loads(runs["healthy"].read_bytes().splitlines()[0])
    line = orjson.dumps({**document, **change})
    items = list(_parse_bytes(line))
    assert len(items) == 1 and isinstance(items[0], BadLine)
    assert items[0].kind == "INVALID_FIELD" and items[0].reason.startswith(where + ":")


def _parse_bytes(data: bytes) -> list[object]:
    from nanrunbook.telemetry.reader import parse_line

    return [parse_line(1, data)]


def test_a_nan_is_refused_before_anything_is_written(runs: dict[str, Path], tmp_path: Path) -> None:
    from nanrunbook.telemetry import TelemetryLineError

    record = next(r for r in read_telemetry(runs["healthy"]))
    assert not isinstance(record, (BadLine, IncompleteLine))
    path = tmp_path / "t.jsonl"
    with JsonlSink(path) as sink, pytest.raises(TelemetryLineError, match="loss is nan"):
        sink.emit(replace(record, loss=float("nan")))
    assert path.read_bytes() == b""


# ------------------------------------------------------------ bounded memory


def _summarise_many(records: int, codes: int = 0) -> WatchSummary:
    summariser = Summariser("synthetic")
    for step in range(records):
        grad = GradientStats(0, 0, 0, 1.0 + (step % 97), "F32", 120.0, 1.0)
        warnings = (TelemetryWarning(f"CODE_{step % codes}", "m"),) if codes else ()
        record = TelemetryRecord(
            "r", 0, 1, step, 0.0, float(step % 13), "finite", grad, None, None, None,
            step % 1000 == 0, False, warnings, None,
        )  # fmt: skip
        summariser.add(record)
    return summariser.summary()


def test_series_and_lists_stay_bounded_and_keep_extremes() -> None:
    summary = _summarise_many(100_000, codes=200)
    assert len(summary.series) <= 256
    assert max(b.grad_max_abs or 0 for b in summary.series) == 97.0
    assert sum(b.records for b in summary.series) == 100_000
    assert sum(b.skipped for b in summary.series) == summary.skips.count == 100
    assert len(summary.skips.steps) == 10 and summary.skips.last_step == 99_000
    assert len(summary.warnings) == 64 + 1  # 64 codes, then the rest folded together
    assert "OTHER_CODES" in {w.code for w in summary.warnings}
    # The carried ones (the sawtooth loss also trips the derived LOSS_DIVERGENCE).
    assert sum(w.count for w in summary.warnings if w.source == "telemetry") == 100_000


def _mutants(document: dict[str, object]) -> list[dict[str, object]]:
    values: list[object] = [None, -1, 0, 2, 1.5, True, "x", {}, [], [{"code": "A", "message": "m"}]]
    found = []
    for key in document:
        found.append({k: v for k, v in document.items() if k != key})
        found += [{**document, key: value} for value in values]
    for nested in ("grad", "update"):
        inner = document[nested]
        if not isinstance(inner, dict):
            continue  # a held step's update is null
        for key in inner:
            found.append({**document, nested: {k: v for k, v in inner.items() if k != key}})
            found += [{**document, nested: {**inner, key: value}} for value in values]
    return found


def test_the_common_shape_fast_path_agrees_with_the_checked_parser(runs: dict[str, Path]) -> None:
    from nanrunbook.telemetry.record import TelemetryLineError, _checked_record, _common_record

    answered = 0
    for run in telemetry_runs.RUNS:
        raws = runs[run].read_bytes().splitlines()
        for raw in raws[:3] + raws[-2:]:
            for document in [orjson.loads(raw), *_mutants(orjson.loads(raw))]:
                fast = _common_record(document)
                if fast is None:
                    continue
                answered += 1
                try:
                    assert fast == _checked_record(document), document
                except TelemetryLineError as error:
                    raise AssertionError(f"fast path accepted {document}: {error}") from None
    assert answered > 100


# ----------------------------------------- lines the sentinel itself wrote

SENTINEL = Path(__file__).parent / "sentinel_telemetry"


def test_lines_written_by_the_sentinel_read_without_a_bad_line() -> None:
    """Telemetry of nanrunbook.capture.torch.Sentinel's own test runs (branch
    capture: a GradScaler probing K backoffs, the skip policy, a healthy AMP
    loop), with the fields it appends (activations, lr)."""
    probe = summarise_file(SENTINEL / "gradscaler-probe.jsonl")
    assert probe.bad_lines == 0 and probe.records == 4
    assert probe.scale is not None and probe.scale.longest_backoff_streak is not None
    assert probe.scale.longest_backoff_streak.length == 3
    codes = {w.code: w for w in probe.warnings}
    assert codes["LOSS_SCALE_BACKOFF_STREAK"].first_step == 2
    assert codes["LOSS_SCALE_BACKOFF_STREAK"].source == "telemetry"
    assert probe.holds.steps == (4,) and probe.exit_code() is Exit.HOLD
    skip = summarise_file(SENTINEL / "skip-policy.jsonl")
    assert skip.bad_lines == 0 and skip.first_nonfinite is not None
    assert skip.first_nonfinite.part == "loss:nan"
    healthy = summarise_file(SENTINEL / "healthy-amp.jsonl")
    assert healthy.bad_lines == 0 and healthy.status == "OK" and healthy.warnings == ()


def test_a_null_gradient_dtype_reads(tmp_path: Path) -> None:
    lines = (SENTINEL / "healthy-amp.jsonl").read_bytes().splitlines()
    document = orjson.loads(lines[0])
    document["grad"]["dtype"] = None
    record = parse_record(document)
    assert record.grad.dtype is None


def test_derived_codes_are_registered_warning_codes() -> None:
    from nanrunbook.telemetry.summary import DERIVED_CODES
    from nanrunbook.warning_codes import WARNING_CODES

    assert set(DERIVED_CODES) <= set(WARNING_CODES)
    source = (Path(__file__).parent.parent / "nanrunbook/telemetry/summary.py").read_text()
    derived = {c for c in WARNING_CODES if f'"{c}"' in source}
    assert derived == set(DERIVED_CODES)


def test_a_file_without_any_newline_is_read_in_bounded_pieces(tmp_path: Path) -> None:
    path = tmp_path / "one-huge-line.jsonl"
    path.write_bytes(b'{"format": "nanrunbook-telemetry/1", "pad": "' + b"x" * (5 * MAX_LINE_BYTES))
    summary = summarise_file(path)
    assert summary.bad_lines == 1 and summary.bad_examples[0].kind == "TOO_LONG"
    assert summary.incomplete is None and summary.status == "EMPTY"
    assert watch(str(path), "-f", "kv")[0] == Exit.REJECTED


def test_random_bytes_are_bad_lines_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "random.bin"
    path.write_bytes(random.Random(3).randbytes(300_000))
    summary = summarise_file(path)
    assert summary.records == 0 and summary.bad_lines > 0
    assert {b.kind for b in summary.bad_examples} <= {"NOT_JSON", "TOO_LONG"}
    code, _ = watch(str(path), "--no-plots")
    assert code == Exit.REJECTED


def test_the_man_page_names_every_summary_key(runs: dict[str, Path]) -> None:
    from nanrunbook.telemetry.watch_document import watch_document

    page = (Path(__file__).parent.parent / "man" / "nanrunbook.1").read_text()
    section = page.split(".SH TELEMETRY\n", 1)[1].split("\n.SH ", 1)[0].replace("\\-", "-")
    named = set(re.findall(r"[a-z_]+", section))
    document = watch_document(summarise_file(runs["scaler"]))
    assert set(document) <= named, set(document) - named
    _, out = watch(str(runs["scaler"]), "-f", "kv")
    assert set(kv(out)) <= named, set(kv(out)) - named


def test_ranks_interleaved_keep_their_own_streaks(runs: dict[str, Path], tmp_path: Path) -> None:
    """Two ranks' lines of the same steps, interleaved as two processes appending
    to one file: streaks are counted per rank, never across them, and a step
    both ranks back off at is one backoff of the job."""
    single = summarise_file(runs["scaler"])
    path = tmp_path / "two-ranks.jsonl"
    with JsonlSink(path) as sink:
        for record in read_telemetry(runs["scaler"]):
            assert isinstance(record, TelemetryRecord)
            sink.emit(replace(record, world_size=2))
            sink.emit(replace(record, rank=1, world_size=2))
    both = summarise_file(path)
    assert both.ranks == (0, 1) and both.world_size == 2
    assert both.records == 2 * single.records
    assert single.scale is not None and both.scale is not None
    assert both.scale.backoffs == single.scale.backoffs
    assert both.scale.longest_backoff_streak is not None
    assert single.scale.longest_backoff_streak is not None
    assert both.scale.longest_backoff_streak.length == single.scale.longest_backoff_streak.length
    assert both.step_regressions == 0


def test_the_last_record_line_names_the_gradient_norm(runs: dict[str, Path]) -> None:
    records = [r for r in read_telemetry(runs["healthy"]) if isinstance(r, TelemetryRecord)]
    norm = records[-1].grad.norm
    assert norm is not None
    code, out = watch(str(runs["healthy"]), "--no-plots")
    assert code == Exit.CONTINUE
    said = " ".join(out.split())
    assert (
        f"step {records[-1].step}: loss " in said and f"grad norm {norm:.4g}, grad max abs" in said
    )


# ------------------------------------- the numbers that explain a run (real sentinel runs)


@pytest.fixture(scope="module")
def sentinel_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from warning_runs import run

    tmp = tmp_path_factory.mktemp("sentinel")
    return {name: run(name, tmp).telemetry for name in ("activations_fp16", "lr_jump")}


def _facts(text: str) -> dict[str, str]:
    """The summary's label/value lines, a wrapped value joined."""
    facts: dict[str, str] = {}
    label = ""
    for line in text.split("Warnings, by")[0].splitlines()[1:]:
        if line[:19].strip():
            label = line[:19].strip()
            facts[label] = line[19:].strip()
        elif label:
            facts[label] += " " + line.strip()
    return facts


def test_float16_activations_are_not_reassured_by_float32_gradients(
    sentinel_runs: dict[str, Path],
) -> None:
    """A real float16-autocast run whose output creeps to 65504 and overflows:
    the compute headroom (the output's own dtype) comes before the gradients'
    float32 headroom and says it is the tighter one; the activations line says
    when they were last sampled."""
    path = sentinel_runs["activations_fp16"]
    documents = [orjson.loads(raw) for raw in path.read_bytes().splitlines()]
    sampled = [d["step"] for d in documents if d["activations"] is not None]
    least = min(
        d["output"]["headroom_bits"]
        for d in documents
        if d["output"] is not None and d["output"]["headroom_bits"] is not None
    )
    code, text = watch(str(path))
    assert code == Exit.HOLD
    assert all(len(line) <= 80 for line in text.splitlines())
    facts = _facts(text)
    labels = list(facts)
    assert labels.index("compute headroom") < labels.index("gradient headroom")
    compute = facts["compute headroom"]
    assert compute.startswith(f"F16 output, step {documents[-1]['step']} (rank 0): non-finite")
    assert f"(least {least:.2f}," in compute and "tighter than the gradients' F32" in compute
    assert facts["activations"].startswith(f"last sampled at step {sampled[-1]} (rank 0)")
    assert "compute headroom, bits below the F16 max (least per bucket)" in text
    document = json.loads(watch(str(path), "--format", "json")[1])
    assert document["compute_headroom"]["dtype"] == "F16"
    assert document["compute_headroom"]["min_bits"] == pytest.approx(least)
    assert document["activations_sampled"]["step"] == sampled[-1]
    assert document["last"]["activations"] == documents[-1]["activations"]
    found = kv(watch(str(path), "--format", "kv")[1])
    assert found["compute_headroom_dtype"] == ["F16"]
    assert found["activations_sampled_step"] == [str(sampled[-1])]


def test_the_learning_rate_and_gradient_norm_are_shown_and_plotted(
    sentinel_runs: dict[str, Path], runs: dict[str, Path]
) -> None:
    """A real run whose scheduler jumps the learning rate 40x: its range, the
    last record's lr, and plots of the lr and the gradient norm; a file whose
    lines carry neither (an older writer) shows neither."""
    path = sentinel_runs["lr_jump"]
    documents = [orjson.loads(raw) for raw in path.read_bytes().splitlines()]
    lrs = [d["lr"] for d in documents]
    code, text = watch(str(path))
    assert code == Exit.HOLD and all(len(line) <= 80 for line in text.splitlines())
    facts = _facts(text)
    assert facts["learning rate"] == (
        f"{lrs[0]:.4g} -> {lrs[-1]:.4g} (least {min(lrs):.4g}, most {max(lrs):.4g})"
    )
    assert max(lrs) / min(lrs) >= 10
    assert facts["last record"].endswith(f", lr {lrs[-1]:.4g}")
    assert "learning rate, log10 (min and max per bucket)" in text
    assert "gradient norm, log10 (max per bucket)" in text
    assert kv(watch(str(path), "--format", "kv")[1])["lr_last"] == [f"{lrs[-1]:.6g}"]
    older = _facts(watch(str(runs["blowup"]))[1])
    assert not {"learning rate", "compute headroom", "activations"} & set(older)

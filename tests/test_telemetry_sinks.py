"""The sinks a writer plugs in: JSONL appends, logging, TensorBoard (read back with its own reader)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import telemetry_runs

from nanrunbook.telemetry import (
    JsonlSink,
    LoggingSink,
    TelemetryRecord,
    TelemetrySink,
    TelemetryWarning,
    TensorBoardSink,
    read_telemetry,
    scalars,
)

NAMES = {
    "loss", "loss/nonfinite", "grad/max_abs", "grad/headroom_bits", "grad/norm", "grad/nonfinite",
    "update/max_abs", "update/nonfinite", "scale", "skipped", "held", "warnings",
}  # fmt: skip


@pytest.fixture(scope="module")
def scaler_records(tmp_path_factory: pytest.TempPathFactory) -> list[TelemetryRecord]:
    path = tmp_path_factory.mktemp("scaler") / "scaler.jsonl"
    telemetry_runs.scaler(path, steps=30)
    found = [r for r in read_telemetry(path) if isinstance(r, TelemetryRecord)]
    assert len(found) == 30
    return found


def test_every_sink_is_a_telemetry_sink(tmp_path: Path) -> None:
    with JsonlSink(tmp_path / "t.jsonl") as jsonl:
        assert isinstance(jsonl, TelemetrySink)
    assert isinstance(LoggingSink(), TelemetrySink)


def test_scalar_names_are_fixed(scaler_records: list[TelemetryRecord]) -> None:
    record = scaler_records[-1]
    values = scalars(record)
    assert set(values) == NAMES
    assert values["loss"] == record.loss and values["scale"] == record.scale
    assert values["grad/max_abs"] == record.grad.max_abs
    overflow = scaler_records[0]  # the scaler's first overflow: inf gradients, skipped
    assert overflow.found_inf and overflow.skipped
    assert scalars(overflow)["grad/nonfinite"] > 0 and scalars(overflow)["skipped"] == 1.0


def test_jsonl_sink_appends_lines_that_read_back(
    scaler_records: list[TelemetryRecord], tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"")
    with JsonlSink(path) as sink:
        for record in scaler_records[:10]:
            sink.emit(record)
    with JsonlSink(path, fsync=True) as sink:  # a second writer appends, never truncates
        for record in scaler_records[10:]:
            sink.emit(record)
    assert list(read_telemetry(path)) == scaler_records
    with pytest.raises(ValueError, match="closed"):
        sink.emit(scaler_records[0])


APPENDER = """
import sys
from nanrunbook.telemetry import JsonlSink, read_telemetry
records = list(read_telemetry(sys.argv[1]))
with JsonlSink(sys.argv[2]) as sink:
    for _ in range(int(sys.argv[3])):
        for record in records:
            sink.emit(record)
"""


def test_concurrent_appenders_never_interleave_lines(
    scaler_records: list[TelemetryRecord], tmp_path: Path
) -> None:
    source, shared = tmp_path / "source.jsonl", tmp_path / "shared.jsonl"
    with JsonlSink(source) as sink:
        for record in scaler_records:
            sink.emit(replace(record, warnings=(TelemetryWarning("PADDING", "x" * 3000),)))
    processes = [
        subprocess.Popen([sys.executable, "-c", APPENDER, str(source), str(shared), "20"])
        for _ in range(3)
    ]
    with JsonlSink(shared) as sink:  # and threads of this process
        threads = [
            threading.Thread(target=lambda: [sink.emit(r) for r in scaler_records * 5])
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    for process in processes:
        assert process.wait(timeout=120) == 0
    read = list(read_telemetry(shared))
    assert all(isinstance(item, TelemetryRecord) for item in read)
    assert len(read) == 3 * 20 * 30 + 3 * 5 * 30


def test_logging_sink_logs_each_step_with_the_same_names(
    scaler_records: list[TelemetryRecord], caplog: pytest.LogCaptureFixture
) -> None:
    held = replace(scaler_records[-1], held=True, bundle="incidents/run/step-29", step=29)
    warned = replace(
        scaler_records[5], warnings=(TelemetryWarning("NEAR_DTYPE_MAX", "0.4 bits left"),)
    )
    caplog.set_level(logging.INFO, logger="nanrunbook.telemetry")
    with LoggingSink() as sink:
        for record in (scaler_records[4], warned, held):
            sink.emit(record)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 3
    assert (
        infos[0].getMessage().startswith(f"run scaler rank 0 step {scaler_records[4].step}: loss=")
    )
    shown = [pair.split("=")[0] for pair in infos[2].getMessage().split(": ", 1)[1].split()]
    assert set(shown) == NAMES and len(shown) == len(NAMES)
    assert "grad/norm=" not in infos[0].getMessage()  # an overflow step has no norm: left out
    assert infos[0].scalars == scalars(scaler_records[4])  # type: ignore[attr-defined]
    assert infos[0].telemetry["format"] == "nanrunbook-telemetry/1"  # type: ignore[attr-defined]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"run scaler rank 0 step {warned.step}: NEAR_DTYPE_MAX 0.4 bits left"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["run scaler rank 0 step 29: update held; bundle incidents/run/step-29"]


def test_logging_sink_every_n_still_logs_what_matters(
    scaler_records: list[TelemetryRecord], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quiet")
    with LoggingSink("quiet", every=10) as sink:
        for record in scaler_records[10:30]:
            sink.emit(record)
        sink.emit(replace(scaler_records[-1], held=True))
    steps = [int(r.getMessage().split(" step ")[1].split(":")[0]) for r in caplog.records]
    assert steps[:2] == [10, 20] and steps[-2:] == [29, 29]  # the held step: INFO and ERROR


class RecordingWriter:
    """Any object with SummaryWriter's add_scalar, as tensorboardX's writer has."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []
        self.flushed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append((tag, value, step))

    def flush(self) -> None:
        self.flushed = True


def test_tensorboard_sink_sends_every_scalar_to_a_given_writer(
    scaler_records: list[TelemetryRecord],
) -> None:
    writer = RecordingWriter()
    with TensorBoardSink(writer, prefix="nanrunbook/") as sink:
        sink.emit(scaler_records[7])
    assert {tag for tag, _, _ in writer.calls} == {f"nanrunbook/{n}" for n in NAMES}
    assert all(step == scaler_records[7].step for _, _, step in writer.calls)
    assert writer.flushed
    with pytest.raises(TypeError, match="add_scalar"):
        TensorBoardSink(object())


def test_the_test_extra_installs_tensorboard() -> None:
    """``make test`` installs ``.[test]``: tensorboard is in it, so the real sink's
    test below runs there instead of being skipped."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["test"]
    wanted = [Requirement(line) for line in extra if Requirement(line).name == "tensorboard"]
    assert wanted, "tensorboard is missing from the test extra"
    assert version("tensorboard") in wanted[0].specifier
    assert "2.21.0" in wanted[0].specifier  # the version the suite was run with


def test_tensorboard_sink_refuses_cleanly_without_tensorboard(tmp_path: Path) -> None:
    """Without the tensorboard package (hidden from this fresh interpreter):
    SinkUnavailable naming the package to install."""
    program = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from nanrunbook.telemetry import SinkUnavailable, TensorBoardSink\n"
        "try:\n"
        f"    TensorBoardSink(log_dir={str(tmp_path)!r})\n"
        "except SinkUnavailable as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "pip install tensorboard" in result.stdout
    assert list(tmp_path.iterdir()) == []  # no event file begun


def test_tensorboard_sink_writes_event_files(
    scaler_records: list[TelemetryRecord], tmp_path: Path
) -> None:
    """The real SummaryWriter, read back with tensorboard's own EventAccumulator:
    every name, every step, every value (as float32, which the event file holds)."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardSink(log_dir=tmp_path, prefix="run/") as sink:
        for record in scaler_records:
            sink.emit(record)
    assert list(tmp_path.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == {f"run/{name}" for name in NAMES}
    for name in NAMES:
        read = [(e.step, e.value) for e in events.Scalars(f"run/{name}")]
        sent = [(r.step, scalars(r)[name]) for r in scaler_records if name in scalars(r)]
        assert [step for step, _ in read] == [step for step, _ in sent], name
        np.testing.assert_array_equal(
            np.array([v for _, v in read], dtype=np.float32),
            np.array([v for _, v in sent], dtype=np.float32),
            err_msg=name,
        )

"""Every text screen at 80 columns: check (bundles, several paths, incident sets),
merge, diff and watch, on the fixtures and on generated sets, pairs and telemetry.
json and kv are left as they are (one fact a line, whole)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import telemetry_runs
from bundlekit import FIXTURES
from diffkit import finite_tensors, write_bundle
from setkit import break_json, make_set, reject_data
from typer.testing import CliRunner

from nanrunbook.cli import app

runner = CliRunner()
COLUMNS = 80


def text_of(*args: str, columns: int = COLUMNS) -> str:
    result = runner.invoke(app, list(args), prog_name="nanrunbook", env={"COLUMNS": str(columns)})
    assert "Traceback" not in result.output, result.output
    return result.stdout


def assert_fits(text: str, columns: int = COLUMNS) -> None:
    assert text.strip(), "no output"
    widest = max(text.splitlines(), key=len)
    assert len(widest) <= columns, f"{len(widest)} columns: {widest!r}"


FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").is_file())


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sets")
    found = {
        "hold": make_set(root / "hold", 4, holds={1: "backward", 3: "backward"}),
        "clean": make_set(root / "clean", 2),
        "missing": make_set(root / "missing", 64, ranks=[0, 5, 9, 33], holds={5: "forward"}),
        "long-names": make_set(
            root / "long-names", 3, holds={2: "loss"}, name="a-rather-long-member-name-{rank:05d}"
        ),
        "runs": make_set(root / "runs", 2, run_id="run-a"),
    }
    make_set(root / "runs", 2, ranks=[1], run_id="run-b", name="other-{rank:05d}")
    rejected = make_set(root / "rejected", 3, holds={0: "input"})
    reject_data(rejected / "rank-00001")
    break_json(rejected / "rank-00002")
    found["rejected"] = rejected
    nested = root / "nested"
    make_set(nested / "job-a", 2)
    make_set(nested / "job-b", 2)
    found["nested"] = nested
    return found


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_check_text_on_each_fixture_fits(name: str) -> None:
    assert_fits(text_of("check", str(FIXTURES / name)))
    assert_fits(text_of("check", "--checklist", str(FIXTURES / name)))


def test_check_of_several_fixtures_fits() -> None:
    assert_fits(text_of("check", *(str(FIXTURES / n) for n in FIXTURE_NAMES)))


@pytest.mark.parametrize("case", ["hold", "clean", "missing", "long-names", "runs", "rejected"])
def test_check_text_on_generated_sets_fits(sets: dict[str, Path], case: str) -> None:
    assert_fits(text_of("check", str(sets[case])))


def test_check_text_on_a_directory_of_sets_and_on_several_sets_fits(
    sets: dict[str, Path],
) -> None:
    assert_fits(text_of("check", str(sets["nested"])))
    assert_fits(text_of("check", *(str(p) for p in sets.values())))


def test_merge_text_fits(sets: dict[str, Path], tmp_path: Path) -> None:
    reports = []
    for member in sorted(sets["hold"].iterdir()):
        report = tmp_path / f"{member.name}.json"
        report.write_text(text_of("check", "--format", "json", str(member)))
        reports.append(str(report))
    assert_fits(text_of("merge", *reports))


def test_the_rank_table_keeps_its_columns_when_wrapped(sets: dict[str, Path]) -> None:
    text = text_of("check", str(sets["long-names"]))
    rows = [line for line in text.splitlines() if "a-rather-long-member-name-" in line]
    assert len(rows) == 3
    assert len({line.index("a-rather-long") for line in rows}) == 1


def _pair(root: Path, **other: object) -> tuple[str, str]:
    root.mkdir(parents=True)
    base = write_bundle(root / "base")
    return str(base), str(write_bundle(root / "other", **other))  # type: ignore[arg-type]


def test_diff_text_fits_and_shortens_content_ids(tmp_path: Path) -> None:
    many = finite_tensors()
    many["optimizer"] = [(f"update/layer{i:03d}.weight", np.ones(3, "<f4")) for i in range(40)]
    base, other = _pair(tmp_path / "one-sided", tensors=many)
    text = text_of("diff", base, other)
    assert_fits(text)
    assert "Only in other (" in text
    ids = [
        json.loads((Path(p) / "manifest.json").read_text())["evidence_content_id"]
        for p in (base, other)
    ]
    assert not any(content_id in text for content_id in ids)
    assert any(content_id.split("@")[-1][:19] in text for content_id in ids)


def test_diff_text_of_changed_mechanisms_and_of_rejections_fits(tmp_path: Path) -> None:
    base, other = _pair(
        tmp_path / "changed",
        changes={"optimizer": {"name": "a-very-long-optimizer-name-" * 4, "lr": 0.5}},
        run_id="a-different-run-with-a-long-identifier",
    )
    assert_fits(text_of("diff", base, other))
    rejected = tmp_path / "rejected"
    write_bundle(rejected)
    break_json(rejected)
    assert_fits(text_of("diff", str(rejected), str(FIXTURES / "rejected-digests")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return telemetry_runs.write_all(tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("run", list(telemetry_runs.RUNNERS))
def test_watch_text_fits(runs: dict[str, Path], run: str) -> None:
    assert_fits(text_of("watch", str(runs[run])))
    assert_fits(text_of("watch", "--no-plots", "--since", "5", str(runs[run])))


@pytest.mark.parametrize("run", list(telemetry_runs.RUNNERS))
def test_watch_follow_text_fits(runs: dict[str, Path], run: str) -> None:
    assert_fits(text_of("watch", "--follow", "--stop-after-idle", "0.2", str(runs[run])))


def test_a_wider_terminal_gets_longer_lines(sets: dict[str, Path]) -> None:
    """The width is the terminal's, not a fixed 80."""
    wide = text_of("check", str(sets["long-names"]), columns=200)
    assert max(len(line) for line in wide.splitlines()) > COLUMNS

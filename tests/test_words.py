"""Words on screen and in logs: the typos and unclear lines readers met."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import telemetry_runs
from bundlekit import FIXTURES
from setkit import break_json, make_set

from nanrunbook import EvidenceRejected, check_bundle, check_incident_set
from nanrunbook.output.panels import watch_panels
from nanrunbook.output.svg import watch_svg
from nanrunbook.strictjson import load_manifest
from nanrunbook.telemetry import summarise_file
from nanrunbook.verdict.incident_set import IncidentSet


def test_an_unterminated_string_is_said_once_at_its_line() -> None:
    with pytest.raises(EvidenceRejected) as error:
        load_manifest(b'{"format": "nanrunbook-bun')
    message = error.value.violations[0].message
    assert "at at" not in message
    assert message.startswith("Unterminated string starting at line 1 column 12")


def test_the_headroom_panel_names_its_dtype_once(tmp_path: Path) -> None:
    path = tmp_path / "healthy.jsonl"
    telemetry_runs.healthy(path, steps=12)
    summary = summarise_file(path)
    titles = [panel.title for panel in watch_panels(summary)]
    assert "gradient headroom, bits below the F32 max (least per bucket)" in titles
    assert "the its" not in watch_svg(summary, "heading")
    # Without a known dtype the panel still reads as English.
    unknown = replace(summary, headroom=None)
    assert any("bits below its dtype's max" in p.title for p in watch_panels(unknown))


def test_a_rejected_set_of_one_member_says_member(tmp_path: Path) -> None:
    root = make_set(tmp_path / "one", 2, ranks=[0])
    break_json(root / "rank-00000")
    result = check_incident_set(root)
    assert isinstance(result, IncidentSet) and result.decision == "REJECTED"
    import io

    from nanrunbook.output.text import TextRenderer

    out = io.StringIO()
    TextRenderer(width=200).incident_set(result, out)
    first = out.getvalue().splitlines()[0]
    assert "1 member," in first and "1 members" not in first


def test_the_held_line_of_a_rank_whose_own_bundle_is_clean() -> None:
    from nanrunbook.capture.torch.sentinel._capture import held_line

    clean = check_bundle(FIXTURES / "continue-all-finite")
    line = held_line(7, Path("incident/run/step-7/rank-1"), clean, peer=True)
    assert "at no stage" not in line and "None" not in line
    assert line.startswith("step 7 held because another rank's values went non-finite")
    assert "every value it captured is finite" in line
    alone = held_line(7, Path("b"), clean)
    assert "another rank" not in alone and "did not come back on the replay" in alone
    held = held_line(7, Path("b"), check_bundle(FIXTURES / "hold-loss"))
    assert "checks HOLD at loss (first non-finite tensor " in held


def _cli(*args: str) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from nanrunbook.cli import app

    result = CliRunner().invoke(app, list(args), prog_name="nanrunbook", env={"COLUMNS": "200"})
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout, result.stderr


def test_a_path_given_to_the_wrong_command_names_the_one_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # short paths: a long one is cut to keep the line one line
    root = make_set(Path("set"), 2)
    bundle = root / "rank-00000"
    code, _, err = _cli("watch", str(bundle))
    assert code == 3
    assert f"is an evidence bundle, not telemetry: judge it with nanrunbook check '{bundle}'" in err
    Path("run").mkdir()
    (Path("run") / "telemetry-rank-00001.jsonl").write_text("")
    code, _, err = _cli("watch", "run")  # a run directory: a job's telemetry
    assert code == 3 and "no telemetry record in" in err and "telemetry-rank-00001.jsonl" in err
    code, out, _ = _cli("check", str(bundle / "manifest.json"))
    assert code == 3 and f"(this is its manifest): nanrunbook check '{bundle}'" in out
    code, out, _ = _cli("merge", str(root))
    assert code == 3
    assert "is a directory: merge reads the JSON reports 'nanrunbook check --format json'" in out
    assert f"directory with nanrunbook check '{root}'" in out

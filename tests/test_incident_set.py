"""Incident sets (spec section 11): each set rule, the origin, merge against the
direct check, several paths at once, and the parallel check of members.

Every set is built from real bundles written by the capture writer, one per
rank; a case then breaks what it tests. Each case's kv is asserted whole, and
``merge`` of the members' ``check --format json`` reports must print the same kv.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bundlekit import FIXTURES
from setkit import break_json, edit, make_set, rank_bundle, reject_data

import nanrunbook
import nanrunbook.check
import nanrunbook.tensors.verify
from nanrunbook import EvidenceRejected, check_bundle, check_incident_set, merge_reports
from nanrunbook.check import judge_bundle
from nanrunbook.contract import contract_content_id
from nanrunbook.output.json import JsonRenderer
from nanrunbook.output.kv import KvRenderer
from nanrunbook.output.text import TextRenderer
from nanrunbook.verdict.incident_set import IncidentSet, set_document

CLI = [sys.executable, "-m", "nanrunbook"]
CID = contract_content_id()
HEAD = ["contract_version=training-incident-v1", f"contract_content_id={CID}"]


def kv(result: IncidentSet) -> list[str]:
    out = io.StringIO()
    KvRenderer().incident_set(result, out)
    return out.getvalue().splitlines()


def answer(run: str = "run-ranks", step: int = 10, **fields: Any) -> list[str]:
    """The kv lines of an accepted set, in spec order, then its warnings count."""
    values = {
        "run": run,
        "step": step,
        "world_size": 4,
        "ranks_present": 4,
        "missing_ranks": "none",
        "rejected_members": 0,
        "earliest_nonfinite": "none",
        "origin_ranks": "none",
        "origin": "NONE",
        "decision": "CONTINUE_BOUNDED_DIAGNOSTICS",
        "action": "no-nonfinite-evidenced-check-other-signals",
        "root_cause_claim": "NONE_SYMPTOM_LOCATION_IS_NOT_CAUSALITY",
        "warnings": 0,  # appended after the spec's lines, as a bundle's are
    }
    values.update(fields)
    return HEAD + [f"{key}={value}" for key, value in values.items()]


def hold(stage: str, origin_ranks: str, origin: str, **fields: Any) -> list[str]:
    actions = {
        "input": "hold-and-inspect-input-data-contract",
        "forward": "hold-and-replay-forward-activations",
        "loss": "hold-and-inspect-objective-reduction",
        "backward": "hold-and-inspect-gradient-path-and-loss-scaling",
    }
    return answer(
        earliest_nonfinite=stage,
        origin_ranks=origin_ranks,
        origin=origin,
        decision="HOLD",
        action=actions[stage],
        **fields,
    )


def rejected(*violations: str) -> list[str]:
    lines = [*HEAD, "decision=REJECTED", f"violations={len(violations)}"]
    return lines + [f"violation={v}" for v in violations]


def member_violations(bundle: Path, name: str | None = None) -> list[str]:
    """A member's own violations as the set's kv prints them, from checking it alone."""
    with pytest.raises(EvidenceRejected) as caught:
        check_bundle(bundle)
    return [f"{v.code} {name or bundle.name}/{v.where}" for v in caught.value.violations]


# ------------------------------------------------------------------ the cases

Case = Callable[[Path], "tuple[Path, list[str]]"]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__.removeprefix("case_").replace("_", "-")] = fn
    return fn


@case
def case_continue_every_rank_present(tmp: Path) -> tuple[Path, list[str]]:
    return make_set(tmp / "set", 4), answer()


@case
def case_one_rank(tmp: Path) -> tuple[Path, list[str]]:
    return make_set(tmp / "set", 4, holds={1: "input"}), hold("input", "1", "ONE_RANK")


@case
def case_some_ranks(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 4, holds={0: "forward", 2: "forward", 3: "loss"})
    return root, hold("forward", "0,2", "SOME_RANKS")


@case
def case_all_ranks(tmp: Path) -> tuple[Path, list[str]]:
    holds = dict.fromkeys(range(4), "backward")
    return make_set(tmp / "set", 4, holds=holds), hold("backward", "0,1,2,3", "ALL_RANKS")


@case
def case_origin_is_the_earliest_stage_not_every_holder(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 3, holds={0: "forward", 1: "forward", 2: "input"})
    return root, hold("input", "2", "ONE_RANK", world_size=3, ranks_present=3)


@case
def case_world_size_one(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 1, holds={0: "loss"})
    return root, hold("loss", "0", "ONE_RANK", world_size=1, ranks_present=1)


@case
def case_missing_rank_without_hold(tmp: Path) -> tuple[Path, list[str]]:
    return make_set(tmp / "set", 4, ranks=[0, 1, 3]), rejected("SET_RANKS_MISSING .")


@case
def case_missing_rank_with_hold(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 4, ranks=[0, 1, 3], holds={1: "forward"})
    return root, hold("forward", "1", "ONE_RANK", ranks_present=3, missing_ranks="2")


@case
def case_missing_ranks_listed_ascending(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 8, ranks=[0, 2, 4, 5], holds={4: "input", 5: "input"})
    expected = hold(
        "input", "4,5", "SOME_RANKS", world_size=8, ranks_present=4, missing_ranks="1,3,6,7"
    )
    return root, expected


@case
def case_rejected_member_beside_a_hold(tmp: Path) -> tuple[Path, list[str]]:
    # Rejected for its data, after its topology was read: rank 2 is present.
    root = make_set(tmp / "set", 4, holds={0: "input"})
    reject_data(root / "rank-00002")
    return root, hold("input", "0", "ONE_RANK", rejected_members=1)


@case
def case_member_unreadable_beside_a_hold(tmp: Path) -> tuple[Path, list[str]]:
    # Rejected before its topology can be read: it declares no rank, rank 3 is missing.
    root = make_set(tmp / "set", 4, holds={0: "input"})
    break_json(root / "rank-00003")
    expected = hold(
        "input", "0", "ONE_RANK", ranks_present=3, missing_ranks="3", rejected_members=1
    )
    return root, expected


@case
def case_rejected_member_without_hold(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 2)
    reject_data(root / "rank-00001")
    return root, rejected(*member_violations(root / "rank-00001"))


@case
def case_no_member_readable(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 2)
    for name in ("rank-00000", "rank-00001"):
        break_json(root / name)
    violations = [
        "SET_RANKS_MISSING .",
        "MANIFEST_INVALID_JSON rank-00000/manifest.json",
        "MANIFEST_INVALID_JSON rank-00001/manifest.json",
    ]
    return root, rejected(*violations)


@case
def case_run_mismatch_rejects_a_hold(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 4, ranks=[0, 1, 3], holds={0: "input"})
    rank_bundle(root / "rank-00002", rank=2, world_size=4, run_id="run-other")
    return root, rejected("SET_RUN_MISMATCH rank-00002")


@case
def case_step_mismatch(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 4, ranks=[0, 1, 2], holds={1: "loss"})
    rank_bundle(root / "rank-00003", rank=3, world_size=4, step=11)
    return root, rejected("SET_STEP_MISMATCH rank-00003")


@case
def case_world_size_mismatch(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 4, ranks=[0, 1, 2], holds={1: "loss"})
    rank_bundle(root / "rank-00003", rank=3, world_size=8)
    return root, rejected("SET_WORLD_SIZE_MISMATCH rank-00003")


@case
def case_duplicate_rank(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 2, holds={0: "input"})
    shutil.copytree(root / "rank-00001", root / "rank-00001-again")
    return root, rejected("SET_RANK_DUPLICATE rank-00001-again")


@case
def case_contract_mismatch(tmp: Path) -> tuple[Path, list[str]]:
    root = make_set(tmp / "set", 2, holds={0: "input"})
    edit(root / "rank-00001", lambda m: m.update(contract_version="training-incident-v2"))
    member = member_violations(root / "rank-00001")
    return root, rejected("SET_CONTRACT_MISMATCH rank-00001", *member)


@case
def case_members_with_names_that_are_not_identifiers(tmp: Path) -> tuple[Path, list[str]]:
    root = tmp / "set"
    rank_bundle(root / "rank 0", rank=0, world_size=2)
    rank_bundle(root / "r1", rank=1, world_size=2)
    shutil.copytree(root / "r1", root / "-r1 copy")  # sorts first: r1 is the duplicate
    shutil.copytree(root / "r1", root / "rânk-1")  # not ASCII
    reject_data(root / "rank 0")
    own = [line.replace("rank 0/", "[?]/") for line in member_violations(root / "rank 0")]
    # Members are ordered by their shown names: quoted ones ('-r1 copy') first.
    expected = rejected("SET_RANK_DUPLICATE [?]", "SET_RANK_DUPLICATE r1", *own)
    return root, expected


def build(name: str, tmp: Path) -> tuple[Path, list[str]]:
    return CASES[name](tmp)


@pytest.mark.parametrize("name", sorted(CASES))
def test_set_answer(name: str, tmp_path: Path) -> None:
    root, expected = build(name, tmp_path)
    result = check_incident_set(root)
    assert kv(result) == expected
    assert result.exit_code == {"HOLD": 1, "CONTINUE_BOUNDED_DIAGNOSTICS": 0}.get(
        result.decision, 3
    )


def _member_reports(root: Path, reports: Path) -> list[Path]:
    """Each member checked on its own, as a node would: ``check --format json``."""
    reports.mkdir()
    written = []
    for index, member in enumerate(sorted(p for p in root.iterdir() if p.is_dir())):
        out = io.StringIO()
        JsonRenderer().judgement(judge_bundle(member), out)
        path = reports / f"node-{index}.json"
        path.write_text(out.getvalue())
        written.append(path)
    return written


@pytest.mark.parametrize("name", sorted(CASES))
def test_merge_of_member_reports_answers_as_the_set(name: str, tmp_path: Path) -> None:
    root, expected = build(name, tmp_path)
    reports = _member_reports(root, tmp_path / "reports")
    merged = merge_reports(reports)
    assert kv(merged) == kv(check_incident_set(root)) == expected
    assert merged.path is None and merged.merged_from == tuple(str(p) for p in reports)


@pytest.mark.parametrize("name", sorted(CASES))
def test_merge_of_partial_sets_answers_as_the_set(name: str, tmp_path: Path) -> None:
    """Two nodes, each holding part of the set directory, each checking its part."""
    root, expected = build(name, tmp_path)
    members = sorted(p for p in root.iterdir() if p.is_dir())
    reports = []
    for node, part in enumerate((members[::2], members[1::2])):
        local = tmp_path / f"node-{node}" / "incident"
        local.mkdir(parents=True)
        for member in part:
            shutil.copytree(member, local / member.name)
        if not part:
            continue
        out = io.StringIO()
        JsonRenderer().incident_set(check_incident_set(local), out)
        reports.append(tmp_path / f"node-{node}.json")
        reports[-1].write_text(out.getvalue())
    assert kv(merge_reports(reports)) == expected


# --------------------------------------------------------------- the empty set


def test_an_empty_set(tmp_path: Path) -> None:
    empty = tmp_path / "incident"
    empty.mkdir()
    (empty / "notes").mkdir()  # a subdirectory without manifest.json is no member
    (empty / "README").write_text("not a member")
    result = check_incident_set(empty)
    assert kv(result) == rejected("SET_EMPTY .")
    document = tmp_path / "empty.json"
    document.write_text(json.dumps(set_document(result)))
    assert kv(merge_reports([document])) == rejected("SET_EMPTY .")


def test_check_of_a_directory_without_bundles_stays_manifest_missing(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    done = run("check", "--format", "kv", str(tmp_path))
    assert done.returncode == 3
    assert "violation=MANIFEST_MISSING manifest.json" in done.stdout.splitlines()


def test_a_directory_of_sets_says_it_holds_sets(tmp_path: Path) -> None:
    make_set(tmp_path / "run-7" / "1842", 2)
    done = run("check", str(tmp_path / "run-7"))
    assert done.returncode == 3
    assert "MANIFEST_MISSING" in done.stdout
    assert "incident sets (directories of rank bundles) one level down: '1842'" in done.stdout


def test_the_library_refuses_a_path_that_is_no_directory(tmp_path: Path) -> None:
    with pytest.raises(EvidenceRejected) as caught:
        check_incident_set(tmp_path / "absent")
    assert caught.value.codes == ("BUNDLE_NOT_FOUND",)


# ---------------------------------------------------- members and the path rules


def test_the_rank_comes_from_the_manifest_not_the_name(tmp_path: Path) -> None:
    root = tmp_path / "set"
    rank_bundle(root / "rank-00001", rank=0, world_size=2, hold="input")
    rank_bundle(root / "rank-00000", rank=1, world_size=2)
    result = check_incident_set(root)
    assert result.origin_ranks == (0,)
    assert {m.name: m.rank for m in result.members} == {"rank-00001": 0, "rank-00000": 1}


def test_a_symlinked_member_inside_the_set_is_one_member(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 2, holds={1: "input"})
    (root / "latest").symlink_to("rank-00001")  # a second name of one member
    (root / ".staging").mkdir()
    rank_bundle(root / ".staging" / "r2", rank=2, world_size=3)
    (root / "rank-00002").symlink_to(".staging/r2")
    result = check_incident_set(root)
    assert [m.name for m in result.members] == ["rank-00000", "rank-00001", "rank-00002"]
    assert result.ranks == (0, 1, 2) and result.decision == "REJECTED"  # world sizes differ
    assert [(v.code, v.where) for v in result.violations] == [
        ("SET_WORLD_SIZE_MISMATCH", "rank-00002")
    ]


def test_a_symlink_out_of_the_set_is_a_rejected_member_never_read(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 2, ranks=[0], holds={0: "input"})
    outside = rank_bundle(tmp_path / "elsewhere", rank=1, world_size=2)
    (root / "rank-00001").symlink_to(outside)
    result = check_incident_set(root)
    assert kv(result) == hold(
        "input",
        "0",
        "ONE_RANK",
        world_size=2,
        ranks_present=1,
        missing_ranks="1",
        rejected_members=1,
    )
    member = next(m for m in result.members if m.name == "rank-00001")
    assert member.violations[0].code == "MANIFEST_UNREADABLE"
    assert "outside the set" in member.violations[0].message


def test_members_are_read_only(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 3, holds={2: "forward"})
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    check_incident_set(root)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps


# ------------------------------------------------------------------- the CLI


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_cli_check_of_a_set(tmp_path: Path) -> None:
    root = make_set(tmp_path / "incident", 4, holds={2: "forward"})
    reject_data(root / "rank-00003")
    text = run("check", str(root))
    assert text.returncode == 1
    head = text.stdout.splitlines()[:3]
    assert head[0].startswith("nanrunbook check: HOLD - incident set")
    assert head[1].split() == ["origin", "ONE_RANK:", "rank", "2"]
    assert head[2].split() == ["earliest", "non-finite", "stage", "forward"]
    rows = [line.split() for line in text.stdout.splitlines() if line.startswith("  2 ")]
    assert rows == [["2", "rank-00002", "HOLD", "forward", "-", "forward/b", "<-", "origin"]]
    assert any(
        line.split()[:3] == ["3", "rank-00003", "REJECTED"] for line in text.stdout.splitlines()
    )

    kv_out = run("check", "--format", "kv", str(root))
    assert kv_out.returncode == 1
    assert kv_out.stdout.splitlines() == hold("forward", "2", "ONE_RANK", rejected_members=1)

    document = json.loads(run("check", "--format", "json", str(root)).stdout)
    assert document["report_format"] == "nanrunbook-set-report/1"
    assert document["origin"] == "ONE_RANK" and document["origin_ranks"] == [2]
    assert [m["name"] for m in document["members"]] == [f"rank-0000{r}" for r in range(4)]
    accepted = document["members"][2]["report"]
    alone = json.loads(run("check", "--format", "json", str(root / "rank-00002")).stdout)
    assert alone["set_member"]["set_path"] == str(root)  # checked alone, it names its set
    assert accepted == {**alone, "set_member": None}  # inside its set, it is not alone
    refused = document["members"][3]["report"]
    assert refused["decision"] == "REJECTED" and refused["declared"]["rank"] == 3


def test_cli_several_paths_each_on_its_own(tmp_path: Path) -> None:
    incident = make_set(tmp_path / "incident", 2, holds={0: "input"})
    paths = [
        str(FIXTURES / "continue-all-finite"),
        str(incident),
        str(FIXTURES / "hold-loss"),
        str(tmp_path / "absent"),
    ]
    text = run("check", *paths)
    assert text.returncode == 3  # the most severe
    # An entry longer than the width wraps under its own text: join it back.
    lines: list[str] = []
    for line in text.stdout.splitlines():
        if line.startswith(" "):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    assert [line.split()[0] for line in lines[:4]] == [
        "CONTINUE_BOUNDED_DIAGNOSTICS",
        "HOLD",
        "HOLD",
        "REJECTED",
    ]
    assert "incident set, 2 of 2 ranks" in lines[1] and "origin ONE_RANK 0" in lines[1]
    assert (
        lines[4]
        == "4 checked: 1 REJECTED, 2 HOLD, 1 CONTINUE_BOUNDED_DIAGNOSTICS; exit 3, the most severe"
    )

    assert run("check", *paths[:3]).returncode == 1
    assert run("check", paths[0], paths[0]).returncode == 0

    documents = json.loads(run("check", "--format", "json", *paths).stdout)
    assert [d["decision"] for d in documents] == [
        "CONTINUE_BOUNDED_DIAGNOSTICS",
        "HOLD",
        "HOLD",
        "REJECTED",
    ]
    assert documents[1]["report_format"] == "nanrunbook-set-report/1"

    kv_lines = run("check", "--format", "kv", *paths).stdout.splitlines()
    assert kv_lines[0] == "checked=4"
    one = run("check", "--format", "kv", paths[1]).stdout.splitlines()
    assert [line for line in kv_lines if line.startswith("2.")] == [f"2.{x}" for x in one]
    assert "4.violation=BUNDLE_NOT_FOUND " + str(tmp_path / "absent") in kv_lines


def test_cli_a_directory_of_unrelated_bundles_says_what_it_holds(tmp_path: Path) -> None:
    root = tmp_path / "bundles"
    rank_bundle(root / "a", rank=0, world_size=1, run_id="run-a")
    rank_bundle(root / "b", rank=0, world_size=1, run_id="run-b", step=12)
    done = run("check", str(root))
    assert done.returncode == 3
    said = " ".join(done.stdout.split())  # lines wrap to the width
    assert "is not a bundle (it has no manifest.json) and not one incident set" in said
    assert "bundles one level down: 'a', 'b', of 2 runs and 2 steps" in said
    assert "SET_RUN_MISMATCH b" in done.stdout and "SET_STEP_MISMATCH b" in done.stdout
    kv_lines = run("check", "--format", "kv", str(root)).stdout.splitlines()
    assert kv_lines == rejected("SET_RUN_MISMATCH b", "SET_STEP_MISMATCH b", "SET_RANK_DUPLICATE b")


def test_cli_merge(tmp_path: Path) -> None:
    root = make_set(tmp_path / "incident", 3, holds={1: "backward", 2: "backward"})
    reports = []
    for index, member in enumerate(sorted(root.iterdir())):
        done = run("check", "--format", "json", str(member))
        reports.append(tmp_path / f"node-{index}.json")
        reports[-1].write_text(done.stdout)
    merged = run("merge", "--format", "kv", *map(str, reports))
    assert merged.returncode == 1
    assert merged.stdout == run("check", "--format", "kv", str(root)).stdout
    assert "origin=SOME_RANKS" in merged.stdout.splitlines()
    text = run("merge", *map(str, reports))
    assert text.stdout.startswith("nanrunbook merge: HOLD - incident set merged from 3 reports")

    # The same report twice is one rank seen twice.
    twice = run("merge", "--format", "kv", str(reports[0]), str(reports[1]), str(reports[1]))
    assert twice.returncode == 3
    assert "violation=SET_RANK_DUPLICATE rank-00001" in twice.stdout.splitlines()


def test_cli_merge_refuses_reports_of_another_run_or_step(tmp_path: Path) -> None:
    make_set(tmp_path / "a", 2, holds={0: "input"})
    rank_bundle(tmp_path / "b" / "rank-00001", rank=1, world_size=2, step=11)
    for side in ("a", "b"):
        (tmp_path / f"{side}.json").write_text(
            run("check", "--format", "json", str(tmp_path / side)).stdout
        )
    merged = run("merge", "--format", "kv", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert merged.returncode == 3
    assert "violation=SET_STEP_MISMATCH rank-00001" in merged.stdout.splitlines()
    assert "violation=SET_RANK_DUPLICATE rank-00001" in merged.stdout.splitlines()


def test_cli_merge_of_bad_reports(tmp_path: Path) -> None:
    good = make_set(tmp_path / "incident", 2, holds={0: "input"})
    (tmp_path / "node-0.json").write_text(
        run("check", "--format", "json", str(good / "rank-00000")).stdout
    )
    (tmp_path / "node-1.json").write_text('{"report_format": "nanrunbook-report/1", "deci')
    (tmp_path / "node-2.json").write_text('{"report_format": "other/9"}')
    paths = [str(tmp_path / f"node-{i}.json") for i in range(3)] + [str(tmp_path / "absent.json")]
    merged = run("merge", "--format", "json", *paths)
    assert merged.returncode == 1  # rank 0's HOLD stands on its own evidence
    document = json.loads(merged.stdout)
    assert document["rejected_members"] == 3 and document["missing_ranks"] == [1]
    codes = {
        m["name"]: m["report"]["violations"][0]["code"]
        for m in document["members"]
        if m["decision"] == "REJECTED"
    }
    assert codes == {
        "absent.json": "REPORT_UNREADABLE",
        "node-1.json": "REPORT_INVALID",
        "node-2.json": "REPORT_INVALID",
    }
    alone = run("merge", "--format", "kv", *paths[1:])
    assert alone.returncode == 3 and "Traceback" not in alone.stderr
    assert "violation=REPORT_INVALID node-1.json/$" in alone.stdout.splitlines()
    assert "violation=REPORT_UNREADABLE absent.json/$" in alone.stdout.splitlines()
    assert run("merge").returncode == 2
    assert run("merge", "").returncode == 2


def test_merge_reads_untrusted_values_as_untrusted(tmp_path: Path) -> None:
    member = rank_bundle(tmp_path / "incident" / "rank-00000", rank=0, world_size=1, hold="loss")
    document = json.loads(run("check", "--format", "json", str(member)).stdout)
    document["run"]["run_id"] = "run; rm -rf /"
    (tmp_path / "bad.json").write_text(json.dumps(document))
    merged = merge_reports([tmp_path / "bad.json"])
    assert merged.decision == "REJECTED"
    assert kv(merged) == rejected("SET_RANKS_MISSING .", "REPORT_INVALID rank-00000/$")


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        ("continue", "the decision does not agree with the report's stage counts"),
        ("later", "the decision does not agree with the report's stage counts"),
        ("counts", "the decision does not agree with the report's stage counts"),
        ("no-stages", "stages is not the five stages in order"),
        ("bad-count", "nan is not an integer from 0 to 9007199254740991"),
    ],
)
def test_merge_does_not_take_a_decision_its_own_counts_contradict(
    tmp_path: Path, edit: str, why: str
) -> None:
    """A node's report whose decision was edited, or its counts, is not believed: the
    decision is the stage counts' (spec section 8), as check would work it out."""
    member = rank_bundle(tmp_path / "incident" / "rank-00000", rank=0, world_size=1, hold="loss")
    document = json.loads(run("check", "--format", "json", str(member)).stdout)
    (tmp_path / "good.json").write_text(json.dumps(document))
    assert merge_reports([tmp_path / "good.json"]).decision == "HOLD"
    loss = next(item for item in document["stages"] if item["stage"] == "loss")
    if edit == "continue":  # every field of the decision changed, not the counts
        document.update(
            decision="CONTINUE_BOUNDED_DIAGNOSTICS",
            earliest_nonfinite_stage=None,
            first_nonfinite_tensor=None,
            action="no-nonfinite-evidenced-check-other-signals",
            exit_code=0,
        )
    elif edit == "later":
        document["earliest_nonfinite_stage"] = "backward"
    elif edit == "counts":  # the counts made all finite, the HOLD left
        loss["counts"].update(finite=loss["counts"]["elements"], nan=0, posinf=0, neginf=0)
    elif edit == "no-stages":
        del document["stages"]
    else:
        loss["counts"]["nan"] = -1
    (tmp_path / "edited.json").write_text(json.dumps(document))
    merged = merge_reports([tmp_path / "edited.json"])
    assert merged.decision == "REJECTED"
    assert kv(merged) == rejected("SET_RANKS_MISSING .", "REPORT_INVALID rank-00000/$")
    assert [v.message for v in merged.members[0].violations] == [why]


def test_a_set_nested_in_a_set_is_not_judged_and_is_named(tmp_path: Path) -> None:
    """Spec section 11 ignores a subdirectory without manifest.json, even one holding
    bundles (a HOLD among them): the answer is the members', and says which
    subdirectories it does not cover, so nobody takes it for theirs."""
    root = make_set(tmp_path / "set", 2)
    rank_bundle(root / "retry" / "rank-00000", rank=0, world_size=2, hold="input")
    (root / "notes").mkdir()  # no bundle below: not named
    result = check_incident_set(root)
    assert result.decision == "CONTINUE_BOUNDED_DIAGNOSTICS" and result.nested_sets == ("retry",)
    assert set_document(result)["nested_sets"] == ["retry"]
    text = run("check", str(root))
    assert text.returncode == 0
    assert "Not judged: retry holds bundles one level down" in text.stdout
    assert check_incident_set(make_set(tmp_path / "plain", 2)).nested_sets == ()
    assert set_document(merge_reports(_member_reports(root, tmp_path / "r")))["nested_sets"] == []


def test_a_nested_set_is_found_among_many_members(tmp_path: Path) -> None:
    """Members are not looked into for bundles below: a nested set sorting after
    a hundred members is still named."""
    root = make_set(tmp_path / "set", 100)
    rank_bundle(root / "zz-retry" / "rank-00000", rank=0, world_size=100)
    assert check_incident_set(root, workers=2).nested_sets == ("zz-retry",)


def test_a_rejected_bundle_report_says_what_it_declares(tmp_path: Path) -> None:
    member = rank_bundle(tmp_path / "m", rank=3, world_size=4)
    reject_data(member)
    document = json.loads(run("check", "--format", "json", str(member)).stdout)
    assert document["declared"] == {
        "contract_version": "training-incident-v1",
        "run_id": "run-ranks",
        "step": 10,
        "world_size": 4,
        "rank": 3,
    }
    break_json(member)
    document = json.loads(run("check", "--format", "json", str(member)).stdout)
    assert set(document["declared"].values()) == {None}


# ---------------------------------------------------- members in parallel


def test_the_answer_does_not_depend_on_the_workers(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 5, holds={3: "forward", 4: "forward"})
    reject_data(root / "rank-00001")
    answers = {w: set_document(check_incident_set(root, workers=w)) for w in (1, 2, 3, 8)}
    for document in answers.values():
        for member in document["members"]:
            member["report"].pop("bundle")
    assert all(document == answers[1] for document in answers.values())


def test_members_share_one_budget_of_workers_and_one_manifest_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never more tensor scans at once than one bundle's workers; never two members
    parsing their manifests at once: the memory bound of one bundle."""
    root = make_set(tmp_path / "set", 6, holds={5: "loss"})
    lock = threading.Lock()
    now = {"scan": 0, "parse": 0}
    peak = {"scan": 0, "parse": 0}

    def counted(kind: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock:
                now[kind] += 1
                peak[kind] = max(peak[kind], now[kind])
            try:
                time.sleep(0.01)  # long enough for overlaps to show
                return real(*args, **kwargs)
            finally:
                with lock:
                    now[kind] -= 1

        return wrapper

    verify = nanrunbook.tensors.verify
    monkeypatch.setattr(verify, "scan_range", counted("scan", verify.scan_range))
    monkeypatch.setattr(
        nanrunbook.check, "parse_manifest", counted("parse", nanrunbook.check.parse_manifest)
    )
    result = check_incident_set(root, workers=3)
    assert result.decision == "HOLD" and result.origin_ranks == (5,)
    assert peak["parse"] == 1
    assert 2 <= peak["scan"] <= 3  # members overlap, within the budget


def test_progress_covers_every_member(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 3)

    class Bar:
        def __init__(self) -> None:
            self.total = 0
            self.done = 0

        def extend(self, total: int) -> None:
            self.total += total

        def __call__(self, nbytes: int) -> None:
            self.done += nbytes

    bar = Bar()
    check_incident_set(root, progress=bar, workers=2)
    data = sum(
        entry["data_offsets"][1] - entry["data_offsets"][0]
        for member in root.iterdir()
        for entry in _header(member / "tensors.safetensors").values()
    )
    assert bar.total == bar.done == data > 0


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header: dict[str, Any] = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    return header


def test_an_interrupt_stops_every_member(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 4)
    before = threading.active_count()

    def interrupted(nbytes: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check_incident_set(root, progress=interrupted, workers=2)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before


def test_text_of_a_set_never_interprets_markup(tmp_path: Path) -> None:
    root = tmp_path / "set"
    rank_bundle(root / "[bold]rank", rank=0, world_size=1, hold="input")
    out = io.StringIO()
    TextRenderer().incident_set(check_incident_set(root), out)
    assert "'[bold]rank'" in out.getvalue()


def test_a_huge_world_size_stays_bounded(tmp_path: Path) -> None:
    """world_size is any integer >= 1: the answer lists runs, never 2^53 ranks."""
    world = 2**53 - 1
    root = make_set(tmp_path / "set", world, ranks=[0], holds={0: "input"})
    started = time.monotonic()
    result = check_incident_set(root)
    assert kv(result) == hold(
        "input",
        "0",
        "ONE_RANK",
        world_size=world,
        ranks_present=1,
        missing_ranks=f"1-{world - 1}",
    )
    assert result.missing == (range(1, world),) and result.missing_count == world - 1
    document = set_document(result)
    assert document["missing_ranks"] is None
    assert document["missing_rank_runs"] == [[1, world - 1]]
    out = io.StringIO()
    TextRenderer().incident_set(result, out)
    assert f"missing: 1-{world - 1}" in " ".join(out.getvalue().split())
    assert time.monotonic() - started < 10


def test_which_directories_are_sets(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 2)
    assert nanrunbook.is_incident_set(root)
    assert not nanrunbook.is_incident_set(root / "rank-00000")  # a bundle
    assert not nanrunbook.is_incident_set(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert not nanrunbook.is_incident_set(tmp_path / "empty")
    (root / "manifest.json").write_text("{}")  # a manifest makes it a (broken) bundle
    assert not nanrunbook.is_incident_set(root)


def test_most_severe() -> None:
    from nanrunbook.exits import most_severe

    assert most_severe([0, 1, 3, 0]) == 3
    assert most_severe([0, 1, 0]) == 1
    assert most_severe([5, 1, 0]) == 1 and most_severe([0, 5]) == 5
    assert most_severe([0, 0]) == 0
    assert most_severe([]) == 0


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("missing-rank-without-hold", "SET_RANKS_MISSING"),
        ("run-mismatch-rejects-a-hold", "SET_RUN_MISMATCH"),
        ("step-mismatch", "SET_STEP_MISMATCH"),
        ("world-size-mismatch", "SET_WORLD_SIZE_MISMATCH"),
        ("duplicate-rank", "SET_RANK_DUPLICATE"),
        ("contract-mismatch", "SET_CONTRACT_MISMATCH"),
    ],
)
def test_each_set_code_says_why_in_one_line(name: str, code: str, tmp_path: Path) -> None:
    root, _ = build(name, tmp_path)
    result = check_incident_set(root)
    first = result.violations[0]
    assert first.code == code and result.decision == "REJECTED"
    assert first.message and "\n" not in first.message


def test_the_empty_set_code() -> None:
    from nanrunbook.verdict.incident_set import judge_set

    result = judge_set([], contract_content_id=CID, path="incident")
    assert [v.code for v in result.violations] == ["SET_EMPTY"]
    assert result.exit_code == 3


def test_merge_refuses_reports_judged_under_another_contract(tmp_path: Path) -> None:
    from nanrunbook import Caps

    root = make_set(tmp_path / "set", 2, holds={0: "input"})
    reports = []
    for index, caps in enumerate((None, Caps(max_stage_tensors=4000))):
        out = io.StringIO()
        JsonRenderer().judgement(judge_bundle(root / f"rank-0000{index}", caps=caps), out)
        reports.append(tmp_path / f"node-{index}.json")
        reports[-1].write_text(out.getvalue())
    merged = merge_reports(reports)
    assert [(v.code, v.where) for v in merged.violations] == [
        ("SET_CONTRACT_MISMATCH", "rank-00001")
    ]
    assert "SET_CONTRACT_MISMATCH" in kv(merged)[-1]


def test_each_rank_shows_its_warnings(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 2, ranks=[1], holds={1: "loss"})
    rank_bundle(root / "rank-00000", rank=0, world_size=2, saturate=True, hold="backward")
    result = check_incident_set(root)
    member = result.members[0]
    assert member.warnings and set(member.warnings) <= {"AT_DTYPE_MAX", "NEAR_DTYPE_MAX"}
    out = io.StringIO()
    TextRenderer().incident_set(result, out)
    row = next(line for line in out.getvalue().splitlines() if line.startswith("  0 "))
    assert row.split()[:5] == ["0", "rank-00000", "HOLD", "backward", "AT_DTYPE_MAX"]
    reports = _member_reports(root, tmp_path / "reports")
    merged = merge_reports(reports)
    assert [m.warnings for m in merged.members] == [m.warnings for m in result.members]


def test_hostile_member_names_stay_inert_in_every_format(tmp_path: Path) -> None:
    root = tmp_path / "set"
    rank_bundle(root / "evil\n\x1b[31mred\u202e", rank=0, world_size=2, hold="input")
    rank_bundle(root / "rank-00001", rank=1, world_size=2)
    reject_data(root / "rank-00001")
    shutil.copytree(root / "rank-00001", root / "x\x07\n=y")  # a duplicate: the set is rejected
    for fmt in ("text", "json", "kv"):
        done = run("check", "--format", fmt, str(root))
        assert done.returncode == 3, done.stderr
        assert "\x1b" not in done.stdout and "\x07" not in done.stdout
        assert "\u202e" not in done.stdout
        if fmt == "kv":
            for line in done.stdout.splitlines():
                key, _, value = line.partition("=")
                assert key and all(c.isalnum() or c in "._/+=@:,[]$- ?" for c in value), line
            # The quoted name sorts first: rank-00001 is the duplicate; the copy's own
            # violations show as [?].
            lines = done.stdout.splitlines()
            assert "violation=SET_RANK_DUPLICATE rank-00001" in lines
            assert "violation=DIGEST_MISMATCH [?]/$.stages[4].tensors[1].sha256" in lines


def test_brief_and_fail_on_warnings_for_sets(tmp_path: Path) -> None:
    root = make_set(tmp_path / "set", 2, ranks=[1])
    rank_bundle(root / "rank-00000", rank=0, world_size=2, saturate=True)
    assert run("check", "--format", "kv", str(root)).returncode == 0
    done = run("check", "--fail-on-warnings", "--format", "kv", str(root))
    assert done.returncode == 5 and "decision=CONTINUE_BOUNDED_DIAGNOSTICS" in done.stdout
    # What made it 5, after the spec's lines: the count, then each code and member.
    lines = done.stdout.splitlines()
    warned = [line for line in lines if line.startswith("warning=")]
    assert warned and all(line.endswith(" rank-00000") for line in warned)
    assert lines[lines.index("root_cause_claim=NONE_SYMPTOM_LOCATION_IS_NOT_CAUSALITY") + 1 :] == [
        f"warnings={len(warned)}",
        *warned,
    ]
    brief = run("check", "--brief", str(root))
    assert brief.returncode == 0 and len(brief.stdout.splitlines()) <= 6
    held = make_set(tmp_path / "held", 2, holds={0: "input"})
    paths = [str(root), str(held)]
    assert run("check", "--fail-on-warnings", *paths).returncode == 1  # 1 before 5
    twice = run("check", "--fail-on-warnings", str(root), str(root))
    assert twice.returncode == 5
    assert twice.stdout.splitlines()[-1].endswith("; exit 5, the most severe")
    assert run("check", "--fail-on-warnings", str(root), str(tmp_path / "no")).returncode == 3
    rejected_brief = run("check", "--brief", str(make_set(tmp_path / "part", 3, ranks=[0])))
    assert rejected_brief.returncode == 3
    assert rejected_brief.stdout.splitlines()[1].split() == ["SET_RANKS_MISSING", "."]


# ------------------------------------------- one rank's bundle checked alone


def rendered(renderer: Any, outcome: Any) -> str:
    out = io.StringIO()
    renderer.judgement(outcome, out)
    return out.getvalue()


def test_one_ranks_bundle_checked_alone_names_its_set_in_every_format(tmp_path: Path) -> None:
    """Rank 0 of a set whose rank 1 held: CONTINUE on its own evidence, exit 0,
    and every format says it is one member and which set to check instead;
    SET_MEMBER_ALONE makes --fail-on-warnings exit 5 (found in independent testing:
    it said CONTINUE with no word of the set)."""
    from nanrunbook.check_set import check_path

    root = make_set(tmp_path / "incident", 2, holds={1: "backward"})
    member = root / "rank-00000"
    judgement = check_path(member)
    assert judgement.report is not None and judgement.report.alone is not None
    alone = judgement.report.alone
    assert (alone.rank, alone.world_size, alone.set_path) == (0, 2, str(root))
    assert judgement.report.warnings == ()  # the tensors' warnings are unchanged
    assert judgement.exit_code_for() == 0 and judgement.exit_code_for(fail_on_warnings=True) == 5

    text = rendered(TextRenderer(width=80), judgement)
    assert max(map(len, text.splitlines())) <= 80
    flat = " ".join(text.split())
    assert "incident set rank 0 of 2: one member of a set, checked alone (SET_MEMBER_ALONE)" in flat
    assert "check the set instead: nanrunbook check" in flat
    assert f"instead:nanrunbookcheck{root}" in "".join(text.split())  # a long path folds
    assert "Warnings: SET_MEMBER_ALONE" in text
    brief = rendered(TextRenderer(brief=True), judgement)
    assert "1 (SET_MEMBER_ALONE)" in brief

    lines = rendered(KvRenderer(), judgement).splitlines()
    assert lines[-5:] == [
        "warnings=0",
        "set_member_warning=SET_MEMBER_ALONE",
        "set_rank=0",
        "set_world_size=2",
        f"set_path={root}",
    ]
    document = json.loads(rendered(JsonRenderer(), judgement))
    assert document["decision"] == "CONTINUE_BOUNDED_DIAGNOSTICS"
    assert document["set_member"] == {
        "rank": 0,
        "world_size": 2,
        "set_path": str(root),
        "warning": "SET_MEMBER_ALONE",
    }

    # The rank that held still holds: 5 never hides a HOLD.
    held = run("check", "--fail-on-warnings", "-f", "kv", str(root / "rank-00001"))
    assert held.returncode == 1 and "set_rank=1" in held.stdout.splitlines()
    done = run("check", "--fail-on-warnings", "-f", "kv", f"{member}/")
    assert done.returncode == 5 and f"set_path={root}" in done.stdout.splitlines()
    relative = run("check", "-f", "kv", "rank-00000", cwd=root)
    assert relative.returncode == 0 and "set_path=." in relative.stdout.splitlines()


def test_a_member_checked_in_its_set_or_merged_is_not_alone(tmp_path: Path) -> None:
    root = make_set(tmp_path / "incident", 2)
    as_set = run("check", "--fail-on-warnings", "-f", "json", str(root))
    assert as_set.returncode == 0
    document = json.loads(as_set.stdout)
    assert [m["report"]["set_member"] for m in document["members"]] == [None, None]
    assert "SET_MEMBER_ALONE" not in run("check", "-f", "kv", str(root)).stdout
    reports = []
    for member in sorted(root.iterdir()):
        reports.append(tmp_path / f"{member.name}.json")
        reports[-1].write_text(run("check", "-f", "json", str(member)).stdout)
    merged = run("merge", "-f", "kv", *map(str, reports))  # merged into its set: not alone
    assert merged.returncode == 0 and "warnings=0" in merged.stdout.splitlines()
    assert merge_reports(reports).exit_code_for(fail_on_warnings=True) == 0


def test_a_single_rank_bundle_is_not_a_member_alone(tmp_path: Path) -> None:
    from nanrunbook.check_set import check_path

    bundle = rank_bundle(tmp_path / "run" / "13", rank=0, world_size=1)
    judgement = check_path(bundle)
    assert judgement.report is not None and judgement.report.alone is None
    assert judgement.exit_code_for(fail_on_warnings=True) == 0
    assert "set_" not in rendered(KvRenderer(), judgement)
    assert json.loads(rendered(JsonRenderer(), judgement))["set_member"] is None


# --------------------------------------------------------- run directories


def test_a_run_directory_says_so_and_names_each_incident_by_step(tmp_path: Path) -> None:
    """The sentinel writes a single-rank run's incidents as incident/<run>/<step>/:
    checked, incident/<run>/ is a set (spec section 11) and its verdict stands,
    but the answer says it looks like a run directory and names each incident,
    by step (found in independent testing: 'HOLD - incident set ... member 13',
    then REJECTED once a second step held)."""
    run_dir = tmp_path / "incident" / "run-a"
    rank_bundle(run_dir / "13", rank=0, world_size=1, run_id="run-a", step=13, hold="loss")
    one = run("check", "-f", "kv", str(run_dir))
    assert one.returncode == 1  # the set's HOLD stands
    assert one.stdout.splitlines()[-1] == "run_directory_steps=13"

    rank_bundle(run_dir / "9", rank=0, world_size=1, run_id="run-a", step=9)
    env_80 = {**os.environ, "COLUMNS": "80"}
    text = subprocess.run(
        [*CLI, "check", "incident/run-a"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_80,
        cwd=tmp_path,
    )
    assert text.returncode == 3  # SET_STEP_MISMATCH: the spec's verdict stands
    lines = text.stdout.splitlines()
    # The note follows the headline (which wraps at 80 columns) in three lines.
    start = next(i for i, line in enumerate(lines) if "This looks like a run" in line)
    note = " ".join(" ".join(lines[start : start + 3]).split())
    assert note.startswith(
        "This looks like a run directory: its members are incidents at different"
        " steps of run run-a, each a whole answer on its own."
    )
    listed = [line.split() for line in lines if line.startswith("    step ")]
    assert listed == [
        ["step", "9", "CONTINUE_BOUNDED_DIAGNOSTICS", "nanrunbook", "check", "'incident/run-a/9'"],
        ["step", "13", "HOLD", "nanrunbook", "check", "'incident/run-a/13'"],
    ]  # by step, not by name
    new_lines = [
        *lines[start : start + 3],
        *(line for line in lines if line.startswith("    step ")),
    ]
    assert max(map(len, new_lines)) <= 80
    kv_lines = run("check", "-f", "kv", str(run_dir)).stdout.splitlines()
    assert "violation=SET_STEP_MISMATCH 9" in kv_lines
    assert kv_lines[-1] == "run_directory_steps=9,13"
    document = json.loads(run("check", "-f", "json", str(run_dir)).stdout)
    assert document["decision"] == "REJECTED"
    assert document["run_directory"] == {
        "run_id": "run-a",
        "incidents": [
            {"step": 9, "member": "9", "decision": "CONTINUE_BOUNDED_DIAGNOSTICS",
             "bundle": str(run_dir / "9")},
            {"step": 13, "member": "13", "decision": "HOLD", "bundle": str(run_dir / "13")},
        ],
    }  # fmt: skip


def test_one_steps_ranks_and_unrelated_runs_are_not_a_run_directory(tmp_path: Path) -> None:
    root = make_set(tmp_path / "incident", 2, holds={1: "backward"})
    assert check_incident_set(root).run_incidents == ()
    assert "run_directory" not in run("check", "-f", "kv", str(root)).stdout
    assert json.loads(run("check", "-f", "json", str(root)).stdout)["run_directory"] is None
    mixed = tmp_path / "bundles"
    rank_bundle(mixed / "a", rank=0, world_size=1, run_id="run-a")
    rank_bundle(mixed / "b", rank=0, world_size=1, run_id="run-b", step=12)
    assert check_incident_set(mixed).run_incidents == ()

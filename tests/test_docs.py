"""The man pages, --help, completion, README, docs/ and CHANGELOG stay true to the code."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rfc8785
import typer
from typer._completion_shared import get_completion_script
from typer.testing import CliRunner

import nanrunbook
import nanrunbook.capture
import nanrunbook.telemetry
from nanrunbook import EvidenceRejected, check_bundle, report_document
from nanrunbook._version import __version__
from nanrunbook.cli import app
from nanrunbook.codes import CODES
from nanrunbook.contract import contract_content_id, contract_document
from nanrunbook.exits import Exit
from nanrunbook.manifest.content_id import evidence_content_id
from nanrunbook.verdict.report import rejection_document

ROOT = Path(__file__).resolve().parent.parent
MAN1 = ROOT / "man" / "nanrunbook.1"
MAN5 = ROOT / "man" / "nanrunbook-bundle.5"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CHANGELOG = ROOT / "CHANGELOG.md"
COMPLETIONS = {"bash": "nanrunbook.bash", "zsh": "_nanrunbook", "fish": "nanrunbook.fish"}
GROFF = shutil.which("groff")

runner = CliRunner()


# ------------------------------------------------------------------ roff helpers


def unescape(text: str) -> str:
    """Roff source to the characters a reader sees (enough for this project's pages)."""
    for escape, char in (
        ("\\-", "-"),
        ("\\e", "\\"),
        ("\\(dq", '"'),
        ("\\(aq", "'"),
        ("\\(em", "—"),
        ("\\(en", "–"),
        ("\\&", ""),
    ):
        text = text.replace(escape, char)
    return re.sub(r"\\f[BIRP]", "", text)


def sections(page: Path) -> dict[str, str]:
    """Roff source split at ``.SH`` headings, keyed by heading."""
    found: dict[str, str] = {}
    name = None
    for line in page.read_text().splitlines():
        if line.startswith(".SH "):
            name = line[4:].strip().strip('"')
            found[name] = ""
        elif name is not None:
            found[name] += line + "\n"
    return found


def subsections(page: Path, section: str) -> dict[str, str]:
    """The ``.SS`` subsections of one ``.SH`` section."""
    body = sections(page)[section]
    found: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        if line.startswith(".SS "):
            name = line[4:].strip().strip('"')
            found[name] = ""
        elif name is not None:
            found[name] += line + "\n"
    return found


def tags(roff: str) -> list[str]:
    """The tag lines of ``.TP``/``.TQ`` paragraphs, unescaped, macro names dropped."""
    lines = roff.splitlines()
    found = []
    for index, line in enumerate(lines[:-1]):
        if line in (".TP", ".TQ"):
            tag = re.sub(r"^\.[A-Z]+\s*", "", lines[index + 1])
            found.append(unescape(tag).replace('"', ""))
    return found


def options_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[A-Za-z])(?![\w-])", text))


def example_blocks(page: Path) -> list[list[str]]:
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in page.read_text().splitlines():
        if line == ".EX":
            current = []
        elif line == ".EE" and current is not None:
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(unescape(line))
    return blocks


# --------------------------------------------------------------------- the CLI


def cli_commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    commands: dict[str, Any] = group.commands  # type: ignore[attr-defined]
    return commands


def help_text(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], prog_name="nanrunbook", env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    return result.stdout


def help_options(*args: str) -> set[str]:
    """Every option the Options section of ``--help`` lists."""
    text = help_text(*args)
    listed = text.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0]
    found: set[str] = set()
    for line in listed.splitlines():
        match = re.match(r"^  ((?:--?[A-Za-z][a-z0-9-]*)(?:, --?[A-Za-z][a-z0-9-]*)*)", line)
        if match:
            found |= set(match.group(1).split(", "))
    return found


# ------------------------------------------------------------------- man pages


@pytest.mark.skipif(GROFF is None, reason="groff is not installed")
@pytest.mark.parametrize("page", [MAN1, MAN5], ids=lambda p: p.name)
def test_groff_reports_no_warning(page: Path) -> None:
    assert GROFF is not None
    result = subprocess.run(
        [GROFF, "-man", "-ww", "-z", str(page)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    assert result.stderr == ""


@pytest.mark.skipif(GROFF is None, reason="groff is not installed")
@pytest.mark.parametrize("page", [MAN1, MAN5], ids=lambda p: p.name)
def test_rendered_pages_copy_intact(page: Path) -> None:
    """Every hyphen is an ASCII hyphen-minus and nothing is hyphenated, so options,
    codes, ids and commands copied from the rendered page work."""
    assert GROFF is not None
    text = subprocess.run(
        [GROFF, "-man", "-Tutf8", "-P-cbou", str(page)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    ).stdout
    assert "‐" not in text  # U+2010, what an unescaped '-' becomes
    assert "nanrunbook" in text


@pytest.mark.parametrize("page", [MAN1, MAN5], ids=lambda p: p.name)
def test_pages_carry_the_version(page: Path) -> None:
    th = next(line for line in page.read_text().splitlines() if line.startswith(".TH "))
    assert f'"nanrunbook {__version__}"' in th


def test_every_command_has_a_man_section_and_the_reverse() -> None:
    documented = {name.split()[1] for name in subsections(MAN1, "COMMANDS")}
    assert documented == set(cli_commands())
    synopsis = unescape(sections(MAN1)["SYNOPSIS"])
    for command in cli_commands():
        assert f".B nanrunbook {command}\n" in synopsis, command


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_command_options_match_the_man_page(command: str) -> None:
    section = next(
        body for name, body in subsections(MAN1, "COMMANDS").items() if name.split()[1] == command
    )
    documented = set().union(*(options_in(tag) for tag in tags(section)))
    assert documented == help_options(command)


def test_global_options_match_the_man_page() -> None:
    documented = set().union(*(options_in(tag) for tag in tags(sections(MAN1)["GLOBAL OPTIONS"])))
    assert documented == help_options()
    assert {"--install-completion", "--show-completion", "--version"} <= documented


def test_every_violation_code_is_in_section_5_and_the_reverse() -> None:
    listed = tags(sections(MAN5)["VIOLATION CODES"])
    assert len(listed) == len(set(listed)), "a code is listed twice"
    assert set(listed) == set(CODES)


def test_exit_codes_are_documented() -> None:
    assert set(tags(sections(MAN1)["EXIT STATUS"])) == {"0", "1", "2", "3", "4", "5", "130"}
    assert {str(int(code)) for code in Exit} == set(tags(sections(MAN1)["EXIT STATUS"]))


def test_environment_documents_what_is_read() -> None:
    documented = set(tags(sections(MAN1)["ENVIRONMENT"]))
    assert {"NO_COLOR", "COLUMNS", "FORCE_COLOR", "TERM", "_NANRUNBOOK_COMPLETE"} <= documented


# --------------------------------------------------------------- --help itself


@pytest.mark.parametrize("command", ["", *sorted(cli_commands())])
def test_help_has_a_one_line_purpose_and_an_example(command: str) -> None:
    args = [command] if command else []
    text = help_text(*args)
    group = typer.main.get_command(app)
    target = cli_commands()[command] if command else group
    assert target.help, command
    purpose = target.help.strip().split("\n\n")[0]
    assert "\n" not in purpose and purpose.endswith("."), purpose
    assert len(purpose) <= 100, purpose
    assert re.search(r"^\s+Example: nanrunbook \S", text, re.MULTILINE), text


def _run_example(line: str) -> int:
    words = shlex.split(line)
    assert words[0] == "nanrunbook"
    for stop in (">", "|"):
        if stop in words:
            words = words[: words.index(stop)]
    if "--follow" in words and "--wait-for-file" not in words:
        # The example's file does not exist here: a follower would wait for it
        # (300 s by default). The documented line still parses and runs.
        words += ["--wait-for-file", "1"]
    result = runner.invoke(app, words[1:], prog_name="nanrunbook")
    return result.exit_code


def _help_examples() -> list[str]:
    found = []
    for command in ["", *sorted(cli_commands())]:
        text = help_text(*([command] if command else []))
        found += re.findall(r"^\s+Example: (nanrunbook .*)$", text, re.MULTILINE)
    return found


def _man_examples() -> list[str]:
    lines = [line for block in example_blocks(MAN1) for line in block]
    return [
        line
        for line in lines
        if line.startswith("nanrunbook ") and "completion" not in line  # never touch ~/.bashrc
    ]


@pytest.mark.parametrize("line", sorted(set(_help_examples() + _man_examples())))
def test_examples_are_valid_invocations(
    line: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every example of --help and of nanrunbook(1) parses (no usage error) and runs
    without an internal error, in a copy of the source tree's fixtures (seal writes)."""
    shutil.copytree(ROOT / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)
    assert _run_example(line) not in (2, 4), line


def test_version_option() -> None:
    result = runner.invoke(app, ["--version"], prog_name="nanrunbook")
    assert result.exit_code == 0
    assert result.stdout == f"nanrunbook {__version__}\n"


# ------------------------------------------------------------- the JSON report


def _documented_keys(name: str) -> set[str]:
    found: set[str] = set()
    for tag in tags(subsections(MAN1, "JSON REPORT")[name]):
        found |= set(tag.split())
    return found


@pytest.fixture(scope="module")
def hold_report() -> dict[str, Any]:
    return report_document(check_bundle(ROOT / "fixtures" / "hold-backward-dynamic-skip"))


def test_documented_report_keys_are_the_report_keys(hold_report: dict[str, Any]) -> None:
    assert _documented_keys("Accepted bundle (exit 0 or 1)") == set(hold_report)
    assert hold_report["report_format"] == "nanrunbook-report/1"


def test_documented_stage_and_tensor_keys(hold_report: dict[str, Any]) -> None:
    for stage in hold_report["stages"]:
        assert _documented_keys("Stage objects") == set(stage)
        for tensor in stage["tensors"]:
            assert _documented_keys("Tensor objects") == set(tensor)
    assert any(stage["tensors"] for stage in hold_report["stages"])


def test_documented_rejection_keys() -> None:
    with pytest.raises(EvidenceRejected) as caught:
        check_bundle(ROOT / "fixtures" / "rejected-caps")
    document = rejection_document(caught.value, "b", contract_content_id())
    assert _documented_keys("Rejected bundle (exit 3)") == set(document)
    for violation in document["violations"]:
        assert set(violation) == {"code", "where", "message"}


# ------------------------------------------------------ the worked content ids


def _worked_example() -> str:
    return unescape(subsections(MAN5, "CONTENT IDS")["Worked example"])


def _blocks_after(text: str, marker: str) -> list[str]:
    """Lines of the first .EX block after ``marker``."""
    tail = text.split(marker, 1)[1]
    block = tail.split(".EX\n", 1)[1].split(".EE\n", 1)[0]
    return block.splitlines()


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, pattern
    return int(match.group(1))


def test_worked_evidence_content_id_is_reproducible() -> None:
    text = _worked_example()
    path = ROOT / "fixtures" / "continue-all-finite" / "manifest.json"
    manifest = json.loads(path.read_bytes())
    body = {k: v for k, v in manifest.items() if k != "evidence_content_id"}
    canonical = rfc8785.dumps(body)

    assert _number(r"canonicalizes to (\d+) bytes\.", text) == len(canonical)
    shown = _number(r"Canonical form, first (\d+) bytes:", text)
    prefix = "".join(_blocks_after(text, "Canonical form, first"))
    assert len(prefix) == shown
    assert canonical.startswith(prefix.encode())

    digest = hashlib.sha256(canonical).hexdigest()
    assert _number(r"SHA-256 of all (\d+) bytes", text) == len(canonical)
    assert _blocks_after(text, "SHA-256 of all") == [digest]
    declared = _blocks_after(text, "so the manifest declares")
    assert declared == [f"training-incident-evidence@sha256:{digest}"]
    assert declared[0] == manifest["evidence_content_id"] == evidence_content_id(manifest)

    # The number forms the page points at: as written in the file, and canonical.
    written = re.search(r"the file's\n\.B (.+)\nis canonical\n\.B (.+)\n", text)
    assert written, text
    assert written.group(1) in path.read_text()
    assert written.group(2).encode() + b"," in canonical
    detail = re.search(r"optimizer detail is\n\.BR (\S+) \.", text)
    assert detail and detail.group(1).encode() in canonical


def test_worked_contract_content_id_is_reproducible() -> None:
    text = _worked_example()
    canonical = rfc8785.dumps(contract_document())
    assert _number(r"canonicalizes to (\d+) bytes, beginning", text) == len(canonical)
    prefix = "".join(_blocks_after(text, "bytes, beginning"))
    assert canonical.startswith(prefix.encode()) and len(prefix) >= 64
    assert _blocks_after(text, "and its id is") == [contract_content_id()]
    assert contract_content_id().endswith(hashlib.sha256(canonical).hexdigest())


# ------------------------------------------------------------------ completion


def _completion_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_NANRUNBOOK", "_TYPER"))}
    env.update(extra)
    return env


def _nanrunbook(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", "from nanrunbook.cli import entry_point; entry_point()"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout


@pytest.mark.parametrize("shell", sorted(COMPLETIONS))
def test_completion_scripts_are_current(shell: str) -> None:
    """completions/ holds exactly what the command prints for each shell, which is
    also what --show-completion prints there."""
    printed = _nanrunbook(_completion_env(_NANRUNBOOK_COMPLETE=f"source_{shell}"))
    committed = (ROOT / "completions" / COMPLETIONS[shell]).read_text()
    assert committed == printed.strip() + "\n"
    shown = get_completion_script(
        prog_name="nanrunbook", complete_var="_NANRUNBOOK_COMPLETE", shell=shell
    )
    assert committed == shown + "\n"
    assert "nanrunbook" in committed and "_NANRUNBOOK_COMPLETE=complete_" in committed


def test_zsh_script_starts_with_compdef() -> None:
    # compinit only autoloads a function file whose first line is #compdef.
    assert (ROOT / "completions" / "_nanrunbook").read_text().startswith("#compdef nanrunbook\n")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_script_registers_the_completion() -> None:
    script = ROOT / "completions" / "nanrunbook.bash"
    result = subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(script))} && complete -p nanrunbook"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "-F _nanrunbook_completion nanrunbook" in result.stdout


@pytest.mark.parametrize(
    ("words", "cword", "expected"),
    [
        ("nanrunbook ch", "1", {"check", "checklist"}),
        ("nanrunbook s", "1", {"schema", "seal"}),
        ("nanrunbook check --f", "2", {"--format", "--fail-on-warnings"}),
        ("nanrunbook check --format ", "3", {"text", "json", "kv"}),
        ("nanrunbook di", "1", {"diff"}),
        ("nanrunbook diff --req", "2", {"--require-fixed"}),
        (
            "nanrunbook checklist --stage ",
            "3",
            {"input", "forward", "loss", "backward", "optimizer"},
        ),
    ],
)
def test_bash_completion_answers(words: str, cword: str, expected: set[str]) -> None:
    out = _nanrunbook(
        _completion_env(_NANRUNBOOK_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=cword)
    )
    assert set(out.split()) == expected


def test_zsh_and_fish_completion_answer() -> None:
    zsh = _nanrunbook(
        _completion_env(_NANRUNBOOK_COMPLETE="complete_zsh", _TYPER_COMPLETE_ARGS="nanrunbook chec")
    )
    assert "check" in zsh and "checklist" in zsh
    fish = _nanrunbook(
        _completion_env(
            _NANRUNBOOK_COMPLETE="complete_fish",
            _TYPER_COMPLETE_FISH_ACTION="get-args",
            _TYPER_COMPLETE_ARGS="nanrunbook con",
        )
    )
    assert fish.split("\t")[0] == "contract"


# ------------------------------------------------------------- make install


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_install_puts_pages_where_man_finds_them(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    if not (venv / "bin" / "nanrunbook").exists():
        pytest.skip("the nanrunbook script is not installed in this environment")
    prefix = tmp_path / "prefix"
    fish = tmp_path / "fish"
    settings = [f"VENV={venv}", f"PREFIX={prefix}", f"FISHCOMPDIR={fish}"]
    subprocess.run(
        ["make", "-s", "-o", f"{venv}/.installed", "install", *settings],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    installed = [
        prefix / "share/man/man1/nanrunbook.1",
        prefix / "share/man/man5/nanrunbook-bundle.5",
        prefix / "share/bash-completion/completions/nanrunbook",
        prefix / "share/zsh/site-functions/_nanrunbook",
        fish / "nanrunbook.fish",
    ]
    for path in installed:
        assert path.is_file(), path
    command = prefix / "bin" / "nanrunbook"
    version = subprocess.run([command, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout == f"nanrunbook {__version__}\n"

    if shutil.which("man"):
        env = {**os.environ, "PATH": f"{prefix / 'bin'}:{os.environ['PATH']}"}
        env.pop("MANPATH", None)
        for args, page in (
            (["nanrunbook"], installed[0]),
            (["5", "nanrunbook-bundle"], installed[1]),
        ):
            found = subprocess.run(
                ["man", "-w", *args], env=env, capture_output=True, text=True, check=True
            )
            assert Path(found.stdout.strip()) == page

    subprocess.run(
        ["make", "-s", "uninstall", *settings], cwd=ROOT, check=True, capture_output=True
    )
    assert not command.exists() and not command.is_symlink()
    assert not any(path.exists() for path in installed)


# ------------------------------------------------------------ docs/, CHANGELOG


def test_the_api_page_lists_the_public_api() -> None:
    page = (DOCS / "api.md").read_text()
    api = page.split("## Library API", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `([^`]+)`", api, re.MULTILINE))
    public = {f"nanrunbook.{name}" for name in nanrunbook.__all__}
    public |= {f"nanrunbook.capture.{name}" for name in nanrunbook.capture.__all__}
    public |= {f"nanrunbook.telemetry.{name}" for name in nanrunbook.telemetry.__all__}
    # capture.torch (a package) and capture.mechanisms need torch to import; read
    # their __all__ from the source instead.
    sources = {
        "torch": ROOT / "nanrunbook" / "capture" / "torch" / "__init__.py",
        "mechanisms": ROOT / "nanrunbook" / "capture" / "mechanisms.py",
    }
    for module, source in sources.items():
        tree = ast.parse(source.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names = ast.literal_eval(node.value)
                public |= {f"nanrunbook.capture.{module}.{name}" for name in names}
    assert any(name.startswith("nanrunbook.capture.torch.") for name in public)
    assert any(name.startswith("nanrunbook.capture.mechanisms.") for name in public)
    assert table == public


def test_the_docs_point_at_pages_completion_and_schema() -> None:
    for needle, page in (
        ("man -l man/nanrunbook.1", DOCS / "install.md"),
        ("man nanrunbook", DOCS / "install.md"),
        ("make install", DOCS / "install.md"),
        ("--install-completion", DOCS / "install.md"),
        ("nanrunbook schema", DOCS / "check.md"),
    ):
        assert needle in page.read_text(), (needle, page.name)


def headings(page: Path) -> set[str]:
    """The anchors GitHub gives a Markdown page's headings (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_readme_and_docs_links_resolve() -> None:
    pages = [README, *sorted(DOCS.glob("*.md"))]
    assert {page.name for page in pages} >= {"check.md", "sentinel.md", "api.md"}
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), (page.name, target)
            assert ROOT in linked.parents or linked == ROOT, (page.name, target)
            if anchor:
                assert anchor in headings(linked), (page.name, target)


def test_every_docs_page_is_in_the_readme_index() -> None:
    index = README.read_text().split("## Documentation", 1)[1]
    for page in DOCS.glob("*.md"):
        assert f"](docs/{page.name})" in index, page.name


def test_the_readme_shows_what_check_prints_and_exits() -> None:
    section = README.read_text().split("## Checking a bundle", 1)[1].split("\n## ", 1)[0]
    shown = section.split("the text begins:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert "and it exits 1." in section
    done = subprocess.run(
        [sys.executable, "-m", "nanrunbook", "check", "fixtures/hold-backward-dynamic-skip"],
        env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1
    printed = done.stdout.splitlines()
    assert len(shown) == 5 and [line.removeprefix("    ") for line in shown] == printed[:5]


def test_changelog_names_the_current_version() -> None:
    text = CHANGELOG.read_text()
    assert "keepachangelog.com" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert headings[1] == __version__

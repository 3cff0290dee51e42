"""Hostile and broken evidence, one case at a time (issue 5).

Every bad bundle gets exit 3 and a one-line reason per violation: never a
traceback, never a write, never a hang, never a path followed out of the bundle.
Cases that involve special files run the CLI in a subprocess whose timeout is a
hang guard (not a timing assertion). The bundles are built by the ``case_*``
functions of ``hostile_support``, which ``fuzz/measure_cases.py`` also times.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hostile_support as hs
import pytest
from hostile_support import (
    HOSTILE_TEXT,
    KV_LINE,
    TENSOR_FILE,
    TRACEBACK,
    assert_clean_rejection,
    run_cli,
    run_cli_tty,
    snapshot,
    strip_sgr,
)

from nanrunbook import EvidenceRejected, check_bundle

BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f"


def rejected(bundle: Path, *, unchanged: bool = True) -> list[str]:
    """check_bundle must raise EvidenceRejected, never anything else, and write nothing
    (``unchanged=False`` where the test itself changes the file during the check)."""
    before = snapshot(bundle.parent)
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    if unchanged:
        assert snapshot(bundle.parent) == before
    for v in info.value.violations:
        assert "\n" not in v.message and v.message.isprintable(), v
        assert not TRACEBACK.search(v.message)
    return list(info.value.codes)


def cli_rejected(bundle: Path, fmt: str = "kv") -> list[str]:
    """The CLI (hang-guarded) exits 3 cleanly and leaves the bundle as it was."""
    before = snapshot(bundle.parent)
    codes = assert_clean_rejection(run_cli(bundle, fmt), fmt)
    assert snapshot(bundle.parent) == before
    return codes


@pytest.fixture
def build(tmp_path: Path) -> Callable[[str], Path]:
    def make(name: str) -> Path:
        return hs.CASES[name](tmp_path)

    return make


class ReadLog:
    """Bytes that os.pread/os.preadv/os.read returned, to prove a refusal read nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.total = 0
        self.largest_request = 0
        real_pread, real_preadv, real_read = os.pread, os.preadv, os.read

        def pread(fd: int, n: int, offset: int) -> bytes:
            self.largest_request = max(self.largest_request, n)
            data = real_pread(fd, n, offset)
            self.total += len(data)
            return data

        def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            got = real_preadv(fd, buffers, offset, *args)
            self.total += got
            return got

        def read(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            self.total += len(data)
            return data

        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "read", read)


# --------------------------------------------------------------- header lengths


def test_header_length_2_pow_64_minus_1(build: Callable[[str], Path]) -> None:
    assert rejected(build("header_len_u64_max")) == ["HEADER_LENGTH_INVALID"]


def test_header_length_just_past_the_end_of_the_file(build: Callable[[str], Path]) -> None:
    assert rejected(build("header_len_past_end")) == ["HEADER_LENGTH_INVALID"]


def test_100_mb_whitespace_header_is_refused_before_it_is_read(
    build: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = build("header_100mb_whitespace")
    assert (bundle / TENSOR_FILE).stat().st_size == 8 + hs.WHITESPACE_HEADER_LEN
    log = ReadLog(monkeypatch)
    assert rejected(bundle) == ["HEADER_LENGTH_INVALID"]
    # the manifest (a few KiB) and the 8-byte length: not one byte of the header
    manifest_size = (bundle / "manifest.json").stat().st_size
    assert log.total <= manifest_size + 8
    assert log.largest_request <= 8


def test_million_tensor_header_is_refused_before_it_is_read(
    build: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = build("header_million_tensors")
    log = ReadLog(monkeypatch)
    assert rejected(bundle) == ["HEADER_LENGTH_INVALID"]
    assert log.total <= (bundle / "manifest.json").stat().st_size + 8


# --------------------------------------------------------------------- nesting


def test_manifest_nested_100000_deep_arrays(build: Callable[[str], Path]) -> None:
    assert rejected(build("manifest_nested_deep")) == ["MANIFEST_TOO_DEEP"]


def test_manifest_nested_100000_deep_objects(build: Callable[[str], Path]) -> None:
    assert rejected(build("manifest_nested_deep_objects")) == ["MANIFEST_TOO_DEEP"]


def test_header_nested_100000_deep(build: Callable[[str], Path]) -> None:
    assert rejected(build("header_nested_deep")) == ["HEADER_INVALID_JSON"]


def test_nesting_cases_through_the_cli(build: Callable[[str], Path]) -> None:
    assert cli_rejected(build("manifest_nested_deep")) == ["MANIFEST_TOO_DEEP"]


# ---------------------------------------------------------------------- shapes


def test_manifest_shape_whose_product_overflows_64_bits(build: Callable[[str], Path]) -> None:
    assert "CAP_STAGE_ELEMENTS" in rejected(build("manifest_shape_overflow"))


def test_manifest_shape_of_100000_huge_dims_is_refused_not_multiplied(
    build: Callable[[str], Path],
) -> None:
    """Regression: the product (1.6 million digits) was computed and then formatted into
    a message, which raised ValueError (exit 4) after ~15 s."""
    bundle = build("manifest_shape_huge_product")
    assert rejected(bundle) == ["CAP_STAGE_ELEMENTS"]
    assert cli_rejected(bundle) == ["CAP_STAGE_ELEMENTS"]


def test_header_shape_whose_product_overflows_64_bits(build: Callable[[str], Path]) -> None:
    assert rejected(build("header_shape_overflow")) == ["HEADER_LENGTH_MISMATCH"]


@pytest.mark.parametrize("case", ["manifest_negative_dim", "manifest_fractional_dim"])
def test_manifest_negative_or_fractional_dimension(case: str, build: Callable[[str], Path]) -> None:
    assert rejected(build(case)) == ["SHAPE_INVALID"]


@pytest.mark.parametrize("case", ["header_negative_dim", "header_fractional_dim"])
def test_header_negative_or_fractional_dimension(case: str, build: Callable[[str], Path]) -> None:
    assert rejected(build(case)) == ["HEADER_FIELD_INVALID"]


# ------------------------------------------------- special files, through the CLI


SPECIAL = {
    "tensor_file_fifo": "FILE_NOT_REGULAR",
    "tensor_file_dev_zero_symlink": "FILE_OUTSIDE_BUNDLE",
    "tensor_file_device_node": "FILE_NOT_REGULAR",
    "tensor_file_directory": "FILE_NOT_REGULAR",
    "tensor_file_symlink_loop": "FILE_UNREADABLE",
    "tensor_file_symlink_out": "FILE_OUTSIDE_BUNDLE",
    "tensor_file_symlink_out_relative": "FILE_OUTSIDE_BUNDLE",
}


@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_special_tensor_file_is_refused_without_blocking(
    case: str, build: Callable[[str], Path]
) -> None:
    codes = cli_rejected(build(case))
    # the redirected input-stage entries are refused; the file's now-unbound tensors too
    assert codes[0] == SPECIAL[case]
    assert set(codes) == {SPECIAL[case], "TENSOR_UNBOUND"}


def test_device_node_inside_the_bundle_when_mknod_is_permitted(tmp_path: Path) -> None:
    if not hs.mknod_permitted(tmp_path):
        pytest.skip("mknod of a device is not permitted here (the FIFO case covers the path)")
    bundle = hs.case_tensor_file_device_node(tmp_path)
    assert stat.S_ISCHR(os.lstat(bundle / "special").st_mode)
    assert cli_rejected(bundle)[0] == "FILE_NOT_REGULAR"


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("manifest_fifo", "MANIFEST_UNREADABLE"),
        ("manifest_dev_zero_symlink", "MANIFEST_UNREADABLE"),
    ],
)
def test_special_manifest_is_refused_without_blocking(
    case: str, code: str, build: Callable[[str], Path]
) -> None:
    assert cli_rejected(build(case)) == [code]


@pytest.mark.parametrize("case", ["bundle_is_file", "bundle_is_fifo"])
def test_bundle_path_that_is_not_a_directory(case: str, build: Callable[[str], Path]) -> None:
    bundle = build(case)
    assert cli_rejected(bundle) == ["BUNDLE_NOT_DIRECTORY"]
    assert rejected(bundle) == ["BUNDLE_NOT_DIRECTORY"]


def test_bundle_path_that_does_not_exist(tmp_path: Path) -> None:
    assert assert_clean_rejection(run_cli(tmp_path / "nope", "kv")) == ["BUNDLE_NOT_FOUND"]


# ------------------------------------------------- files that change while read


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return hs.sealed(hs.base_model(), tmp_path)


def _patch_scan(monkeypatch: pytest.MonkeyPatch, after_first: Callable[[int], None]) -> None:
    import nanrunbook.tensors.verify

    real = nanrunbook.tensors.verify.scan_range
    calls = [0]

    def scan(fd: int, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the first tensor was read whole; now the file changes
            after_first(fd)
        return real(fd, *args, **kwargs)

    monkeypatch.setattr(nanrunbook.tensors.verify, "scan_range", scan)


def test_tensor_file_shrinks_while_it_is_read(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = bundle / TENSOR_FILE
    header_end = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    _patch_scan(monkeypatch, lambda fd: os.truncate(path, header_end + 300))
    assert rejected(bundle, unchanged=False) == ["FILE_CHANGED"]


def test_tensor_file_grows_while_it_is_read(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = bundle / TENSOR_FILE

    def grow(fd: int) -> None:
        with open(path, "ab") as out:
            out.write(b"\0" * 4096)

    _patch_scan(monkeypatch, grow)
    codes = rejected(bundle, unchanged=False)
    assert codes == ["FILE_CHANGED"]


def test_tensor_file_truncated_between_header_and_data(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nanrunbook.tensors.verify

    real = nanrunbook.tensors.verify.read_header
    path = bundle / TENSOR_FILE

    def read_then_truncate(fd: int, *args: Any, **kwargs: Any) -> Any:
        header = real(fd, *args, **kwargs)
        os.truncate(path, header.data_start)  # every byte of data gone
        return header

    monkeypatch.setattr(nanrunbook.tensors.verify, "read_header", read_then_truncate)
    assert rejected(bundle, unchanged=False) == ["FILE_CHANGED"]


# -------------------------------------------------------------- unreadable files


def _deny_open(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = os.open

    def guarded(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(path).endswith(name):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded)


def test_unreadable_tensor_file_simulated(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _deny_open(monkeypatch, TENSOR_FILE)
    assert set(rejected(bundle)) == {"FILE_UNREADABLE"}


def test_unreadable_manifest_simulated(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _deny_open(monkeypatch, "manifest.json")
    assert rejected(bundle) == ["MANIFEST_UNREADABLE"]


def test_io_error_while_reading_tensor_data(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: an EIO from the data reads escaped as OSError (exit 4)."""

    def failing(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    assert set(rejected(bundle)) == {"FILE_UNREADABLE"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_tensor_file_for_real(bundle: Path) -> None:
    path = bundle / TENSOR_FILE
    path.chmod(0)
    try:
        assert cli_rejected(bundle)[0] == "FILE_UNREADABLE"
    finally:
        path.chmod(0o644)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_manifest_for_real(bundle: Path) -> None:
    path = bundle / "manifest.json"
    path.chmod(0)
    try:
        assert cli_rejected(bundle) == ["MANIFEST_UNREADABLE"]
    finally:
        path.chmod(0o644)


# ------------------------------------------------------------ encodings and text


@pytest.mark.parametrize("case", ["manifest_not_utf8", "manifest_bom", "manifest_utf16"])
def test_manifest_that_is_not_utf8(case: str, build: Callable[[str], Path]) -> None:
    assert cli_rejected(build(case)) == ["MANIFEST_NOT_UTF8"]


def test_manifest_over_16_mib(build: Callable[[str], Path]) -> None:
    assert rejected(build("manifest_too_large")) == ["MANIFEST_TOO_LARGE"]


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("bidi_in_free_text", "TEXT_INVALID"),
        ("bidi_in_tensor_name", "TENSOR_NAME_INVALID"),
        ("control_in_identifier", "JSON_CONTROL_CHARACTER"),
        ("control_in_key", "JSON_CONTROL_CHARACTER"),
        ("c1_control_in_text", "JSON_CONTROL_CHARACTER"),
    ],
)
def test_control_and_bidi_characters_are_refused(
    case: str, code: str, build: Callable[[str], Path]
) -> None:
    bundle = build(case)
    assert code in rejected(bundle)
    text = run_cli(bundle, "text")
    assert text.code == 3
    assert not any(ch in text.stdout for ch in BIDI + "\x1b\x07\x9b")


def test_bidi_in_a_binding_detail_is_accepted_but_never_printed_raw(
    build: Callable[[str], Path],
) -> None:
    bundle = build("bidi_in_binding_detail")
    assert check_bundle(bundle).decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"
    for fmt in ("text", "kv"):
        result = run_cli(bundle, fmt)
        assert result.code == 0
        assert not any(ch in result.stdout for ch in BIDI)


def test_file_name_with_bidi_and_markup_is_quoted_in_violations(
    build: Callable[[str], Path],
) -> None:
    """Regression: TENSOR_UNBOUND (and FILE_CHANGED) put the raw file name in ``where``,
    so a U+202E reached the terminal."""
    bundle = build("bidi_markup_in_file_name")
    assert rejected(bundle) == ["TENSOR_UNBOUND"]
    text = run_cli(bundle, "text")
    assert text.code == 3
    assert not any(ch in text.stdout for ch in BIDI)
    assert "[red]x" in text.stdout  # shown literally, escaped: 't\\u202e[red]x...'
    kv = assert_clean_rejection(run_cli(bundle, "kv"))
    assert kv == ["TENSOR_UNBOUND"]


# ------------------------------------------------- markup and shell metacharacters


def _escapes_other_than_sgr(output: str) -> list[str]:
    rest = strip_sgr(output)
    return [rest[max(0, i - 10) : i + 10] for i, ch in enumerate(rest) if ch in "\x1b\x9b\x07"]


def test_markup_and_shell_text_in_probes_is_shown_literally_on_a_terminal(
    build: Callable[[str], Path],
) -> None:
    bundle = build("hostile_probe_texts")
    result = run_cli_tty(bundle)
    assert result.code == 1, result
    assert "\x1b[" in result.stdout, "colour was forced: a terminal gets SGR styles"
    assert _escapes_other_than_sgr(result.stdout) == []
    assert "\x1b]8;" not in result.stdout  # no hyperlink from [link=...]
    plain = strip_sgr(result.stdout).replace("\r\n", "\n")
    assert HOSTILE_TEXT in plain
    assert not TRACEBACK.search(plain)


def test_markup_in_a_tensor_name_is_shown_literally_on_a_terminal(
    build: Callable[[str], Path],
) -> None:
    bundle = build("hostile_tensor_name")
    result = run_cli_tty(bundle)
    assert result.code == 1, result
    assert _escapes_other_than_sgr(result.stdout) == []
    plain = strip_sgr(result.stdout).replace("\r\n", "\n")
    assert "first non-finite tensor    [bold red]grad[/] $(id) `x`;" in plain


def test_rich_console_forced_to_a_terminal_prints_markup_literally(
    build: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the library renderer, rich Console(force_terminal=True)."""
    import io

    import rich.console

    from nanrunbook.output.renderers import RENDERERS

    real_init = rich.console.Console.__init__

    def forced(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **{**kwargs, "force_terminal": True, "color_system": "truecolor"})

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(rich.console.Console, "__init__", forced)
    out = io.StringIO()
    RENDERERS["text"].report(check_bundle(build("hostile_probe_texts")), out)
    assert "\x1b[" in out.getvalue()
    assert _escapes_other_than_sgr(out.getvalue()) == []
    plain = strip_sgr(out.getvalue())
    # The report wraps to 80 columns; undoing the wrap gives the text back whole.
    assert max(len(line) for line in plain.splitlines()) <= 80
    assert HOSTILE_TEXT in " ".join(plain.split())


def test_markup_in_an_unknown_key_is_quoted_in_rejections(build: Callable[[str], Path]) -> None:
    bundle = build("markup_in_unknown_key")
    result = run_cli_tty(bundle)
    assert result.code == 3
    assert _escapes_other_than_sgr(result.stdout) == []
    assert "[red]x[/red] $(rm -rf /)" in strip_sgr(result.stdout)
    assert assert_clean_rejection(run_cli(bundle, "kv")) == ["FIELD_UNKNOWN"]


@pytest.mark.parametrize("case", ["hostile_probe_texts", "hostile_tensor_name"])
def test_kv_output_of_hostile_text_is_shell_safe(case: str, build: Callable[[str], Path]) -> None:
    result = run_cli(build(case), "kv")
    assert result.code == 1
    lines = result.stdout.splitlines()
    # The spec's ten lines, then the appended warnings: the warned tensor (renamed
    # to markup and shell text in hostile_tensor_name) by its index, never its name.
    assert len(lines) == 12
    assert lines[10:] == ["warnings=1", "warning=NEAR_DTYPE_MAX backward#0"]
    for line in lines:
        assert KV_LINE.fullmatch(line), line
    assert "$(" not in result.stdout and "`" not in result.stdout


def test_json_output_keeps_hostile_text_as_data(build: Callable[[str], Path]) -> None:
    result = run_cli(build("hostile_probe_texts"), "json")
    assert result.code == 1
    document = json.loads(result.stdout)
    assert {s["tensor_set"]["probe_source"] for s in document["stages"]} == {HOSTILE_TEXT}


# ------------------------------------------------------- missing scaler fields


@pytest.mark.parametrize("case", ["scaler_without_scale", "scaler_without_mode"])
def test_scaler_missing_a_required_field(case: str, build: Callable[[str], Path]) -> None:
    """Regression: a missing scale or mode tripped an assert (exit 4)."""
    bundle = build(case)
    assert rejected(bundle) == ["FIELD_MISSING"]
    assert cli_rejected(bundle) == ["FIELD_MISSING"]


# ------------------------------------------------------- every case, CLI exit 3


def _expected_exit(name: str) -> int:
    return {"hostile_probe_texts": 1, "hostile_tensor_name": 1, "bidi_in_binding_detail": 0}.get(
        name, 3
    )


SLOW = {"header_many_tensors_under_bound", "manifest_16mib_strings"}  # measured, not tested


@pytest.mark.parametrize("name", sorted(set(hs.CASES) - SLOW))
def test_every_case_answers_cleanly_through_the_cli(name: str, tmp_path: Path) -> None:
    bundle = hs.CASES[name](tmp_path)
    before = snapshot(tmp_path)
    try:
        result = run_cli(bundle, "kv")
    except subprocess.TimeoutExpired:  # pragma: no cover - the hang guard
        pytest.fail(f"{name}: no answer within {hs.HANG_GUARD_SECONDS} s")
    assert snapshot(tmp_path) == before
    assert result.code == _expected_exit(name), result
    assert result.stderr == ""
    for line in result.stdout.splitlines():
        assert KV_LINE.fullmatch(line), line


# ------------------------------------------------ impossible declared counts


@pytest.mark.parametrize(
    "case", ["summary_nan_in_integer_tensors", "summary_infinity_in_e4m3_tensors"]
)
def test_summary_declaring_what_its_dtypes_cannot_hold(
    case: str, build: Callable[[str], Path]
) -> None:
    """Regression: NaN declared in I32 tensors (or +inf in F8_E4M3 ones) of a summary,
    which is never recounted, was accepted as HOLD."""
    assert rejected(build(case)) == ["COUNTS_NOT_RECONCILED"]


def test_summary_with_possible_counts_in_a_mixed_stage_is_accepted(tmp_path: Path) -> None:
    model = hs.base_model("hold-optimizer-summary")
    model.manifest["stages"][4]["tensors"][0]["dtype"] = "F8_E4M3"  # NaN possible there
    model.manifest["stages"][4].pop("finite_max_abs", None)
    report = check_bundle(hs.sealed(model, tmp_path))
    assert report.decision.earliest_nonfinite_stage == "optimizer"

"""check_bundle pauses the cyclic collector for its own run and leaves it as it was."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from bundlekit import copy_fixture

from nanrunbook import EvidenceRejected, check_bundle

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "hold-backward-dynamic-skip"


def test_the_collector_is_paused_during_a_check_and_enabled_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import nanrunbook.check as check

    seen: list[bool] = []
    real = check.parse_manifest

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(check, "parse_manifest", spy)
    assert gc.isenabled()
    check_bundle(FIXTURE)
    assert seen == [False]
    assert gc.isenabled()


def test_the_collector_is_enabled_after_a_rejection(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    (bundle / "manifest.json").write_bytes(b"{")
    with pytest.raises(EvidenceRejected):
        check_bundle(bundle)
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled() -> None:
    gc.disable()
    try:
        check_bundle(FIXTURE)
        assert not gc.isenabled()
    finally:
        gc.enable()

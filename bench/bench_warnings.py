"""The early warnings on real CPU runs: six that diverge, six healthy ones.

For each run of ``tests/warning_runs.py`` (shared with the test suite): the
divergence onset as the loop measured it (see that module), the first step the
sentinel's telemetry warns on (the early-warning codes), the lead (onset minus
first warning: 0 warns at the onset, -1 a step after it), the first non-finite
step, and the false alarms (warnings on a healthy run). ``watch`` reads each
run's telemetry twice: as written, and with every warning taken off the lines
(an older sentinel's file), where it must derive the first warning itself.

Goal: every diverging run warned no later than one step after its onset and
before its first non-finite step; no warning at all on a healthy run. The
periodic healthy runs (``PERIODIC``: a loss that cycles every epoch) are
listed apart: the first rise of a cycle is, when it comes, a rise like a
divergence's (``first rise`` counts its warnings); no warning once the run has
come back from a cycle (``false``: the sentinel's after its second epoch;
``older``: the last step ``watch`` warns on for the older file).

    python bench/bench_warnings.py [--runs lr_too_high,lr_jump,...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import warning_runs

from nanrunbook.telemetry import summarise_file


def watch_first(path: Path, strip: bool) -> int | None:
    """The first warning step ``watch`` reports (optionally on the lines with
    their warnings taken off)."""
    return summarise_file(warning_runs.stripped(path) if strip else path).first_warning_step


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=",".join([*warning_runs.RUNS, *warning_runs.PERIODIC]))
    args = parser.parse_args()
    names = [n for n in args.runs.split(",") if n]
    header = (
        f"{'run':<20} {'kind':<9} {'onset':>5} {'warned':>6} {'lead':>4} {'nonfinite':>9}"
        f" {'watch':>5} {'older':>5} {'false':>5}  first warning"
    )
    print(header)
    failures = []
    with tempfile.TemporaryDirectory(prefix="bench-warnings-") as tmp:
        for name in names:
            start = time.perf_counter()
            outcome = warning_runs.run(name, Path(tmp))
            found = [w for w in outcome.warnings() if w[1] in warning_runs.EARLY_CODES]
            every = outcome.warnings()
            first = found[0] if found else None
            onset = outcome.onset
            warned = first[0] if first else None
            lead = onset - warned if onset is not None and warned is not None else None
            assert outcome.telemetry is not None
            watched = watch_first(outcome.telemetry, strip=False)
            older = watch_first(outcome.telemetry, strip=True)
            periodic = name in warning_runs.PERIODIC
            false = 0 if outcome.diverging else len(every)
            kind = "diverges" if outcome.diverging else "periodic" if periodic else "healthy"
            if periodic:
                cycled = 2 * warning_runs.PERIOD
                false = sum(1 for w in every if w[0] > cycled)
                derived = summarise_file(warning_runs.stripped(outcome.telemetry)).warnings
                older = max((w.last_step for w in derived), default=None)  # its last one
            shown = f"{first[1]}: {first[2][:70]}" if first else (every[0][1] if every else "-")
            print(
                f"{name:<20} {kind:<9} {_s(onset):>5} {_s(warned):>6} {_s(lead):>4}"
                f" {_s(outcome.first_nonfinite):>9} {_s(watched):>5} {_s(older):>5} {false:>5}"
                f"  {shown}  ({time.perf_counter() - start:.1f} s)"
            )
            if periodic:
                rise = sum(1 for w in every if w[0] <= cycled)
                print(f"{'':<20} {rise} warnings on its first rise; older: watch's last warning")
                if false or (older is not None and older > cycled):
                    failures.append(name)
            elif outcome.diverging:
                late = onset is None or warned is None or warned > onset + 1
                nonfinite = outcome.first_nonfinite
                if late or (nonfinite is not None and warned is not None and warned >= nonfinite):
                    failures.append(name)
                if older is None or (onset is not None and older > onset + 1):
                    failures.append(f"{name} (watch on an older file)")
            elif false or onset is not None or older is not None:
                failures.append(name)
    print("goal met" if not failures else f"goal missed: {', '.join(failures)}")
    return 0 if not failures else 1


def _s(value: int | None) -> str:
    return "-" if value is None else str(value)


if __name__ == "__main__":
    raise SystemExit(main())

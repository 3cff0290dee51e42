"""The naive check the benchmark compares against: load each file, isfinite per tensor.

What an engineer would write without nanrunbook: ``safetensors.torch.load_file``
on every tensor file of the bundle, then ``torch.isfinite`` on every floating
tensor. It hashes nothing and checks no contract; it prints the number of
non-finite elements it saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def main(bundle: Path) -> None:
    nonfinite = 0
    for path in sorted(bundle.glob("*.safetensors")):
        for tensor in load_file(path).values():
            if tensor.is_floating_point():
                nonfinite += int((~torch.isfinite(tensor)).sum())
    print(nonfinite)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Floor for the benchmark: one SHA-256 stream over every tensor file of a bundle.

Reads each ``*.safetensors`` file of the bundle in name order into one reused
1 MiB buffer and feeds a single ``hashlib.sha256``: no counting, no checking,
one core. A check that hashes each tensor on its own can beat it only by using
more than one core.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path


def main(bundle: Path) -> None:
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    for path in sorted(bundle.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(buffer):
                digest.update(view[:n])
    print(digest.hexdigest())


if __name__ == "__main__":
    main(Path(sys.argv[1]))

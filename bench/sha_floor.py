"""Floor for the benchmark: one SHA-256 stream over every tensor file of a bundle.

Reads each ``*.safetensors`` file of the bundle in name order into one reused
2 MiB buffer (the size ``check`` reads) and feeds a single ``hashlib.sha256``:
no counting, no checking, one core. A check that
hashes each tensor on its own can beat it only by using more than one core.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path


def sha_stream(paths: Iterable[Path], buffer_bytes: int) -> str:
    """One SHA-256 over the files in ``paths``' order, one reused buffer, one core."""
    digest = hashlib.sha256()
    view = memoryview(bytearray(buffer_bytes))
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                digest.update(view[:n])
        finally:
            os.close(fd)
    return digest.hexdigest()


def main(bundle: Path) -> None:
    print(sha_stream(sorted(bundle.glob("*.safetensors")), 2 << 20))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

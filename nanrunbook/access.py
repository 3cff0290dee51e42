"""Safe, read-only access to the files of a bundle directory.

Spec section 1: a file is named by a relative path that stays inside the bundle
after symlinks are resolved and names a regular file. The manifest and every
tensor file are opened here, and only here.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from nanrunbook.errors import EvidenceRejected, Violation, quote

__all__ = [
    "CODES",
    "MANIFEST_MAX_BYTES",
    "MANIFEST_NAME",
    "MemberDirectory",
    "bundles_below",
    "check_relative_path",
    "file_where",
    "open_in_bundle",
    "os_error",
    "read_manifest_bytes",
    "require_directory",
    "set_members",
    "sets_below",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 16 * 1024 * 1024

CODES: dict[str, str] = {
    "BUNDLE_NOT_FOUND": "the bundle path does not exist",
    "BUNDLE_NOT_DIRECTORY": "the bundle path is not a directory",
    "MANIFEST_MISSING": "the bundle has no manifest.json",
    "MANIFEST_UNREADABLE": "manifest.json cannot be read, or is not a regular file",
    "MANIFEST_TOO_LARGE": "manifest.json is larger than 16 MiB",
    "FILE_PATH_UNSAFE": (
        "a tensor file path is empty, absolute, or has a '..' component, a backslash or a NUL"
    ),
    "FILE_MISSING": "a tensor file named by the manifest does not exist",
    "FILE_OUTSIDE_BUNDLE": "a tensor file path resolves (through symlinks) outside the bundle",
    "FILE_NOT_REGULAR": "a tensor file path names a directory, FIFO, device or socket",
    "FILE_UNREADABLE": "a tensor file cannot be opened or read (permission, symlink loop, I/O)",
}


_PLAIN_PATH = re.compile(r"[A-Za-z0-9._/+=@:,-]+")


def file_where(relpath: str) -> str:
    """The relpath as a violation's ``where``; quoted unless it is plain ASCII."""
    return relpath if _PLAIN_PATH.fullmatch(relpath) else quote(relpath)


def check_relative_path(relpath: str) -> list[Violation]:
    """FILE_PATH_UNSAFE violations of a manifest tensor-file path (empty list when safe).

    Exactly the spec's list (empty, absolute, '..', backslash, NUL): '.' and empty
    components are allowed, as the spec allows them; two spellings of one file are
    recognised as one file when the bundle is read.
    """
    where = file_where(relpath)
    problems: list[str] = []
    if relpath == "":
        problems.append("the path is empty")
    else:
        if relpath.startswith("/"):
            problems.append("the path is absolute")
        if "\\" in relpath:
            problems.append("the path contains a backslash")
        if "\x00" in relpath:
            problems.append("the path contains a NUL character")
        parts = relpath.split("/")
        if relpath.startswith("/"):
            parts = parts[1:]
        if ".." in parts:
            problems.append("the path has a '..' component")
    return [
        Violation("FILE_PATH_UNSAFE", where, f"tensor file path {quote(relpath)}: {problem}")
        for problem in problems
    ]


def _reject(code: str, relpath: str, message: str) -> EvidenceRejected:
    return EvidenceRejected([Violation(code, file_where(relpath), message)])


def os_error(relpath: str, err: OSError, doing: str) -> EvidenceRejected:
    # The violation's ``where`` names the file: messages do not repeat it.
    reason = os.strerror(err.errno) if err.errno else type(err).__name__
    if doing == "opening" and err.errno in (errno.ELOOP, errno.ENOTDIR):
        # realpath just saw real directories and a real file: a symlink appeared since.
        return _reject("FILE_UNREADABLE", relpath, "tensor file changed while being opened")
    if isinstance(err, FileNotFoundError | NotADirectoryError):
        return _reject("FILE_MISSING", relpath, "tensor file does not exist")
    if err.errno == errno.ELOOP:
        return _reject("FILE_UNREADABLE", relpath, f"tensor file: symlink loop while {doing}")
    return _reject("FILE_UNREADABLE", relpath, f"tensor file: {reason} while {doing}")


# O_PATH opens a directory for use as dir_fd without needing read permission on it.
_O_DIR: int = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW


def open_in_bundle(bundle_dir: Path, relpath: str) -> int:
    """Open a manifest-named tensor file read-only; return the fd (the caller closes it).

    The path is checked lexically, resolved with ``realpath`` (symlinks allowed as long
    as the target stays inside the bundle's real path), then opened again component by
    component from the bundle directory with O_NOFOLLOW, so a symlink swapped in after
    the check makes the open fail instead of leading out of the bundle. The final
    component is lstat-ed before the open (a device or FIFO is never opened) and the
    opened fd is fstat-ed (authoritative); O_NONBLOCK keeps a FIFO from blocking anyway.

    Raises EvidenceRejected: FILE_PATH_UNSAFE, FILE_MISSING, FILE_OUTSIDE_BUNDLE,
    FILE_NOT_REGULAR, FILE_UNREADABLE.
    """
    unsafe = check_relative_path(relpath)
    if unsafe:
        raise EvidenceRejected(unsafe)
    root, parts = _resolve_inside(bundle_dir, relpath)
    fd, before = _open_beneath(root, parts, relpath)
    _confirm_opened(fd, before, relpath)
    return fd


def _resolve_inside(bundle_dir: Path, relpath: str) -> tuple[str, list[str]]:
    """The bundle's real path and the components of the file's real path below it;
    refuses a path that resolves outside the bundle or to a directory."""
    try:
        root = os.path.realpath(bundle_dir, strict=True)
    except OSError as err:
        raise _reject(
            "FILE_MISSING" if isinstance(err, FileNotFoundError) else "FILE_UNREADABLE",
            relpath,
            "bundle directory cannot be resolved for this tensor file",
        ) from None
    try:
        # strict: a missing target or a symlink loop raises instead of looping or guessing.
        target = os.path.realpath(os.path.join(root, relpath), strict=True)
    except OSError as err:
        raise os_error(relpath, err, "resolving symlinks") from None
    if os.path.commonpath([root, target]) != root:
        raise _reject(
            "FILE_OUTSIDE_BUNDLE",
            relpath,
            "tensor file resolves through a symlink to a path outside the bundle",
        )
    parts = [] if target == root else os.path.relpath(target, root).split(os.sep)
    if not parts:
        raise _reject("FILE_NOT_REGULAR", relpath, "tensor file is the bundle directory")
    if relpath.endswith(("/", "/.")):
        # realpath drops the trailing "/", but the path names a directory (POSIX).
        raise _reject("FILE_NOT_REGULAR", relpath, "tensor file path names a directory")
    return root, parts


def _open_beneath(root: str, parts: list[str], relpath: str) -> tuple[int, os.stat_result]:
    """Open the file again, component by component from ``root`` with O_NOFOLLOW,
    so that a symlink swapped in since ``_resolve_inside`` fails the open; return
    the fd and the final component's lstat taken before it was opened."""
    opened: list[int] = []
    try:
        try:
            opened.append(os.open(root, _O_DIR))
            for part in parts[:-1]:
                opened.append(os.open(part, _O_DIR, dir_fd=opened[-1]))
            before = os.stat(parts[-1], dir_fd=opened[-1], follow_symlinks=False)
        except OSError as err:
            raise os_error(relpath, err, "opening") from None
        if not stat.S_ISREG(before.st_mode):
            raise _reject(
                "FILE_NOT_REGULAR",
                relpath,
                f"tensor file is a {_kind(before.st_mode)}, not a regular file",
            )
        try:
            fd = os.open(parts[-1], _O_FILE, dir_fd=opened[-1])
        except OSError as err:
            raise os_error(relpath, err, "opening") from None
    finally:
        for dir_fd in opened:
            os.close(dir_fd)
    return fd, before


def _confirm_opened(fd: int, before: os.stat_result, relpath: str) -> None:
    """The opened fd's fstat is authoritative: a regular file, and the one lstat-ed
    before the open. Closes ``fd`` when it raises."""
    try:
        after = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise os_error(relpath, err, "reading its status") from None
    if not stat.S_ISREG(after.st_mode):
        os.close(fd)
        raise _reject(
            "FILE_NOT_REGULAR",
            relpath,
            f"tensor file is a {_kind(after.st_mode)}, not a regular file",
        )
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise _reject("FILE_UNREADABLE", relpath, "tensor file was replaced while being opened")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "special file"


def _reject_at(code: str, where: str, message: str) -> EvidenceRejected:
    return EvidenceRejected([Violation(code, where, message)])


def require_directory(path: Path) -> None:
    """Raise BUNDLE_NOT_FOUND or BUNDLE_NOT_DIRECTORY unless ``path`` is a directory
    (a bundle, or an incident set of bundles)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise _reject_at(
            "BUNDLE_NOT_FOUND", file_where(str(path)), "no such file or directory"
        ) from None
    except OSError as err:
        raise _reject_at(
            "BUNDLE_NOT_FOUND", file_where(str(path)), err.strerror or "cannot stat"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        message = "a bundle is a directory"
        if Path(path).name == "manifest.json":
            bundle = str(Path(path).parent)
            message += f" (this is its manifest): nanrunbook check {quote(bundle)}"
        raise _reject_at("BUNDLE_NOT_DIRECTORY", file_where(str(path)), message)


def read_manifest_bytes(bundle: Path) -> bytes:
    """The manifest's bytes, refusing anything but a bounded regular file."""
    require_directory(bundle)
    try:
        fd = open_in_bundle(bundle, MANIFEST_NAME)
    except EvidenceRejected as err:
        raise _manifest_unopened(bundle, err.codes[0]) from None
    try:
        size = os.fstat(fd).st_size
        if size > MANIFEST_MAX_BYTES:
            raise _reject_at("MANIFEST_TOO_LARGE", MANIFEST_NAME, f"{size} bytes, limit 16 MiB")
        chunks: list[bytes] = []
        total = 0
        # The whole file in one read while its size holds (a byte more shows it grew):
        # one chunk, which join hands back as it is, so its pages are written once
        # (4 ms of 6.5 MB, measured).
        want = size + 1
        while chunk := os.read(fd, want):
            total += len(chunk)
            if total > MANIFEST_MAX_BYTES:  # it grew while read
                raise _reject_at("MANIFEST_TOO_LARGE", MANIFEST_NAME, "larger than 16 MiB")
            chunks.append(chunk)
            want = 1 << 20
        return b"".join(chunks)
    except OSError as err:
        raise _reject_at(
            "MANIFEST_UNREADABLE", MANIFEST_NAME, err.strerror or "read failed"
        ) from None
    finally:
        os.close(fd)


_MANIFEST_PROBLEM = {
    "FILE_OUTSIDE_BUNDLE": "resolves through a symlink to a path outside the bundle",
    "FILE_NOT_REGULAR": "is not a regular file (a directory, FIFO, device or socket)",
}


def _manifest_unopened(bundle: Path, code: str) -> EvidenceRejected:
    """Why the manifest could not be opened, worded as a manifest problem, naming
    the bundle and, for a directory of bundles, what it holds."""
    shown = quote(str(bundle))
    if code == "FILE_MISSING":
        message = f"bundle {shown} has no manifest.json"
        members = bundles_below(bundle)
        sets = [] if members else sets_below(bundle)
        if members:
            message += f"; it holds bundles one level down: {_listed(members)}"
        elif sets:
            message += (
                f"; it holds incident sets (directories of rank bundles) one level down:"
                f" {_listed(sets)}; check each"
            )
        return _reject_at("MANIFEST_MISSING", MANIFEST_NAME, message)
    problem = _MANIFEST_PROBLEM.get(code, "cannot be opened")
    return _reject_at("MANIFEST_UNREADABLE", MANIFEST_NAME, f"manifest of bundle {shown} {problem}")


def _listed(names: list[str], shown: int = 5) -> str:
    listed = ", ".join(quote(name) for name in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def bundles_below(directory: Path) -> list[str]:
    """Names of the subdirectories of ``directory`` that hold a manifest.json, sorted.
    Symlinks are not followed: a set's members lie inside it (spec section 11)."""
    names: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and os.path.isfile(
                    os.path.join(entry.path, MANIFEST_NAME)
                ):
                    names.append(entry.name)
    except OSError:
        return []
    return sorted(names)


def sets_below(directory: Path, limit: int = 64) -> list[str]:
    """Names of the subdirectories of ``directory`` that are incident sets (no
    manifest.json, bundles one level down), sorted; at most ``limit`` of those
    without a manifest.json are looked into (a set's members are not)."""
    try:
        with os.scandir(directory) as entries:
            candidates = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    paths = [Path(directory) / name for name in candidates]
    bare = [path for path in paths if not _has_entry(path, MANIFEST_NAME)]
    return [path.name for path in bare[:limit] if bundles_below(path)]


def _has_entry(directory: Path | str, name: str) -> bool:
    """Whether ``directory`` holds an entry ``name`` of any kind; True too when
    that cannot be told (a directory without search permission): a member that
    cannot be read is reported, never skipped."""
    try:
        os.lstat(os.path.join(directory, name))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class MemberDirectory:
    """A member bundle of an incident set (spec section 11)."""

    name: str  # its entry in the set directory
    path: Path  # the directory to check: inside the set
    outside: bool = False  # a symlink that resolves outside the set: never followed


def set_members(directory: Path) -> list[MemberDirectory]:
    """The members of the incident set ``directory``, in name order.

    A member is a subdirectory holding a manifest.json (of any kind: a broken one
    is the member's rejection, not a reason to skip it). Under the path rules of
    spec section 1, a symlinked entry is a member when it resolves to a directory
    inside the set, checked there; one that resolves to a bundle outside the set
    is listed with ``outside`` set and never read. Two names of one directory are
    one member, under its real name when it has one in the set.

    Raises BUNDLE_NOT_FOUND or BUNDLE_NOT_DIRECTORY for a path that is not a
    directory, and OSError when the directory cannot be listed.
    """
    require_directory(directory)
    root = os.path.realpath(directory)
    plain: list[MemberDirectory] = []
    linked: list[MemberDirectory] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                member = _member(directory, root, entry)
            except OSError:
                continue  # vanished or unreadable while listed: it declares nothing
            if member is not None:
                (linked if entry.is_symlink() else plain).append(member)
    seen: set[tuple[int, int]] = set()
    members: list[MemberDirectory] = []
    for member in sorted(plain, key=_by_name) + sorted(linked, key=_by_name):
        if not member.outside:
            try:
                info = os.stat(member.path)
            except OSError:
                info = None
            if info is not None:
                if (info.st_dev, info.st_ino) in seen:
                    continue
                seen.add((info.st_dev, info.st_ino))
        members.append(member)
    return sorted(members, key=_by_name)


def _by_name(member: MemberDirectory) -> str:
    return member.name


def _member(directory: Path, root: str, entry: os.DirEntry[str]) -> MemberDirectory | None:
    if not entry.is_symlink():
        if entry.is_dir(follow_symlinks=False) and _has_entry(entry.path, MANIFEST_NAME):
            return MemberDirectory(entry.name, Path(directory) / entry.name)
        return None
    target = os.path.realpath(entry.path)
    if not os.path.isdir(target) or not _has_entry(target, MANIFEST_NAME):
        return None
    if target == root or os.path.commonpath([root, target]) != root:
        return MemberDirectory(entry.name, Path(directory) / entry.name, outside=True)
    return MemberDirectory(entry.name, Path(directory) / os.path.relpath(target, root))

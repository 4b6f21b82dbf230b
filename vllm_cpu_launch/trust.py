"""Whether a file the launcher relies on may be used: one trust rule, and the checks before
any read. A library is read for its ELF headers only, never loaded. As root, what the
launcher injects or runs may come only from a place that no user but root and the owner of
the vLLM started can change, its settings only from one that root alone can
(insecure_reason; docs/design.md, "Safety").
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

MAX_BYTES = 1 << 20  # a config file is a few lines; a larger one was named by mistake
KINDS = dict(d="a directory", p="a FIFO", c="a character device", b="a block device", s="a socket")


class FileProblem(OSError):
    """Why a file input is not read: one phrase, said after the file's name."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


class Untrusted(FileProblem):
    """The trust rule's refusal of a file input, told apart from other problems by its type."""


def read_trusted(
    path: str, limit: int = MAX_BYTES, *, data: bool = False, what: str = "a config file"
) -> bytes:
    """The bytes of `path`, the one way every file input is read (docs/design.md, "Safety"):
    opened without blocking, a regular file of at most `limit` bytes (a FIFO would block, a
    device read forever; /dev/null is empty), else FileProblem; one the trust rule accepts,
    else Untrusted. `data`: a file vLLM reads wherever its command names it (a model's
    config.json) only chooses among outcomes built of trusted files: the rule does not apply.
    `what` the file is, as a message about its size says it."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        found = isinstance(error, FileNotFoundError)
        raise FileProblem("not found" if found else f"cannot be read ({error.strerror})") from None
    status = os.fstat(descriptor)
    if stat.S_ISREG(status.st_mode) and status.st_size <= limit:
        with os.fdopen(descriptor, "rb") as stream:
            refusal = None if data else untrusted(path)
            if refusal is not None:
                raise Untrusted(refusal)
            try:
                return stream.read(limit + 1)[:limit]
            except OSError as error:
                raise FileProblem(f"cannot be read ({error.strerror})") from None
    os.close(descriptor)
    if is_null_device(status):  # /dev/null, the usual "no file": empty, at once
        return b""
    if stat.S_ISREG(status.st_mode):
        raise FileProblem(f"is {status.st_size} bytes, over the {limit}-byte limit of {what}")
    kind = KINDS.get(stat.filemode(status.st_mode)[0], "no regular file")
    raise FileProblem(f"is {kind}, not a regular file")


def untrusted(path: str) -> str | None:
    """Why the trust rule refuses a settings file (with owner, mode and fix), or None: another
    user who could change what runs and is preloaded would choose for root (or for anyone)."""
    found = insecure_reason(os.path.abspath(path), os.geteuid())
    if found is None:
        return None
    why, fix = found
    reader = "as root, only settings no other user can change are read"
    if os.geteuid() != 0:
        reader = "settings everyone can change are not read"
    fixed = f"Fix: {fix}" if fix else "move it where only its owner can write"
    return f"not read: {why}; {reader}; {fixed}"


def is_null_device(status: os.stat_result) -> bool:
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(status.st_mode) and status.st_rdev == null.st_rdev


# The trust rule

MAX_LINK_HOPS = 40  # the kernel's own limit before ELOOP
MOVE = "move"  # the fix for a file in a shared, sticky directory: moved out (moved_out)


def unsafe_owner_or_mode(
    status: os.stat_result, euid: int, is_file: bool, trusted: frozenset[int] = frozenset()
) -> tuple[str, str] | None:
    """(why, which chmod/chown) when a file or directory lets an untrusted user change what
    runs, or None. As root: owned by root or a `trusted` uid (the owner of the vLLM started,
    whose code root runs anyway), writable by neither group nor others. As another user: not
    writable by all. A sticky directory (/tmp) is fine above the file's own directory."""
    as_root = euid == 0
    if as_root and status.st_uid != 0 and status.st_uid not in trusted:
        whose = "neither root nor the owner of the vLLM being started" if trusted else "not root"
        return f"owned by uid {status.st_uid}, {whose}", "chown root"
    mask = (stat.S_IWGRP | stat.S_IWOTH) if as_root else stat.S_IWOTH
    sticky = bool(status.st_mode & stat.S_ISVTX)
    if not status.st_mode & mask or (sticky and not is_file):
        return None
    who = "others" if status.st_mode & stat.S_IWOTH else "its group"
    # A sticky directory (/tmp, /dev/shm) is meant to be shared: chmod would break it for
    # everyone, so the file moves out of it instead (insecure_reason).
    return f"writable by {who}", MOVE if sticky else "chmod go-w" if as_root else "chmod o-w"


def lookup_steps(path: str) -> tuple[list[str], list[str], str]:
    """(directories searched, links followed, file reached) on the way to `path`, resolved as
    the kernel does: a directory that only an intermediate symbolic link passes is seen too."""
    directories: dict[str, None] = {}
    links: list[str] = []
    current = "/"
    pending = [part for part in path.split("/") if part]
    while pending:
        name = pending.pop(0)
        if name in (".", ".."):
            current = os.path.dirname(current) if name == ".." else current
            continue
        directories[current] = None
        candidate = os.path.join(current, name)
        if not os.path.islink(candidate):
            current = candidate
            continue
        if len(links) >= MAX_LINK_HOPS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links")
        links.append(candidate)
        target = os.readlink(candidate)
        current = "/" if target.startswith("/") else current
        pending[:0] = [part for part in target.split("/") if part]
    return list(directories), links, current


def insecure_reason(
    path: str, euid: int, trusted: frozenset[int] = frozenset(), named: bool = False
) -> tuple[str, str] | None:
    """(why, fix) when an untrusted user could swap `path`, a link or directory on the way
    to it (unsafe_owner_or_mode). The fix removes the one problem found (several: ""); a
    file in a shared sticky directory is moved out where the user `named` it."""
    problems: list[tuple[str, str]] = []
    try:
        directories, links, real = lookup_steps(path)
        status = os.stat(real)
        problem = None if read_only(real) else unsafe_owner_or_mode(status, euid, True, trusted)
        if problem:
            why = f"{real} is {problem[0]} ({owner_and_mode(status)})"
            problems.append((why, f"{problem[1]} {quoted(real)}"))
        for link in links:  # a link's own mode means nothing; who may replace it does
            owner = os.lstat(link).st_uid
            if euid == 0 and owner != 0 and owner not in trusted and not read_only(link, False):
                why = f"symbolic link {link} is owned by uid {owner}, not root"
                problems.append((why, f"chown -h root {quoted(link)}"))
        home = os.path.dirname(real)
        for directory in directories:
            if read_only(directory):
                continue
            status = os.stat(directory)
            problem = unsafe_owner_or_mode(status, euid, directory == home, trusted)
            if problem:
                moved = moved_out(real) if named else ""
                fix = moved if problem[1] == MOVE else f"{problem[1]} {quoted(directory)}"
                why = f"directory {directory} is {problem[0]} ({owner_and_mode(status)})"
                problems.append((why, fix))
    except OSError as error:
        return f"cannot check its permissions: {error.strerror}", ""
    if len(problems) > 1:
        return f"{problems[0][0]} (and {len(problems) - 1} more)", ""
    return problems[0] if problems else None


def owner_and_mode(status: os.stat_result) -> str:
    return f"owner uid {status.st_uid}, mode {stat.filemode(status.st_mode)}"


def read_only(path: str, follow: bool = True) -> bool:
    """Whether `path` (a link: its directory) lies on a read-only mount, whose mode bits mean
    nothing: no user can change a Kubernetes ConfigMap volume, mode 0777."""
    try:
        where = path if follow else os.path.dirname(path) or "/"
        return bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def moved_out(path: str) -> str:
    """The file moved from its shared, sticky directory into a new one beside it that only
    its owner can write, and its new path. `mkdir` fails on a directory someone made first."""
    name = os.path.basename(path)
    stem = name.split(".")[0]
    directory = os.path.join(os.path.dirname(path), stem if stem not in ("", name) else f"{name}.d")
    new = os.path.join(directory, name)
    return (
        f"mkdir -m 755 {quoted(directory)} && mv {quoted(path)} {quoted(new)}  (then name it {new})"
    )


def quoted(path: str) -> str:
    import shlex  # lazy: only once a problem is found: it imports `re`, too dear for the exec path

    return shlex.quote(path)


def owners(paths: tuple[str, ...]) -> frozenset[int]:
    """The uids owning these files (after links): whoever owns the program root runs."""
    found = set()
    for path in paths:
        try:
            found.add(os.stat(path).st_uid)
        except OSError:
            continue
    return frozenset(found)

"""One trust rule for what the launcher runs as root: the library and the program alike.

`LD_PRELOAD` injects code into the server, and the server's own script and interpreter
are code too. Either may come only from a place that no user other than root and the
program's owner can change (docs/design.md, "Safety").
"""

from __future__ import annotations

import errno
import os
import stat

MAX_LINK_HOPS = 40  # the kernel's own limit before ELOOP
MOVE = "move"  # the fix for a file in a shared, sticky directory: moved out (moved_out)


def unsafe_owner_or_mode(
    status: os.stat_result, euid: int, is_file: bool, trusted: frozenset[int] = frozenset()
) -> tuple[str, str] | None:
    """(why, which chmod/chown) when a file or directory lets an untrusted user change
    what runs, or None.

    One rule for the library and the program it is preloaded into (docs/design.md). As root:
    owned by root or by a `trusted` uid (the owner of the vLLM being started, whose code
    root runs anyway), and writable by neither group nor others. As another user, whose
    own Python code runs in vLLM anyway: not writable by all. A sticky directory (like
    /tmp) is fine above the file's own directory.
    """
    as_root = euid == 0
    if as_root and status.st_uid != 0 and status.st_uid not in trusted:
        whose = "neither root nor the owner of the vLLM being started" if trusted else "not root"
        return f"owned by uid {status.st_uid}, {whose}", "chown root"
    mask = (stat.S_IWGRP | stat.S_IWOTH) if as_root else stat.S_IWOTH
    sticky = bool(status.st_mode & stat.S_ISVTX)
    if status.st_mode & mask and (is_file or not sticky):
        who = "others" if status.st_mode & stat.S_IWOTH else "its group"
        # A sticky directory (/tmp, /dev/shm) is meant to be shared: chmod would break it
        # for everyone, so the file moves out of it instead (insecure_reason).
        fix = MOVE if sticky else "chmod go-w" if as_root else "chmod o-w"
        return f"writable by {who}", fix
    return None


def lookup_steps(path: str) -> tuple[list[str], list[str], str]:
    """(directories searched, links followed, file reached) on the way to `path`.

    Resolved one component at a time, as the kernel does, so that a directory which
    only an intermediate symbolic link passes through is seen as well.
    """
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
    """(why, fix) when `path` could be swapped by an untrusted user: the file, a link on
    the way to it, or any directory searched on the way (see unsafe_owner_or_mode).

    The fix is one chmod/chown, given only when it removes the one problem found; with
    several, none (""). A file in a shared sticky directory is moved out of it, where the
    user `named` it (and so can name its new path); one found where the launcher
    searches would no longer be found there: none.
    """
    problems: list[tuple[str, str]] = []
    try:
        directories, links, real = lookup_steps(path)
        problem = (
            None if read_only(real) else unsafe_owner_or_mode(os.stat(real), euid, True, trusted)
        )
        if problem:
            problems.append((f"{real} is {problem[0]}", command(problem[1], real)))
        for link in links:  # a link's own mode means nothing; who may replace it does
            owner = os.lstat(link).st_uid
            if euid == 0 and owner != 0 and owner not in trusted and not read_only(link, False):
                why = f"symbolic link {link} is owned by uid {owner}, not root"
                problems.append((why, command("chown -h root", link)))
        home = os.path.dirname(real)
        for directory in directories:
            if read_only(directory):
                continue
            problem = unsafe_owner_or_mode(os.stat(directory), euid, directory == home, trusted)
            if problem:
                why = f"directory {directory} is {problem[0]}"
                moved = moved_out(real) if named else ""
                fix = moved if problem[1] == MOVE else command(problem[1], directory)
                problems.append((why, fix))
    except OSError as error:
        return f"cannot check its permissions: {error.strerror}", ""
    if not problems:
        return None
    if len(problems) > 1:
        return f"{problems[0][0]} (and {len(problems) - 1} more)", ""
    return problems[0]


def read_only(path: str, follow: bool = True) -> bool:
    """Whether `path` lies on a file system mounted read-only (a Kubernetes ConfigMap or
    Secret volume, whose directory is mode 0777): no user can change what is there, so its
    mode bits mean nothing. A link is judged where it lies (its directory's mount)."""
    try:
        where = path if follow else os.path.dirname(path) or "/"
        return bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def command(change: str, path: str) -> str:
    """`CHANGE PATH` quoted for a shell, or "" when there is no change to make."""
    return f"{change} {quoted(path)}" if change else ""


def moved_out(path: str) -> str:
    """The file moved from its shared, sticky directory into a new one beside it that only
    its owner (the user running the fix) can write, and the path to name it by then.
    `mkdir` without -p fails on a directory someone else made first."""
    name = os.path.basename(path)
    stem = name.split(".")[0]
    directory = os.path.join(os.path.dirname(path), stem if stem not in ("", name) else f"{name}.d")
    new = os.path.join(directory, name)
    return (
        f"mkdir -m 755 {quoted(directory)} && mv {quoted(path)} {quoted(new)}  (then name it {new})"
    )


def quoted(path: str) -> str:
    import shlex  # only once a problem is found: it imports `re`, too dear for the exec path

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

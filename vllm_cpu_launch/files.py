"""A file the launcher reads, checked before it is read.

Opening a FIFO for reading blocks until someone writes to it, and a device or a huge file
named by mistake reads forever: every file input (a launcher config, vLLM's `--config`)
is opened without blocking and read only when it is a regular file of a sensible size.
"""

from __future__ import annotations

import os
import stat

# A config file is a few lines; one larger than this was named by mistake.
MAX_BYTES = 1 << 20
KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class FileProblem(OSError):
    """Why a file input is not read: one phrase, said after the file's name."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def read_checked(path: str, limit: int = MAX_BYTES) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes; else FileProblem."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except FileNotFoundError:
        raise FileProblem("not found") from None
    except OSError as error:
        raise FileProblem(f"cannot be read ({error.strerror})") from None
    status = os.fstat(descriptor)
    problem = None
    if is_null_device(status):  # /dev/null, the usual "no file": empty, at once
        os.close(descriptor)
        return b""
    if not stat.S_ISREG(status.st_mode):
        kind = KINDS.get(stat.S_IFMT(status.st_mode), "no regular file")
        problem = f"is {kind}, not a regular file"
    elif status.st_size > limit:
        problem = f"is {status.st_size} bytes, more than a config file's {limit}"
    if problem is not None:
        os.close(descriptor)
        raise FileProblem(problem)
    with os.fdopen(descriptor, "rb") as stream:
        try:
            return stream.read(limit + 1)[:limit]
        except OSError as error:
            raise FileProblem(f"cannot be read ({error.strerror})") from None


def is_null_device(status: os.stat_result) -> bool:
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(status.st_mode) and status.st_rdev == null.st_rdev

"""A running process's link map, in load order, read as glibc's `pldd` reads it.

/proc/PID/maps lists files by address, which says nothing of the order the loader
searches. The loader's own list does: /proc/PID/auxv gives the program headers
(AT_PHDR, AT_PHNUM); from them PT_PHDR gives the load bias and PT_DYNAMIC the dynamic
section, whose DT_DEBUG points at `struct r_debug`, whose `r_map` heads the chain of
`struct link_map` (l_addr, l_name, l_ld, l_next, l_prev), read from /proc/PID/mem.
The executable comes first, then the preloads, then what they and it need, then what
was opened later. Only 64-bit little-endian processes are read (x86-64, where it is
tested; aarch64 has the same layout); any other, or a process whose memory is closed
(another user's, Yama's ptrace_scope, a missing CAP_SYS_PTRACE), gets `None` and a
reason, never a guess. Standard library only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import BinaryIO

AT_PHDR = 3
AT_PHNUM = 5
PT_DYNAMIC = 2
PT_PHDR = 6
DT_NULL = 0
DT_DEBUG = 21
PHDR_SIZE = 56  # Elf64_Phdr
DYN_SIZE = 16  # Elf64_Dyn
LINK_MAP_SIZE = 40  # l_addr, l_name, l_ld, l_next, l_prev: five 8-byte words
MAX_OBJECTS = 4096  # a cycle in a corrupt chain ends here
MAX_NAME = 4096
ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
# Who may read another process's memory (the kernel's ptrace access check, "attach" mode).
PTRACE_HINT = (
    "it needs ptrace access: the process's user, or root with CAP_SYS_PTRACE; "
    "kernel.yama.ptrace_scope 1 or more narrows it further"
)


@dataclass(frozen=True)
class LinkMap:
    """The link map of one process: (l_addr, l_name) in load order (the executable's name
    is ""), or why it could not be read. l_addr is where a library's first mapping starts
    (its load bias), which names its file in /proc/PID/maps."""

    objects: tuple[tuple[int, str], ...] | None
    unreadable: str | None = None


class Unreadable(Exception):
    """The link map cannot be read; the message says why."""


def read_link_map(pid: int) -> LinkMap:
    """PID's link map in load order, or None and the reason where it cannot be read."""
    try:
        check_elf64_lsb(pid)
        with open(f"/proc/{pid}/auxv", "rb") as stream:
            auxv = stream.read()
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            return LinkMap(tuple(walk(mem, auxv)))
    except PermissionError as error:
        return LinkMap(None, f"/proc/{pid}/{file_of(error)}: permission denied ({PTRACE_HINT})")
    except (FileNotFoundError, ProcessLookupError):
        return LinkMap(None, f"process {pid} exited")
    except (OSError, Unreadable, struct.error, OverflowError, ValueError) as error:
        # A pointer past the end of the address space (a corrupt or changing chain) lands here.
        return LinkMap(None, str(error) or type(error).__name__)


def file_of(error: OSError) -> str:
    return str(error.filename or "mem").rpartition("/")[2]


def check_elf64_lsb(pid: int) -> None:
    """Only a 64-bit little-endian program has the layout read here."""
    with open(f"/proc/{pid}/exe", "rb") as stream:
        ident = stream.read(6)
    if ident[:4] != ELF_MAGIC:
        raise Unreadable("the program is not an ELF file")
    if ident[4] != ELFCLASS64 or ident[5] != ELFDATA2LSB:
        raise Unreadable("a 32-bit or big-endian program: only 64-bit little-endian is read")


def auxv_value(auxv: bytes, wanted: int) -> int:
    for offset in range(0, len(auxv) - 15, 16):
        key, value = struct.unpack_from("<QQ", auxv, offset)
        if key == wanted:
            return int(value)
    raise Unreadable(f"no auxv entry {wanted}")


def read_at(mem: BinaryIO, address: int, size: int) -> bytes:
    """`size` bytes of the process's memory at `address` (short only at an unmapped end)."""
    mem.seek(address)
    data: bytes = mem.read(size)
    if len(data) < size:
        raise Unreadable(f"short read of {size} bytes at {address:#x}")
    return data


def dynamic_section(mem: BinaryIO, auxv: bytes) -> tuple[int, int]:
    """(address, size) of the executable's dynamic section in the process."""
    phdr = auxv_value(auxv, AT_PHDR)
    phnum = auxv_value(auxv, AT_PHNUM)
    headers = read_at(mem, phdr, phnum * PHDR_SIZE)
    bias = 0
    dynamic = None
    for index in range(phnum):
        p_type, _, _, p_vaddr, _, _, p_memsz, _ = struct.unpack_from(
            "<IIQQQQQQ", headers, index * PHDR_SIZE
        )
        if p_type == PT_PHDR:
            bias = phdr - p_vaddr
        elif p_type == PT_DYNAMIC:
            dynamic = (p_vaddr, p_memsz)
    if dynamic is None:
        raise Unreadable("a statically linked program (no PT_DYNAMIC)")
    return dynamic[0] + bias, dynamic[1]


def r_debug_address(mem: BinaryIO, auxv: bytes) -> int:
    address, size = dynamic_section(mem, auxv)
    table = read_at(mem, address, size - size % DYN_SIZE)
    for offset in range(0, len(table), DYN_SIZE):
        tag, value = struct.unpack_from("<qQ", table, offset)
        if tag == DT_DEBUG and value:
            return int(value)
        if tag == DT_NULL:
            break
    raise Unreadable("no DT_DEBUG in the program's dynamic section")


def walk(mem: BinaryIO, auxv: bytes) -> list[tuple[int, str]]:
    """(l_addr, l_name) along r_debug.r_map's chain, in order."""
    entry = struct.unpack("<Q", read_at(mem, r_debug_address(mem, auxv) + 8, 8))[0]
    objects: list[tuple[int, str]] = []
    while entry and len(objects) < MAX_OBJECTS:
        address, name, _, entry, _ = struct.unpack("<QQQQQ", read_at(mem, entry, LINK_MAP_SIZE))
        objects.append((address, read_string(mem, name) if name else ""))
    return objects


def read_string(mem: BinaryIO, address: int) -> str:
    """A NUL-terminated name; read in pieces, since a page boundary may follow it."""
    data = b""
    while b"\0" not in data and len(data) < MAX_NAME:
        mem.seek(address + len(data))
        piece: bytes = mem.read(256 - (address + len(data)) % 256)
        if not piece:
            break
        data += piece
    return data.partition(b"\0")[0].decode("utf-8", "surrogateescape")

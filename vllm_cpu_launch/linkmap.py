"""A running process's link map, in load order, read as glibc's `pldd` reads it.

/proc/PID/maps lists files by address, which says nothing of the loader's search order;
its own list does: /proc/PID/auxv gives the program headers and the entry point (less the
program's e_entry: the load bias), whose PT_DYNAMIC gives the dynamic section, whose
DT_DEBUG points at `struct r_debug`, whose `r_map` heads the chain of `struct link_map`,
read from /proc/PID/mem: the executable, the preloads, what they and it need, then what
was opened later. Only 64-bit little-endian
processes are read (x86-64, tested; aarch64 has the same layout); any other, or one whose
memory is closed (another user's, Yama's ptrace_scope, no CAP_SYS_PTRACE), gets `None`
and a reason, never a guess.
"""

from __future__ import annotations

import os
import struct

from vllm_cpu_launch.records import record

AT_PHDR, AT_PHNUM, AT_ENTRY = 3, 5, 9  # auxv: the program headers, how many, the entry
PT_DYNAMIC = 2
DT_NULL, DT_DEBUG = 0, 21
PHDR = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr
DYN = struct.Struct("<qQ")  # Elf64_Dyn
LINK_MAP = struct.Struct("<QQQQQ")  # l_addr, l_name, l_ld, l_next, l_prev
MAX_OBJECTS = 4096  # a cycle in a corrupt chain ends here
MAX_NAME = 4096
# Who may read another process's memory (the kernel's ptrace access check, "attach" mode).
PTRACE_HINT = (
    "it needs ptrace access: the process's user, or root with CAP_SYS_PTRACE; "
    "kernel.yama.ptrace_scope 1 or more narrows it further"
)


@record
class LinkMap:
    """The link map of one process: (l_addr, l_name) in load order (the executable's name
    is ""), or why it could not be read. l_addr is where a library's first mapping starts
    (its load bias), which names its file in /proc/PID/maps."""

    objects: tuple[tuple[int, str], ...] | None
    unreadable: str | None = None


class Unreadable(Exception):
    """Why the link map cannot be read."""


def read_link_map(pid: int) -> LinkMap:
    try:
        with open(f"/proc/{pid}/exe", "rb") as stream:
            header = stream.read(32)
        if header[:6] != b"\x7fELF\x02\x01":  # ELFCLASS64, ELFDATA2LSB: the layout read here
            raise Unreadable("not a 64-bit little-endian ELF program: only those are read")
        with open(f"/proc/{pid}/auxv", "rb") as stream:
            auxv = dict(struct.iter_unpack("<QQ", stream.read()))
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            entry = struct.unpack_from("<Q", header, 24)[0]  # e_entry
            return LinkMap(tuple(walk(mem.fileno(), auxv, entry)))
    except PermissionError as error:
        file = str(error.filename or "mem").rpartition("/")[2]
        return LinkMap(None, f"/proc/{pid}/{file}: permission denied ({PTRACE_HINT})")
    except (FileNotFoundError, ProcessLookupError):
        return LinkMap(None, f"process {pid} exited")
    except (OSError, Unreadable, struct.error, OverflowError, ValueError) as error:
        # A pointer past the end of the address space (a corrupt or changing chain) lands here.
        return LinkMap(None, str(error) or type(error).__name__)


def read_at(mem: int, address: int, size: int) -> bytes:
    """`size` bytes of the process's memory at `address` (short only at an unmapped end)."""
    data = os.pread(mem, size, address)
    if len(data) < size:
        raise Unreadable(f"short read of {size} bytes at {address:#x}")
    return data


def r_debug_address(mem: int, auxv: dict[int, int], entry: int) -> int:
    """DT_DEBUG of the executable's dynamic section, which its program headers locate; the
    load bias from the entry point (a -static-pie program has no PT_PHDR to give it)."""
    if not {AT_PHDR, AT_PHNUM, AT_ENTRY} <= auxv.keys():
        raise Unreadable("no AT_PHDR, AT_PHNUM or AT_ENTRY entry in auxv")
    phdr, bias = auxv[AT_PHDR], auxv[AT_ENTRY] - entry
    headers = read_at(mem, phdr, auxv[AT_PHNUM] * PHDR.size)
    dynamic = None
    for p_type, _, _, p_vaddr, _, _, p_memsz, _ in PHDR.iter_unpack(headers):
        if p_type == PT_DYNAMIC:
            dynamic = (p_vaddr, p_memsz)
    if dynamic is None:
        raise Unreadable("a statically linked program (no PT_DYNAMIC)")
    address, size = dynamic
    for tag, value in DYN.iter_unpack(read_at(mem, address + bias, size - size % DYN.size)):
        if tag == DT_DEBUG and value:
            return int(value)
        if tag == DT_NULL:
            break
    raise Unreadable("no DT_DEBUG in the program's dynamic section")


def walk(mem: int, auxv: dict[int, int], program_entry: int) -> list[tuple[int, str]]:
    r_debug = r_debug_address(mem, auxv, program_entry)
    entry = struct.unpack("<Q", read_at(mem, r_debug + 8, 8))[0]
    objects: list[tuple[int, str]] = []
    while entry and len(objects) < MAX_OBJECTS:
        address, name, _, entry, _ = LINK_MAP.unpack(read_at(mem, entry, LINK_MAP.size))
        objects.append((address, read_string(mem, name) if name else ""))
    return objects


def read_string(mem: int, address: int) -> str:
    """A NUL-terminated name; read in pieces, since a page boundary may follow it."""
    data = b""
    while b"\0" not in data and len(data) < MAX_NAME:
        piece = os.pread(mem, 256 - (address + len(data)) % 256, address + len(data))
        if not piece:
            break
        data += piece
    return data.partition(b"\0")[0].decode("utf-8", "surrogateescape")

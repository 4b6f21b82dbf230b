"""What a library file is: an ELF shared object for this machine, whole, and which
OpenMP runtime (Intel's or LLVM's) it is. Reads headers only; never loads the file."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mmap

FLAVOR_MARKERS = ((b"Intel(R) OMP version", "intel"), (b"LLVM OMP version", "llvm"))
BANNER = b" OMP version"  # what both markers end with
# The banner that follows it: `performance` (the runtime), `profile`, or `stub` (serial).
LIBRARY_TYPE = b" OMP library type: "
FLAVOR_SCAN_LIMIT = 64 << 20
# ELF e_machine for each `uname -m`, and the Debian multiarch triplet.
ELF_MACHINES = {
    "x86_64": 62,
    "aarch64": 183,
    "ppc64le": 21,
    "s390x": 22,
    "riscv64": 243,
    "i686": 3,
    "i386": 3,
}
ELF_MACHINE_NAMES = {number: name for name, number in ELF_MACHINES.items()}
# The same machine numbers in a big-endian file name other machines; s390x is big-endian.
BIG_ENDIAN_NAMES = {21: "ppc64", 183: "aarch64_be", 22: "s390x"}
BIG_ENDIAN_MACHINES = ("s390x",)
ELF_TYPE_SHARED = 3


def elf_problem(header: bytes, machine: str) -> str | None:
    """Why an ELF header does not fit this machine, or None when it does."""
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return "not an ELF file"
    bits = {1: 32, 2: 64}.get(header[4])
    order = {1: "little", 2: "big"}.get(header[5])
    if bits is None or order is None:
        return "a corrupt ELF header"
    wanted_bits = 32 if machine in ("i686", "i386") else 64
    if bits != wanted_bits:
        return f"a {bits}-bit ELF file; this {machine} host needs {wanted_bits}-bit"
    # Every field in the file's own byte order (EI_DATA), which must be the host's.
    elf_type = int.from_bytes(header[16:18], order)  # type: ignore[arg-type]
    elf_machine = int.from_bytes(header[18:20], order)  # type: ignore[arg-type]
    names = BIG_ENDIAN_NAMES if order == "big" else ELF_MACHINE_NAMES
    built_for = names.get(elf_machine, f"ELF machine {elf_machine}")
    host_order = "big" if machine in BIG_ENDIAN_MACHINES else "little"
    if order != host_order:
        return (
            f"a {order}-endian ELF file built for {built_for}; this {machine} host runs "
            f"{host_order}-endian ones"
        )
    if elf_type != ELF_TYPE_SHARED:
        return f"an ELF file of type {elf_type}, not a shared object"
    wanted_machine = ELF_MACHINES.get(machine)
    if wanted_machine is not None and elf_machine != wanted_machine:
        return f"built for {built_for}; this host is {machine}"
    return None


PT_LOAD = 1


def field(data: bytes, offset: int, width: int, header: bytes) -> int:
    """An integer field of an ELF structure, in the file's byte order (the header's EI_DATA)."""
    order = "little" if header[5] == 1 else "big"
    return int.from_bytes(data[offset : offset + width], order)  # type: ignore[arg-type]


def elf_truncation(header: bytes, descriptor: int, size: int) -> str | None:
    """Why a fitting ELF file is cut short, or None when it is whole.

    Its header tables and every loadable segment must lie within the file: the loader
    maps them, and a truncated copy (an interrupted download or copy) is refused by the
    loader or dies of SIGBUS when the missing pages are touched. `header` is the ELF
    header (checked by elf_problem); the program headers are read from `descriptor`.
    """
    wide = header[4] == 2
    if len(header) < (64 if wide else 52):
        return f"a truncated ELF file ({size} bytes, shorter than its own header)"

    def number(data: bytes, offset: int, width: int) -> int:
        return field(data, offset, width, header)

    fields = (32, 40, 54, 56, 58, 60) if wide else (28, 32, 42, 44, 46, 48)
    widths = (8, 8, 2, 2, 2, 2) if wide else (4, 4, 2, 2, 2, 2)
    phoff, shoff, phentsize, phnum, shentsize, shnum = (
        number(header, o, w) for o, w in zip(fields, widths, strict=True)
    )
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if end <= size and phentsize:
        table = os.pread(descriptor, phentsize * phnum, phoff)
        for start in range(0, len(table) - phentsize + 1, phentsize):
            entry = table[start : start + phentsize]
            if number(entry, 0, 4) != PT_LOAD:
                continue
            if wide:
                offset, length = number(entry, 8, 8), number(entry, 32, 8)
            else:
                offset, length = number(entry, 4, 4), number(entry, 16, 4)
            end = max(end, offset + length)
    if end > size:
        return f"a truncated ELF file ({size} bytes; its headers and segments need {end})"
    return None


def section_range(header: bytes, descriptor: int, name: bytes) -> tuple[int, int] | None:
    """(file offset, end) of the section called `name`, from the section headers of a
    whole ELF file (elf_truncation has checked they lie within it), or None."""
    wide = header[4] == 2
    offsets = (40, 58, 60, 62) if wide else (32, 46, 48, 50)
    widths = (8, 2, 2, 2) if wide else (4, 2, 2, 2)
    shoff, shentsize, shnum, shstrndx = (
        field(header, o, w, header) for o, w in zip(offsets, widths, strict=True)
    )
    if not shoff or not shnum or shstrndx >= shnum or shentsize < (64 if wide else 40):
        return None
    table = os.pread(descriptor, shentsize * shnum, shoff)
    # sh_name at 0; sh_offset and sh_size at 24 and 32 (64-bit), 16 and 20 (32-bit).
    at, width = (24, 8) if wide else (16, 4)

    def placed(index: int) -> tuple[int, int, int]:
        entry = table[index * shentsize : (index + 1) * shentsize]
        start = field(entry, at, width, header)
        return field(entry, 0, 4, header), start, start + field(entry, at + width, width, header)

    _, names_start, names_end = placed(shstrndx)
    names = os.pread(descriptor, min(names_end - names_start, 1 << 20), names_start)
    wanted = name + b"\0"
    for index in range(shnum):
        name_at, start, end = placed(index)
        if names[name_at : name_at + len(wanted)] == wanted:
            return start, end
    return None


def openmp_runtime(descriptor: int, header: bytes) -> tuple[str | None, str | None]:
    """(flavour, library type) of an OpenMP runtime, from the banners it embeds.

    `Intel(R) OMP version` or `LLVM OMP version` tells the two runtimes apart;
    `OMP library type:` says whether it is the runtime or the serial stub. A file with
    no version banner, (None, None), is no OpenMP runtime. Searched in a read-only
    mapping (no copy of the file): first in `.rodata`, where the banners are constants
    (0.1 ms instead of 0.6 for libiomp5.so, whose banner lies 2 MB in), then, should a
    build keep them elsewhere, the whole file up to FLAVOR_SCAN_LIMIT (the runtimes are
    1-3 MB; a huge file is not scanned to its end).
    """
    import mmap  # 0.4 ms, only once a candidate has passed the cheaper checks

    rodata = section_range(header, descriptor, b".rodata")
    with mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ) as mapped:
        for start, end in ([rodata] if rodata else []) + [(0, FLAVOR_SCAN_LIMIT)]:
            flavor = banner_flavor(mapped, start, end)
            if flavor is not None:
                return flavor, library_type(mapped, start, end)
    return None, None


def library_type(mapped: bytes | mmap.mmap, start: int, end: int) -> str | None:
    """The word after `OMP library type: ` between `start` and `end`, or None."""
    position = mapped.find(LIBRARY_TYPE, start, end)
    if position < 0:
        return None
    begin = position + len(LIBRARY_TYPE)
    return mapped[begin : begin + 32].split(b"\0", 1)[0].decode("ascii", "replace")


def banner_flavor(mapped: bytes | mmap.mmap, start: int, end: int) -> str | None:
    """The flavour of the first version banner between `start` and `end`."""
    longest = max(len(marker) for marker, _ in FLAVOR_MARKERS)
    position = mapped.find(BANNER, start, end)
    while position >= 0:
        around = mapped[max(0, position + len(BANNER) - longest) : position + len(BANNER)]
        for marker, flavor in FLAVOR_MARKERS:
            if around.endswith(marker):
                return flavor
        position = mapped.find(BANNER, position + 1, end)
    return None

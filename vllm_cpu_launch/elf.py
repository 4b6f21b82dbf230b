"""What a library file is: an ELF shared object for this machine, whole, and which
OpenMP runtime (Intel's or LLVM's) it is. Reads headers only; never loads the file."""

from __future__ import annotations

import os

FLAVOR_MARKERS = ((b"Intel(R) OMP version", "intel"), (b"LLVM OMP version", "llvm"))
BANNER = b" OMP version"  # what both markers end with
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
    elf_type = int.from_bytes(header[16:18], order)  # type: ignore[arg-type]
    elf_machine = int.from_bytes(header[18:20], order)  # type: ignore[arg-type]
    if elf_type != ELF_TYPE_SHARED:
        return f"an ELF file of type {elf_type}, not a shared object"
    wanted_machine = ELF_MACHINES.get(machine)
    if wanted_machine is not None and elf_machine != wanted_machine:
        built_for = ELF_MACHINE_NAMES.get(elf_machine, f"ELF machine {elf_machine}")
        return f"built for {built_for}; this host is {machine}"
    return None


PT_LOAD = 1


def elf_truncation(header: bytes, descriptor: int, size: int) -> str | None:
    """Why a fitting ELF file is cut short, or None when it is whole.

    Its header tables and every loadable segment must lie within the file: the loader
    maps them, and a truncated copy (an interrupted download or copy) is refused by the
    loader or dies of SIGBUS when the missing pages are touched. `header` is the ELF
    header (checked by elf_problem); the program headers are read from `descriptor`.
    """
    wide = header[4] == 2
    order = "little" if header[5] == 1 else "big"
    if len(header) < (64 if wide else 52):
        return f"a truncated ELF file ({size} bytes, shorter than its own header)"

    def number(data: bytes, offset: int, width: int) -> int:
        return int.from_bytes(data[offset : offset + width], order)  # type: ignore[arg-type]

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


def openmp_flavor(descriptor: int) -> str | None:
    """Intel's or LLVM's OpenMP runtime, told apart by their embedded version banner.

    Searched in a read-only mapping (no copy of the file), in one pass for the text the
    banners share, up to FLAVOR_SCAN_LIMIT: the runtimes are 1-3 MB; a huge file is
    not scanned to its end.
    """
    import mmap  # 0.4 ms, only once a candidate has passed the cheaper checks

    longest = max(len(marker) for marker, _ in FLAVOR_MARKERS)
    with mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ) as mapped:
        position = mapped.find(BANNER, 0, FLAVOR_SCAN_LIMIT)
        while position >= 0:
            start = max(0, position + len(BANNER) - longest)
            around = mapped[start : position + len(BANNER)]
            for marker, flavor in FLAVOR_MARKERS:
                if around.endswith(marker):
                    return flavor
            position = mapped.find(BANNER, position + 1, FLAVOR_SCAN_LIMIT)
    return None

"""The OpenMP runtime families, one module each (gnu, intel, llvm), behind one interface
(threadpoolctl's LibController the model): how a library of the family is recognised, where
the plan's search looks for it, what vLLM takes it for, what the plan may set for it and how
its fix is said. Every verb asks FAMILIES, never a file's name: a fourth family is one
`register` (tests/test_runtimes.py adds one in a test alone)."""

from __future__ import annotations

from typing import ClassVar


class Family:
    """An OpenMP runtime family: a library's kind where it is one (trust.identify)."""

    value: ClassVar[str]  # the library's kind in the JSON of verify and doctor (Library's too)
    word: ClassVar[str]  # its flavour: the plan's and doctor's word, and /metrics' (inside.py)
    title: ClassVar[str]
    sonames: ClassVar[tuple[str, ...]] = ()  # DT_SONAME less `.so...` and a wheel's `-HASH`
    prefixes: ClassVar[tuple[str, ...]] = ()  # its files' names: only where no ELF is read
    banner: ClassVar[bytes] = b""  # the 'OMP version' banner it embeds (b"": none)
    kmp: ClassVar[bool] = False  # Intel's interface (KMP_* variables, KMP_BLOCKTIME planned)
    # The texts of LD_PRELOAD by which vLLM takes a runtime for this one (use_iomp, use_gomp
    # in vllm/utils/ompmultiprocessing.py): a directory's name counts, as vLLM tests.
    vllm_names: ClassVar[tuple[str, ...]] = ()
    files: ClassVar[tuple[str, ...]] = ()  # the names the plan's search looks for
    wheel: ClassVar[str] = ""  # the pip distribution that holds it: searched, and its fix
    machines: ClassVar[tuple[str, ...]] = ()  # where the plan preloads it for SD unasked
    opt_in: ClassVar[tuple[str, ...]] = ()  # where only `--iomp always` preloads it
    stand_in: ClassVar[bool] = False  # taken only where no other is found, by a rule
    runtime: ClassVar[bool] = True
    allocator: ClassVar[bool] = False

    def named(self, name: str) -> bool:
        """Whether a file's name is this family's, where no ELF file of it can be read."""
        return name.startswith(self.prefixes)

    def __repr__(self) -> str:
        return f"<runtime family {self.value}>"


FAMILIES: list[Family] = []  # the registry, in order of preference (Intel's first)


def register(family: Family) -> Family:
    FAMILIES.append(family)
    return family


def by_soname(soname: str) -> Family | None:
    stem = soname.partition(".so")[0].partition("-")[0]
    return next((f for f in FAMILIES if stem in f.sonames), None)


def by_name(name: str) -> Family | None:
    return next((f for f in FAMILIES if f.named(name)), None)


def by_kind(kind: str) -> Family | None:
    return next((f for f in FAMILIES if f.value == kind), None)


def by_word(word: str | None) -> Family | None:
    """The family of a flavour (its word, as a search's candidates carry it)."""
    return next((f for f in FAMILIES if f.word == word), None)


def vllm_reads(ld_preload: str) -> frozenset[Family]:
    """The runtimes vLLM finds in an LD_PRELOAD text, by its substring tests."""
    return frozenset(f for f in FAMILIES if any(n in ld_preload for n in f.vllm_names))


def vllm_reads_kmp(ld_preload: str) -> bool:
    """Whether vLLM takes LD_PRELOAD to name Intel OpenMP (and sets KMP_* for it)."""
    return any(f.kmp for f in vllm_reads(ld_preload))


def vllm_reads_gnu(ld_preload: str) -> bool:
    """Whether vLLM takes LD_PRELOAD to name GNU OpenMP (beside Intel's: it refuses to start)."""
    return any(not f.kmp for f in vllm_reads(ld_preload))


def preloaded_on(machine: str) -> bool:
    """Whether the plan preloads a runtime for SD on this machine unasked."""
    return any(machine in f.machines for f in FAMILIES)


def opt_in_on(machine: str) -> bool:
    """Whether only `--iomp always` preloads a runtime on this machine."""
    return any(machine in f.opt_in for f in FAMILIES)


def wanted_on(machine: str) -> Family:
    """The family the plan preloads on this machine: unasked, else opted in; else Intel's."""
    unasked = next((f for f in FAMILIES if machine in f.machines), None)
    return unasked or next((f for f in FAMILIES if machine in f.opt_in), FAMILIES[0])


def preloadable() -> tuple[Family, ...]:
    """The families the plan's search may preload in Intel OpenMP's place (KMP ones)."""
    return tuple(f for f in FAMILIES if f.kmp)


def rank(family: Family | None) -> int:
    return FAMILIES.index(family) if family in FAMILIES else len(FAMILIES)


from vllm_cpu_launch.runtimes import gnu, intel, llvm  # noqa: E402  (they need Family)

INTEL: Family = register(intel.FAMILY)
LLVM: Family = register(llvm.FAMILY)
GNU: Family = register(gnu.FAMILY)

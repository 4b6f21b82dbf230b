"""The OpenMP runtime families, one module each (gnu, intel, llvm), behind one interface
(threadpoolctl's LibController the model): how a library of the family is recognised, where
the plan's search looks for it, what vLLM takes it for, what the plan may set for it and how
its fix is said. Every verb asks FAMILIES, never a file's name: a fourth family is one
`register` (tests/test_runtimes.py adds one in a test alone)."""

from __future__ import annotations

from vllm_cpu_launch.runtimes import gnu, intel, llvm
from vllm_cpu_launch.runtimes.family import Family

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


INTEL: Family = register(intel.FAMILY)
LLVM: Family = register(llvm.FAMILY)
GNU: Family = register(gnu.FAMILY)

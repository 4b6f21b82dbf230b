"""Every state renders, in every output (issue 17): real processes of the launcher.

The target the launcher would start, in each state it can be in (found; its venv moved
with `mv`; without the x bit; owned by another user; missing, on PATH or as a --vllm
path; without a readable vLLM version), is crossed with each state of the libiomp5.so
in its environment (Intel's from the intel-openmp wheel; none; refused for trust; not an
ELF file; LLVM's from Debian's package; Intel's serial stub and debugger library from
the wheel). Each pair goes through doctor, --dry-run (and with --strict), env in every
format, systemd-unit and, where the target can start, a real start checked by verify,
in text and JSON. Then a few environments the real installers made (tests/installers.py)
go through the same. Every output: no traceback, the exit code docs/design.md gives, and
the text shows each fact of the JSON (tests/render_facts.py).

The launcher is the one pipx installs from this checkout (tests/installers.py), whose own
venv has no intel-openmp: the environment's library is the only candidate there is, so
each library state is what the launcher sees. The runs of the module are made once, four
at a time, and the tests read them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch.errors import (
    EXIT_LIBRARY_MISSING,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_PROBLEM,
)
from vllm_cpu_launch.verbs.env import FORMATS

from .conftest import NOBODY, SystemHost, clean_environ, install_recorder, run_launcher
from .installers import LAYOUTS, SD, Installed, offline
from .render_facts import (
    READERS,
    doctor_facts,
    missing_facts,
    plan_facts,
    says_why,
    verify_facts,
)
from .test_systemd_unit import systemd_words

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 intel-openmp")

PREFIX = "vllm-cpu-launch: "
ERROR = PREFIX + "error: "
WARNING = PREFIX + "warning: "
VERSION = "0.32.0+cpu"
# Where the text of doctor and its JSON come from two runs, the memory free may differ.
VOLATILE = (("memory", "available"),)
# Before the recorder: a start that verify is to check waits (stdin) until it is done.
HOLD = """\
import os, sys
if os.environ.get("HOLD"):
    print("ready", flush=True)
    sys.stdin.read()
"""

# ---------------------------------------------------------------- the outputs

# Each output: the launcher's words after those naming the target.
OUTPUTS: dict[str, list[str]] = {
    "doctor": ["doctor"],
    "doctor --json": ["doctor", "--json"],
    "--dry-run": ["--dry-run", *SD],
    "--dry-run --json": ["--dry-run", "--json", *SD],
    "--strict --dry-run": ["--strict", "--dry-run", *SD],
    "--strict --dry-run --json": ["--strict", "--dry-run", "--json", *SD],
    **{f"env --format {f}": ["env", "--format", f, *SD] for f in FORMATS},
    # --user: the trees lie under /tmp, which a unit without it cannot reach (exit 2).
    "systemd-unit": ["systemd-unit", "--user", "vllm", *SD],
}


@dataclass(frozen=True)
class Expect:
    """What docs/design.md says of a state: the exit code of a start of the target
    (None: it starts), whether as root --strict refuses it, and whether the library
    in its environment is one to preload."""

    error: int | None
    unsafe: bool
    usable: bool


def expected_exit(output: str, expect: Expect) -> int:
    """doctor explains and systemd-unit writes the unit whatever the state (a target
    that cannot start is warned about); the plan's outputs fail as a start would."""
    if output.startswith(("doctor", "systemd-unit")):
        return 0
    if expect.error is not None:
        return expect.error
    if output.startswith("--strict") and expect.unsafe:
        return EXIT_NOT_EXECUTABLE
    if output.startswith("--strict") and not expect.usable:
        return EXIT_LIBRARY_MISSING
    return 0


# ---------------------------------------------------------------- target states

Library = Callable[[Path], None]  # puts a library state into an environment's lib/


def venv(root: Path, library: Library, version: bool = True) -> Path:
    """A real venv (`python -m venv`) with a recording `vllm` as pip writes it, vLLM's
    dist-info (with its METADATA, or without, so no version can be read) and `library`."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
    )
    vllm = install_recorder(root)
    shebang, _, body = vllm.read_text().partition("\n")
    vllm.write_text(f"{shebang}\n{HOLD}{body}")
    (site,) = (root / "lib").glob("python3.*/site-packages")
    dist_info = site / f"vllm-{VERSION}.dist-info"
    dist_info.mkdir()
    if version:
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n"
        )
    library(root / "lib")
    return vllm


def moved(root: Path, library: Library) -> Path:
    venv(root / "before", library)
    subprocess.run(["mv", str(root / "before"), str(root / "after")], check=True, timeout=60)
    return root / "after" / "bin" / "vllm"


def not_executable(root: Path, library: Library) -> Path:
    vllm = venv(root, library)
    vllm.chmod(0o644)
    return vllm


def other_users(root: Path, library: Library) -> Path:
    """The venv of another user (uid 65534), started by root."""
    vllm = venv(root, library)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(root)], check=True, timeout=60)
    return vllm


@dataclass(frozen=True)
class TargetState:
    make: Callable[[Path, Library], Path | None]  # the --vllm path; None: search PATH
    error: int | None = None
    unsafe: bool = False


TARGETS: dict[str, TargetState] = {
    "found": TargetState(venv),
    "moved-venv": TargetState(moved, EXIT_NOT_EXECUTABLE),
    "not-executable": TargetState(not_executable, EXIT_NOT_EXECUTABLE),
    "other-user": TargetState(other_users, unsafe=True),
    "missing-on-path": TargetState(lambda root, library: None, EXIT_NOT_FOUND),
    "missing-path": TargetState(lambda root, library: root / "absent" / "vllm", EXIT_NOT_FOUND),
    "no-version": TargetState(lambda root, library: venv(root, library, version=False)),
}
ROOT_ONLY = {"other-user"}  # chown needs root; as root its trust warning is what it shows

# ---------------------------------------------------------------- library states


@dataclass(frozen=True)
class Sources:
    """Where the real libraries come from: the intel-openmp wheel's lib/ and the
    Debian tree unpacked from the real packages (conftest.py)."""

    wheel: Path
    debian: Path


def copied(name: str) -> Callable[[Sources, Path], None]:
    """libiomp5.so: a copy of the wheel's `name`, or a link to a copy beside it (as the
    wheel ships the stub and debugger library: real files, not to be preloaded)."""

    def place(sources: Sources, lib: Path) -> None:
        shutil.copy2(sources.wheel / name, lib / name)
        if name != "libiomp5.so":
            (lib / "libiomp5.so").symlink_to(name)

    return place


def refused_for_trust(sources: Sources, lib: Path) -> None:
    copied("libiomp5.so")(sources, lib)
    (lib / "libiomp5.so").chmod(0o646)  # writable by others: refused as root and not


def not_elf(sources: Sources, lib: Path) -> None:
    (lib / "libiomp5.so").write_text("/* GNU ld script */\nINPUT(libiomp5.so.1)\n")


def llvm(sources: Sources, lib: Path) -> None:
    """Debian's way: libiomp5.so is a link to LLVM's libomp.so.5."""
    (lib / "libiomp5.so").symlink_to(sources.debian / "usr/lib/llvm-14/lib/libomp.so.5")


@dataclass(frozen=True)
class LibraryState:
    place: Callable[[Sources, Path], None]
    usable: bool


LIBRARIES: dict[str, LibraryState] = {
    "intel": LibraryState(copied("libiomp5.so"), True),
    "none": LibraryState(lambda sources, lib: None, False),
    "refused-for-trust": LibraryState(refused_for_trust, False),
    "not-elf": LibraryState(not_elf, False),
    "llvm": LibraryState(llvm, True),
    "intel-stub": LibraryState(copied("libiompstubs5.so"), False),
    "intel-debugger": LibraryState(copied("libiomp5_db.so"), False),
}
# A target that cannot start is refused before any library is looked for (--dry-run,
# env), and doctor has no environment to look in: its library state cannot show, so
# one state stands for all there.
CELLS = [
    (target, library)
    for target, state in TARGETS.items()
    for library in (LIBRARIES if state.error is None else ["intel"])
]

# ---------------------------------------------------------------- running


Runs = dict[str, subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Started:
    """A real start through the launcher, held while verify looked at it."""

    pid: int
    record: dict[str, Any]  # what the started vLLM got (conftest.RECORDER)
    verify: Runs


def start_and_verify(
    launcher: list[str], naming: list[str], environ: dict[str, str], record: Path
) -> Started:
    """Start the target for real (the launcher execs it), verify it in text and JSON
    while it waits, then let it finish."""
    variables = {**environ, "HOLD": "1", "RECORD_TO": str(record)}
    process = subprocess.Popen(
        [*launcher, "-q", *naming, *SD],
        env=variables,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with process:  # on the way out its stdin is closed: it records and exits
        assert process.stdout is not None
        ready = process.stdout.readline() == "ready\n"
        verify = {
            name: run_launcher([*words, str(process.pid)], environ, launcher)
            for name, words in (("verify", ["verify"]), ("verify --json", ["verify", "--json"]))
            if ready
        }
        _, errors = process.communicate(timeout=120)
    assert ready, errors
    return Started(process.pid, json.loads(record.read_text()), verify)


def run_outputs(
    pool: ThreadPoolExecutor, launcher: list[str], naming: list[str], environ: dict[str, str]
) -> Callable[[], Runs]:
    """Every output for one state, run in the pool; call the result for the runs."""
    futures = {
        name: pool.submit(run_launcher, [*naming, *words], environ, launcher)
        for name, words in OUTPUTS.items()
    }
    return lambda: {name: future.result() for name, future in futures.items()}


@dataclass(frozen=True)
class Cell:
    expect: Expect
    runs: Runs
    started: Started | None


@pytest.fixture(scope="module")
def matrix(
    tmp_path_factory: pytest.TempPathFactory,
    pipx_launcher: list[str],
    real_iomp: Path,
    debian_root: Path,
) -> dict[tuple[str, str], Cell]:
    sources = Sources(real_iomp.parent, debian_root)
    pending = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for target_name, library_name in CELLS:
            target, library = TARGETS[target_name], LIBRARIES[library_name]
            if target_name in ROOT_ONLY and os.geteuid() != 0:
                continue
            root = tmp_path_factory.mktemp(f"{target_name}-{library_name}")
            vllm = target.make(root / "env", partial(library.place, sources))
            naming = ["--vllm", str(vllm)] if vllm else []
            environ = clean_environ(root, PATH="/usr/bin:/bin", VLLM_CPU_KVCACHE_SPACE="1")
            runs = run_outputs(pool, pipx_launcher, naming, environ)
            started = None
            if target.error is None:
                record = root / "record.json"
                started = pool.submit(start_and_verify, pipx_launcher, naming, environ, record)
            expect = Expect(target.error, target.unsafe and os.geteuid() == 0, library.usable)
            pending[target_name, library_name] = (expect, runs, started)
        return {
            key: Cell(expect, runs(), started.result() if started else None)
            for key, (expect, runs, started) in pending.items()
        }


def cell_of(matrix: Mapping[tuple[str, str], Cell], target: str, library: str) -> Cell:
    if (target, library) not in matrix:
        pytest.skip(f"{target} needs root (chown to another user)")
    return matrix[target, library]


# ---------------------------------------------------------------- the checks


def check_streams(name: str, result: subprocess.CompletedProcess[str], code: int) -> None:
    """No traceback, the launcher's lines only, the exit code; an error is its last line
    with nothing on stdout."""
    assert "Traceback" not in result.stderr, (name, result.stderr)
    assert (name, result.returncode) == (name, code), result.stderr
    for line in result.stderr.splitlines():
        assert line.startswith(PREFIX), (name, line)
    if code > EXIT_PROBLEM:
        assert result.stdout == "", (name, result.stdout)
        assert result.stderr.splitlines()[-1].startswith(ERROR), (name, result.stderr)


def error_of(result: subprocess.CompletedProcess[str]) -> str:
    return result.stderr.splitlines()[-1].removeprefix(ERROR)


def check_doctor(runs: Runs, expect: Expect) -> None:
    report = json.loads(runs["doctor --json"].stdout)
    missing = missing_facts(doctor_facts(report, VOLATILE), runs["doctor"].stdout)
    assert missing == [], runs["doctor"].stdout
    section = report["vllm"]
    # Not found (127) is the one state doctor reports as not found.
    assert section["found"] is (expect.error != EXIT_NOT_FOUND), section
    if expect.error is not None:
        assert section["error"] == error_of(runs["--dry-run"]), section


def check_plan(runs: Runs, expect: Expect) -> None:
    """--dry-run's text against its JSON, with and without --strict; a refusal is the
    same lines whichever form was asked for."""
    for strict in ("", "--strict "):
        text, as_json = runs[f"{strict}--dry-run"], runs[f"{strict}--dry-run --json"]
        if text.returncode != 0:
            assert text.stderr == as_json.stderr
            continue
        plan = json.loads(as_json.stdout)
        assert missing_facts(plan_facts(plan), text.stdout) == [], text.stdout
        assert bool(plan["preload"]) is expect.usable, plan


def check_env(runs: Runs, expect: Expect) -> None:
    """Each format exports the plan's variables, and says the plan's warnings and why on
    stderr; a refusal is the same whatever the format."""
    first = runs[f"env --format {FORMATS[0]}"]
    for output_format in FORMATS:
        result = runs[f"env --format {output_format}"]
        assert result.stderr == first.stderr, output_format
        if expect.error is not None:
            assert result.stderr == runs["--dry-run"].stderr
            continue
        plan = json.loads(runs["--dry-run --json"].stdout)
        exported = dict(plan["env"])  # the mark too: every format carries it (issue 36)
        assert READERS[output_format](result.stdout) == exported, result.stdout
        assert exported or says_why(result.stdout, plan["reason"]), result.stdout
        lines = result.stderr.splitlines()
        for warning in plan["warnings"]:
            assert WARNING + warning in lines, (warning, result.stderr)
        assert plan["reason"] in result.stderr  # the INFO line's why
    if expect.error is None:
        assert json.loads(runs["env --format json"].stdout) == json.loads(
            runs["--dry-run --json"].stdout
        )


def check_systemd_unit(runs: Runs, expect: Expect) -> None:
    """The unit pins the target it names; what the plan warns of, or why the target
    cannot start, is a warning at generation time."""
    result = runs["systemd-unit"]
    assert result.stdout.startswith("# vllm-cpu-launch.service"), result.stdout
    lines = result.stderr.splitlines()
    (exec_start,) = (ln for ln in result.stdout.splitlines() if ln.startswith("ExecStart="))
    words = systemd_words(exec_start.removeprefix("ExecStart="))
    if expect.error is not None:
        failure = error_of(runs["--dry-run"])
        assert f"{WARNING}{failure}; the service will fail to start until this is fixed" in lines
        return
    plan = json.loads(runs["--dry-run --json"].stdout)
    for warning in plan["warnings"]:
        assert WARNING + warning in lines, (warning, result.stderr)
    index = words.index("--vllm")
    assert words[index + 1] == plan["command"][0], words


def check_verify(cell: Cell, plan: dict[str, Any]) -> None:
    """A real start: it got the plan's LD_PRELOAD, and verify says so in both forms
    (exit 1 where no library could be preloaded)."""
    assert cell.started is not None
    record, runs = cell.started.record, cell.started.verify
    assert record["LD_PRELOAD"] == plan["env"].get("LD_PRELOAD"), record
    code = 0 if cell.expect.usable else EXIT_PROBLEM
    for name, result in runs.items():
        check_streams(name, result, code)
    report = json.loads(runs["verify --json"].stdout)
    assert missing_facts(verify_facts(report), runs["verify"].stdout) == [], runs["verify"].stdout
    (root,) = (p for p in report["processes"] if p["pid"] == cell.started.pid)
    mapped = [runtime["path"] for runtime in root["runtimes"]]
    assert mapped == [os.path.realpath(p["path"]) for p in plan["preload"]], root


def check_all(runs: Runs, expect: Expect) -> None:
    for name, result in runs.items():
        check_streams(name, result, expected_exit(name, expect))
    check_doctor(runs, expect)
    check_plan(runs, expect)
    check_env(runs, expect)
    check_systemd_unit(runs, expect)


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize(("target", "library"), CELLS)
def test_every_output_of_every_state(
    matrix: dict[tuple[str, str], Cell], target: str, library: str
) -> None:
    cell = cell_of(matrix, target, library)
    check_all(cell.runs, cell.expect)
    if cell.started is not None:
        check_verify(cell, json.loads(cell.runs["--dry-run --json"].stdout))


@pytest.mark.parametrize(("target", "library"), CELLS)
def test_doctor_and_the_plan_judge_the_library_alike(
    matrix: dict[tuple[str, str], Cell], target: str, library: str
) -> None:
    """The library in the environment has one verdict and one reason, wherever shown."""
    cell = cell_of(matrix, target, library)
    if cell.expect.error is not None:
        return
    report = json.loads(cell.runs["doctor --json"].stdout)
    plan = json.loads(cell.runs["--dry-run --json"].stdout)
    judged = {
        (c["path"], c["verdict"], c["reason"]) for c in report["libraries"]["iomp"]["candidates"]
    }
    for candidate in plan["candidates"]:
        if candidate["kind"] == "iomp":
            assert (candidate["path"], candidate["verdict"], candidate["reason"]) in judged


# ---------------------------------------------------------------- installers' environments

# Wrapper forms, one each: pip's /bin/sh trampoline (long path), uv's relative
# trampoline, pipx's link into its own venv, conda's `#!/usr/bin/env python3.N`.
CONFORMANCE = ("pip-venv-long-path", "uv-relocatable", "pipx", "conda-long-prefix-env-shebang")


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path
) -> Iterator[dict[str, tuple[Installed, dict[str, str]]]]:
    """Each layout as its installer makes it, without intel-openmp (placed by the tests
    where the installer puts it), and the environment that finds it on PATH."""
    roots = {layout: tmp_path_factory.mktemp(layout) for layout in CONFORMANCE}
    for root in roots.values():
        (root / "home").mkdir()

    def install(layout: str) -> tuple[Installed, dict[str, str]]:
        environ = offline(clean_environ(roots[layout]), wheelhouse)
        where, installer = LAYOUTS[layout]
        made = installer(roots[layout] / where, environ, False)
        environ.update(made.environ, VLLM_CPU_KVCACHE_SPACE="1")
        environ["PATH"] = f"{made.vllm.parent}:{environ['PATH']}"
        return made, environ

    with ThreadPoolExecutor(max_workers=2) as pool:
        yield dict(zip(CONFORMANCE, pool.map(install, CONFORMANCE), strict=True))
    for root in roots.values():  # intel-openmp-sized environments: drop them now
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def layouts(
    installed: dict[str, tuple[Installed, dict[str, str]]],
    pipx_launcher: list[str],
    real_iomp: Path,
) -> dict[tuple[str, str], Runs]:
    """Every output for each layout without a library, then with Intel's in its place."""
    results: dict[tuple[str, str], Runs] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for library in ("none", "intel"):
            if library == "intel":
                for made, _ in installed.values():
                    made.library.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(real_iomp, made.library)
            waiting = {
                layout: run_outputs(pool, pipx_launcher, [], environ)
                for layout, (_, environ) in installed.items()
            }
            results.update({(layout, library): runs() for layout, runs in waiting.items()})
    return results


@pytest.mark.parametrize("library", ["none", "intel"])
@pytest.mark.parametrize("layout", CONFORMANCE)
def test_every_output_of_an_installers_environment(
    layouts: dict[tuple[str, str], Runs],
    installed: dict[str, tuple[Installed, dict[str, str]]],
    layout: str,
    library: str,
    system_host: SystemHost,
) -> None:
    runs = layouts[layout, library]
    check_all(runs, Expect(None, False, library == "intel"))
    plan = json.loads(runs["--dry-run --json"].stdout)
    made, _ = installed[layout]
    assert [p["path"] for p in plan["preload"]] == (
        system_host.preload(made.library).split(":") if library == "intel" else []
    )

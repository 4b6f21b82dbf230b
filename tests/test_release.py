"""What is published (issue 48, docs/releasing.md): the long description PyPI shows, the
version and the vLLM window it names, the changelog, the workflows that test and publish,
and the built sdist and wheel, installed by pip, uv and pipx, and by the README's "Once
published" lines from a local index holding them. The artefacts are scripts/dist_check's
(built once by scripts/test, VLLMCPULAUNCH_DIST), else built here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import yaml
from pypi_readme import RELATIVE, pypi_readme, source_url

import vllm_cpu_launch
from vllm_cpu_launch.gather import FIRST, LAST

from .conftest import REPO, clean_environ, run_launcher
from .installers import SD, chosen_iomp, offline, run_tool

INSTALLED = os.environ.get("VLLMCPULAUNCH_TEST_INSTALLED") == "1"  # scripts/dist_check test
WORKFLOWS = REPO / ".github" / "workflows"
PINNED = re.compile(r"^\s*(?:- )?uses: [\w.-]+/[\w.-]+@[0-9a-f]{40} # v\d[\w.]*$")
PLUGIN = "vllm_cpu_launch = vllm_cpu_launch.plugin:register"


def read(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def test_the_package_under_test_is_the_installed_one_when_the_artefact_is_tested() -> None:
    """From scripts/dist_check's unpacked sdist the tests, and the launchers they start (with
    the tests' PYTHONPATH), import the wheel pip installed; from a checkout, the checkout's."""
    started = subprocess.run(
        [sys.executable, "-c", "import vllm_cpu_launch; print(vllm_cpu_launch.__file__)"],
        env=clean_environ(REPO / "no-such-dir"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for imported in (Path(vllm_cpu_launch.__file__), Path(started.stdout.strip()).resolve()):
        if INSTALLED:
            assert imported.is_relative_to(sysconfig.get_paths()["purelib"]), imported
            assert not (REPO / "vllm_cpu_launch").exists()
        else:
            assert imported.is_relative_to(REPO), imported


def test_pypis_long_description_is_the_readme_with_links_to_the_release() -> None:
    """README.pypi.md is what scripts/pypi_readme.py makes of README.md (run it after either
    changes): no relative link left, each pointing at this version's tag."""
    source = source_url(read("setup.cfg"))
    version = vllm_cpu_launch.__version__
    published = read("README.pypi.md")
    assert published == pypi_readme(read("README.md"), source, version)
    assert RELATIVE.search(published) is None
    links = re.findall(r"\]\((https?://[^)\s]+)\)", published)
    ours = [link for link in links if link.startswith(f"{source}/")]
    assert len(ours) >= len(RELATIVE.findall(read("README.md"))) > 0
    assert all(link.startswith(f"{source}/blob/v{version}/") for link in ours)


def test_the_version_names_the_vllm_window_of_docs_releases() -> None:
    (first, last) = re.findall(
        r"\*\*Window: (\d+\.\d+)\.\d+ to (\d+\.\d+)\.\d+\*\*", read("docs/releases.md")
    )[0]
    result = run_launcher(["--version"], clean_environ(REPO / "no-such-dir"))
    expected = f"vllm-cpu-launch {vllm_cpu_launch.__version__} (vLLM {first} to {last} supported)"
    assert (result.returncode, result.stdout.strip()) == (0, expected), result.stderr


def test_the_changelog_leads_with_this_version_and_its_vllm_window() -> None:
    """docs/releasing.md's policy: each release's section names the window it supports, so
    a change of the window (a minor release) is a change of the changelog."""
    sections = re.split(r"^## ", read("CHANGELOG.md"), flags=re.M)[1:]
    versions = [section.split(maxsplit=1)[0] for section in sections]
    assert versions[0] == vllm_cpu_launch.__version__
    assert versions == sorted(versions, key=lambda v: [int(p) for p in v.split(".")], reverse=True)
    assert f"vLLM {FIRST} to {LAST}" in sections[0]
    assert all(re.search(r"^- ", section, re.M) for section in sections)


def quick_tier(script: str) -> str:
    (quick,) = re.findall(r'^QUICK="([^"]+)"$', read(script), re.M)
    return str(quick)


def test_the_artefact_is_tested_on_the_quick_tier_of_scripts_test() -> None:
    assert quick_tier("scripts/dist_check") == quick_tier("scripts/test")


def workflow(name: str) -> dict[str, object]:
    loaded: dict[str, object] = yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))
    return loaded


def runs(name: str) -> list[str]:
    jobs = workflow(name)["jobs"]
    assert isinstance(jobs, dict)
    return [step["run"] for job in jobs.values() for step in job["steps"] if "run" in step]


def test_every_action_is_pinned_by_commit_with_its_tag_beside_it() -> None:
    lines = [
        line
        for path in sorted(WORKFLOWS.glob("*.yml"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if "uses:" in line
    ]
    assert len(lines) >= 7
    assert [line for line in lines if not PINNED.match(line)] == []


def test_ci_runs_the_readmes_test_command_and_release_what_releasing_says() -> None:
    """ci.yml runs .ci/run; release.yml runs docs/releasing.md's check commands, and
    publishes by trusted publishing with attestations from the protected environment."""
    assert ".ci/run" in runs("ci.yml")
    steps = re.findall(r"^\s*(scripts/dist_check \w+ dist)$", read("docs/releasing.md"), re.M)
    assert steps == ["scripts/dist_check build dist", "scripts/dist_check test dist"]
    assert [f"PYTHON=python {step}" for step in steps] == [
        run for run in runs("release.yml") if "dist_check" in run
    ]
    publish = workflow("release.yml")["jobs"]["publish"]  # type: ignore[index]
    assert publish["environment"]["name"] == "pypi"
    assert publish["permissions"] == {"id-token": "write"}
    (upload,) = (s for s in publish["steps"] if "gh-action-pypi-publish" in s["uses"])
    assert upload["with"] == {"attestations": True}


# ------------------------------------------------- the built artefacts (scripts/dist_check build)


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = os.environ.get("VLLMCPULAUNCH_DIST")
    if built:
        return Path(built)
    directory = tmp_path_factory.mktemp("release") / "dist"
    environ = {**os.environ, "PYTHON": sys.executable}
    run_tool([str(REPO / "scripts" / "dist_check"), "build", str(directory)], environ)
    return directory


def artefact(dist: Path, pattern: str) -> Path:
    (found,) = dist.glob(pattern)
    return found


@pytest.mark.installers
def test_the_sdist_is_the_tracked_tree(dist: Path) -> None:
    """MANIFEST.in: the tests and every file they read are in the sdist (scripts/dist_check
    runs them from it), and nothing that is not the repository's."""
    if not (REPO / ".git").exists():
        pytest.skip("no git checkout to compare with (an unpacked sdist)")
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    with tarfile.open(artefact(dist, "*.tar.gz")) as sdist:
        names = [m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile()]
    made = {"PKG-INFO", "setup.cfg"} | {n for n in names if ".egg-info/" in n}
    assert set(names) - made == set(tracked) - {"setup.cfg"}


def installed_launcher_checks(bin_directory: Path, vllm_env: Path, tmp_path: Path) -> None:
    """The installed launcher's --version, its plan for an SD serve of a vLLM-like
    environment holding the real libiomp5, and the plugin's entry point, loaded."""
    environ = clean_environ(tmp_path)
    del environ["PYTHONPATH"]  # the installed package, not the checkout's
    launcher = [str(bin_directory / "vllm-cpu-launch")]
    version = run_launcher(["--version"], environ, launcher)
    assert version.stdout.startswith(f"vllm-cpu-launch {vllm_cpu_launch.__version__} ("), version
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), *SD]
    plan = run_launcher(args, environ, launcher)
    assert plan.returncode == 0, plan.stderr
    assert chosen_iomp(json.loads(plan.stdout))["path"] == str(vllm_env / "lib" / "libiomp5.so")
    code = (
        "import vllm_cpu_launch; from importlib.metadata import entry_points as e; "
        "(p,) = e(group='vllm.general_plugins', name='vllm_cpu_launch'); p.load(); "
        "print(p.name, '=', p.value); print(vllm_cpu_launch.__file__)"
    )
    python = str(bin_directory / "python")
    loaded = run_tool([python, "-c", code], environ, cwd=tmp_path).splitlines()  # not the checkout
    assert loaded[0] == PLUGIN
    assert Path(loaded[1]).is_relative_to(bin_directory.parent), loaded


@pytest.fixture(scope="session")
def local_index(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that serves as the index: the artefacts, every dependency of the wheel
    with both OpenMP extras, and setuptools to build the sdist, downloaded by pip."""
    index = tmp_path_factory.mktemp("release") / "index"
    wheel = artefact(dist, "*.whl")
    download = [sys.executable, "-m", "pip", "download", "-q", "-d", str(index)]
    run_tool([*download, f"{wheel}[iomp,llvm-openmp]", "setuptools>=77"], os.environ)
    for built in dist.iterdir():
        (index / built.name).unlink(missing_ok=True)
        (index / built.name).symlink_to(built)
    return index


def once_published_lines() -> list[str]:
    """The install commands of the README's "Once published" paragraph, as written."""
    (paragraph,) = re.findall(r"^Once published: (.+?)\n\n", read("README.md"), re.M | re.S)
    return re.findall(r"`(pipx? install [^`]+)`", " ".join(paragraph.split()))


def bin_of(line: str, root: Path) -> Path:
    """Where an install line's environment keeps its scripts and Python."""
    pipx = line.startswith("pipx ")
    return root / "pipx" / "venvs" / "vllm-cpu-launch" / "bin" if pipx else root / "venv" / "bin"


@pytest.mark.installers
@pytest.mark.parametrize("number", range(4))
def test_the_readmes_once_published_lines_install_from_a_local_index(
    number: int, local_index: Path, vllm_env: Path, tmp_path: Path
) -> None:
    """Each line run as written, pip and pipx reading the local index (PIP_NO_INDEX,
    PIP_FIND_LINKS) in a fresh venv whose pip is first on PATH: the launcher works, and an
    OpenMP extra brings its runtime."""
    lines = once_published_lines()
    assert [line.split(maxsplit=2)[:2] for line in lines] == [
        ["pip", "install"],
        ["pipx", "install"],
        ["pip", "install"],
        ["pip", "install"],
    ]
    line = lines[number]
    run_tool([sys.executable, "-m", "venv", str(tmp_path / "venv")], os.environ)
    environ = offline(clean_environ(tmp_path), local_index)
    environ["PATH"] = f"{tmp_path / 'venv' / 'bin'}:{environ['PATH']}"
    environ.update(PIPX_HOME=str(tmp_path / "pipx"), PIPX_BIN_DIR=str(tmp_path / "pipx-bin"))
    del environ["PYTHONPATH"]
    run_tool(["bash", "-ec", line], environ)
    installed = bin_of(line, tmp_path)
    installed_launcher_checks(installed, vllm_env, tmp_path)
    # Where each extra's wheel puts its runtime: intel-openmp in the environment's lib/,
    # cmeel-libomp in its prefix in site-packages.
    runtimes = {"[iomp]": "lib/libiomp5.so", "[llvm-openmp]": "lib/*/*/cmeel.prefix/lib/libomp.so"}
    for extra, library in runtimes.items():
        found = list(installed.parent.glob(library))
        assert len(found) == (extra in line), (line, found)


@pytest.mark.installers
@pytest.mark.parametrize("installer", ["pip-sdist", "uv-wheel"])
def test_the_sdist_installs_with_pip_and_the_wheel_with_uv(
    installer: str, dist: Path, local_index: Path, vllm_env: Path, tmp_path: Path
) -> None:
    """The sdist, built into a wheel by pip (setuptools from the local index), and the wheel
    by uv, each into a fresh venv: the same launcher and plugin."""
    venv = tmp_path / "venv"
    environ = offline(clean_environ(tmp_path), local_index)
    del environ["PYTHONPATH"]
    if installer == "pip-sdist":
        run_tool([sys.executable, "-m", "venv", str(venv)], environ)
        run_tool([str(venv / "bin" / "pip"), "install", str(artefact(dist, "*.tar.gz"))], environ)
    else:
        run_tool(["uv", "venv", "--python", sys.executable, str(venv)], environ)
        wheel = str(artefact(dist, "*.whl"))
        run_tool(["uv", "pip", "install", "--python", str(venv / "bin" / "python"), wheel], environ)
    installed_launcher_checks(venv / "bin", vllm_env, tmp_path)

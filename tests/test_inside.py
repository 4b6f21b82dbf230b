"""The plugin's reading from inside a process and its series on /metrics
(vllm_cpu_launch/inside.py), in real processes with real OpenMP runtimes.

Each reading is taken in a fresh interpreter with the runtime preloaded, as vLLM's engine
core and workers get it: the intel-openmp wheel's libiomp5, Debian's LLVM libomp, the
system's libgomp (the one gcc links `-fopenmp` code to), or none. The publishing runs a
front end that spawns a child with multiprocessing, as vLLM does; vLLM's worker class
cannot be real here, so a stand-in `vllm.v1.worker.worker_base` has the one method the
plugin wraps (the real one: tests/e2e/test_real_weights.py). The front end's series is what
prometheus_client's default registry renders, which is what vLLM's /metrics serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import clean_environ
from vllm_cpu_launch.inside import READINGS_VARIABLE

READ = """\
import json
from vllm_cpu_launch.inside import Role, read_openmp
print(json.dumps(vars(read_openmp(Role.WORKER))))
"""
# vLLM's worker module as far as the plugin touches it: init_device, which sets the
# worker's threads up (here: a variable the reading then shows).
WORKER_BASE = """\
import os
class WorkerWrapperBase:
    def init_device(self):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "set-by-init-device"
        return "vLLM's own result"
"""
# A front end: the plugin's start, then a worker spawned with its OpenMP variables set in
# os.environ around the spawn (as vLLM's executor does), which registers the plugin and
# runs init_device; another child that exits before the scrape; the scrape.
FRONT_END = """\
import json, multiprocessing, os, sys

def worker(ready, release):
    from vllm.v1.worker import worker_base
    from vllm_cpu_launch import inside
    inside.start(True)
    print(json.dumps(worker_base.WorkerWrapperBase().init_device()), flush=True)
    ready.set()
    release.wait(60)  # alive while scraped

def gone():
    from vllm.v1.worker import worker_base
    from vllm_cpu_launch import inside
    inside.start(True)
    worker_base.WorkerWrapperBase().init_device()

if __name__ == "__main__":
    from vllm_cpu_launch import inside
    inside.start(False)
    directory = os.environ["VLLMCPULAUNCH_READINGS"]
    context = multiprocessing.get_context("spawn")
    done = context.Process(target=gone)
    done.start()
    done.join()
    os.environ.update(LD_PRELOAD=sys.argv[1], KMP_BLOCKTIME="5", OMP_NUM_THREADS="1")
    ready, release = context.Event(), context.Event()
    child = context.Process(target=worker, args=(ready, release))
    child.start()
    ready.wait(60)
    from prometheus_client import REGISTRY, generate_latest
    metrics = generate_latest(REGISTRY).decode()
    release.set()
    child.join()
    print(json.dumps({
        "directory": directory,
        "mode": oct(os.stat(directory).st_mode & 0o777),
        "metrics": metrics,
        "left": sorted(os.listdir(directory)),
        "pids": [done.pid, child.pid],
    }))
"""


def python_run(
    code: str, environ: dict[str, str], *arguments: str
) -> subprocess.CompletedProcess[str]:
    """`python -c CODE ARGUMENTS`, which must exit 0: its CompletedProcess."""
    completed = subprocess.run(
        [sys.executable, "-c", code, *arguments],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    return completed


def run_python(code: str, environ: dict[str, str], *arguments: str) -> str:
    return python_run(code, environ, *arguments).stdout


def gnu_libgomp() -> str:
    """The libgomp gcc links `-fopenmp` code to (torch's and triton-cpu's kind)."""
    named = subprocess.run(
        ["gcc", "-print-file-name=libgomp.so.1"], capture_output=True, text=True, check=True
    )
    return os.path.normpath(named.stdout.strip())


def reading(tmp_path: Path, **variables: str) -> dict[str, Any]:
    outcome: dict[str, Any] = json.loads(run_python(READ, clean_environ(tmp_path, **variables)))
    return outcome


def test_intel_openmp_preloaded_serves_and_its_own_settings_are_read(
    tmp_path: Path, real_iomp: Path
) -> None:
    got = reading(
        tmp_path,
        LD_PRELOAD=str(real_iomp),
        KMP_BLOCKTIME="37",
        OMP_NUM_THREADS="3",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    assert got == {
        "role": "worker",
        "pid": got["pid"],
        "runtime": "intel",
        "library": str(real_iomp),
        "blocktime_ms": "37",
        "threads": "3",
        "bind": "nobind",
    }


def test_llvm_libomp_is_told_from_intels(tmp_path: Path, debian_root: Path) -> None:
    (libomp,) = (debian_root / "usr/lib/llvm-14/lib").glob("libomp.so.5")
    got = reading(tmp_path, LD_PRELOAD=str(libomp), KMP_BLOCKTIME="11", OMP_NUM_THREADS="2")
    assert (got["runtime"], got["library"]) == ("llvm", str(libomp))
    assert (got["blocktime_ms"], got["threads"], got["bind"]) == ("11", "2", "")


def test_gnu_libgomp_has_no_block_time(tmp_path: Path) -> None:
    libgomp = gnu_libgomp()
    got = reading(tmp_path, LD_PRELOAD=libgomp, OMP_NUM_THREADS="4", KMP_BLOCKTIME="9")
    assert (got["runtime"], got["library"], got["blocktime_ms"], got["threads"]) == (
        "gnu",
        libgomp,
        "",
        "4",
    )


def test_without_a_runtime_nothing_is_read(tmp_path: Path) -> None:
    got = reading(tmp_path, OMP_NUM_THREADS="4")
    assert {key: got[key] for key in ("runtime", "library", "blocktime_ms", "threads")} == {
        "runtime": "none",
        "library": "",
        "blocktime_ms": "",
        "threads": "",
    }


def series(metrics: str) -> list[dict[str, str]]:
    """The labels of each vllm_cpu_launch_openmp_info sample of a /metrics text, parsed
    by prometheus_client's own parser (what a scraper reads)."""
    found = []
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "vllm_cpu_launch_openmp_info":
                assert sample.value == 1.0, sample
                found.append(dict(sample.labels))
    return found


def standin_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment whose `vllm.v1.worker.worker_base` is the stand-in."""
    package = tmp_path / "standin" / "vllm" / "v1" / "worker"
    package.mkdir(parents=True)
    for directory in (package, package.parent, package.parent.parent):
        (directory / "__init__.py").write_text("")
    (package / "worker_base.py").write_text(WORKER_BASE)
    environ = clean_environ(tmp_path, TMPDIR=str(tmp_path))
    environ["PYTHONPATH"] = f"{tmp_path / 'standin'}:{environ['PYTHONPATH']}"
    return environ


def test_the_front_end_serves_each_live_processs_reading_after_vllms_set_up(
    tmp_path: Path, real_iomp: Path
) -> None:
    environ = standin_vllm(tmp_path)
    script = tmp_path / "front_end.py"  # a file: spawn re-imports it in the children
    script.write_text(FRONT_END)
    code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    lines = run_python(code, environ, str(real_iomp)).splitlines()
    assert lines[0] == json.dumps("vLLM's own result")  # the worker's init_device, unchanged
    outcome = json.loads(lines[-1])
    done, worker = outcome["pids"]
    front_end, child = series(outcome["metrics"])
    assert front_end["role"] == "api-server" and front_end["pid"] != str(worker)
    assert child == {
        "role": "worker",
        "pid": str(worker),
        "runtime": "intel",
        "library": str(real_iomp),
        "blocktime_ms": "5",
        "threads": "1",
        "bind": "set-by-init-device",  # read after vLLM's init_device
    }
    # The child that exited is left out, its file removed; the directory is private.
    # (its PID as a label: the bare digits may well appear in another series' value)
    assert f'pid="{done}"' not in outcome["metrics"] and outcome["left"] == [f"{worker}.json"]
    assert outcome["mode"] == "0o700"
    assert not Path(outcome["directory"]).exists()  # removed when the front end exited


def test_a_directory_others_can_write_is_not_written(tmp_path: Path, real_iomp: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    environ = standin_vllm(tmp_path)
    environ.update({READINGS_VARIABLE: str(shared), "LD_PRELOAD": str(real_iomp)})
    code = (
        "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "from vllm.v1.worker import worker_base\n"
        "from vllm_cpu_launch import inside\n"
        "inside.start(True)\n"
        "print(worker_base.WorkerWrapperBase().init_device())\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120
    )
    assert completed.stdout == "vLLM's own result\n"
    assert completed.stderr == (
        f"WARNING vllm-cpu-launch plugin: {READINGS_VARIABLE}={shared} is not a private "
        "directory of this user; nothing published\n"
    )
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("spawned", [True, False])
def test_a_process_outside_vllm_changes_nothing(tmp_path: Path, spawned: bool) -> None:
    """No vLLM class imported: nothing is wrapped; a child without the directory reads
    nothing; nothing raises."""
    code = (
        "import os, sys\n"
        "from vllm_cpu_launch import inside\n"
        f"inside.start({spawned})\n"
        f"print(os.path.dirname(os.environ.get({READINGS_VARIABLE!r}, '')))\n"
    )
    out = run_python(code, clean_environ(tmp_path, TMPDIR=str(tmp_path)))
    assert out == ("\n" if spawned else f"{tmp_path}\n")


@pytest.mark.parametrize(("switch", "reads"), [("0", False), ("off", False), ("1", True)])
def test_the_plugins_off_switch_stops_the_reading_too(
    tmp_path: Path, switch: str, reads: bool
) -> None:
    """vLLM's front end registers the plugin (no vLLM here: its hook is one warning)."""
    code = (
        "import os\n"
        "from vllm_cpu_launch import plugin\n"
        "plugin.register()\n"
        f"print({READINGS_VARIABLE!r} in os.environ)\n"
    )
    environ = clean_environ(tmp_path, TMPDIR=str(tmp_path), VLLMCPULAUNCH_PLUGIN=switch)
    assert run_python(code, environ) == f"{reads}\n"


# A front end that lays out its readings directory as the test's case says, then is
# scraped twice: the series of each scrape, and the directory's leftovers.
LAID_OUT = """\
import json, logging, os, sys
logging.basicConfig(format="%(levelname)s %(message)s")
from vllm_cpu_launch import inside
from prometheus_client import REGISTRY, generate_latest
inside.start(False)
directory = os.environ["VLLMCPULAUNCH_READINGS"]
case, pid = sys.argv[1], os.getpid()
good = {"role": "worker", "pid": pid, "runtime": "gnu", "library": "/lib/libgomp.so.1",
        "blocktime_ms": "", "threads": "2", "bind": ""}
forged = {**good, "pid": 1, "library": "/forged/libiomp5.so"}
def write(name, content):
    with open(os.path.join(directory, name), "w") as stream:
        stream.write(content)
if case == "bad files":
    write(f"{pid}.json", json.dumps(good))
    write("bad.json", "{not json")
    write("2.json", json.dumps({**good, "pid": "2"}))
    write("3.json", json.dumps(forged))  # its pid is not its name's
    write("4.json", json.dumps({**good, "pid": 4, "threads": 2}))
    write("5.json", "[" * 100000)
    os.mkdir(os.path.join(directory, "x.json"))
    os.symlink(os.path.join(directory, f"{pid}.json"), os.path.join(directory, "link.json"))
else:  # the directory swapped for another one, or for a link to it
    os.rename(directory, directory + ".moved")
    made = directory + ".forged" if case == "swapped for a link" else directory
    os.mkdir(made, 0o700)
    with open(os.path.join(made, "1.json"), "w") as stream:
        json.dump(forged, stream)
    if made != directory:
        os.symlink(made, directory)
scrapes = [generate_latest(REGISTRY).decode() for _ in range(2)]
print(json.dumps({"pid": pid, "scrapes": scrapes, "left": sorted(os.listdir(directory))}))
"""


def laid_out(tmp_path: Path, case: str) -> tuple[dict[str, Any], list[str]]:
    environ = clean_environ(tmp_path, TMPDIR=str(tmp_path))
    completed = python_run(LAID_OUT, environ, case)
    outcome: dict[str, Any] = json.loads(completed.stdout)
    return outcome, completed.stderr.splitlines()


def test_a_file_that_is_no_reading_is_skipped_warned_once_and_the_others_stay(
    tmp_path: Path,
) -> None:
    """One malformed file removed every series, the front end's too, with a warning at each
    scrape (issue 45): each is skipped with one warning, and the good ones stay."""
    outcome, warnings = laid_out(tmp_path, "bad files")
    pid = str(outcome["pid"])
    for metrics in outcome["scrapes"]:
        front_end, child = series(metrics)
        assert front_end["role"] == "api-server" and front_end["pid"] == pid
        assert child["role"] == "worker" and child["pid"] == pid
        assert child["library"] == "/lib/libgomp.so.1"
    skipped = ["2.json", "3.json", "4.json", "5.json", "bad.json", "link.json", "x.json"]
    assert len(warnings) == len(skipped), warnings
    for name, warning in zip(skipped, sorted(warnings), strict=True):
        assert (
            warning.startswith("WARNING vllm-cpu-launch plugin: skips ") and f"/{name}," in warning
        )
    assert "/forged/" not in "".join(outcome["scrapes"])


@pytest.mark.parametrize("case", ["swapped", "swapped for a link"])
def test_a_directory_swapped_for_another_is_not_read(tmp_path: Path, case: str) -> None:
    """With TMPDIR in a directory others can write, another user swapped the readings
    directory and /metrics showed a forged worker (issue 45): the collector reads only the
    directory it made, and says so once."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    outcome, warnings = laid_out(shared, case)
    for metrics in outcome["scrapes"]:
        (front_end,) = series(metrics)
        assert front_end["pid"] == str(outcome["pid"])
    assert "/forged/" not in "".join(outcome["scrapes"]) and outcome["left"] == ["1.json"]
    (warning,) = warnings
    assert warning.startswith("WARNING vllm-cpu-launch plugin: ")
    said = "cannot read" if case == "swapped for a link" else "is no longer the private directory"
    assert said in warning

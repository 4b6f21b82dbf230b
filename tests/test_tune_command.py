"""vllm_cpu_launch/verbs/tune/command.py: the commands a serving tune runs, and its inputs
checked before the first start (the options refused on tune's command line, end to end,
are in tests/test_tune.py; the argv checked against vLLM's own parsers in
tests/e2e/test_tune.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.verbs.tune.command import (
    LOOPBACK,
    SHIPPED_PROMPTS,
    Load,
    check_prompts,
    client_command,
    parse_concurrencies,
    server_arguments,
)

NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
KEPT = ["--served-model-name", "m", "-sc", NGRAM, "--max-model-len", "2048", "--enforce-eager"]


def test_the_server_runs_on_tunes_loopback_port_in_place_of_where_it_listens() -> None:
    """Where the user's server listens and how a client gets in (host, port, socket, TLS,
    keys, root path) is replaced; every other option is kept as given."""
    listen = ["--host", "0.0.0.0", "--port=8000", "--api_key", "k1", "k2"]
    enter = ["--uds", "/run/vllm.sock", "--ssl-keyfile", "key.pem", "--root-path", "/v"]
    serve = ["serve", "/models/m", *listen, *KEPT[:4], *enter, *KEPT[4:]]
    arguments, replaced = server_arguments(serve, 41234)
    assert arguments == ["serve", "/models/m", *KEPT, "--host", LOOPBACK, "--port", "41234"]
    assert replaced == [*listen, *enter]


def test_a_headless_server_is_refused_in_one_line() -> None:
    with pytest.raises(LaunchError) as raised:
        server_arguments(["serve", "/models/m", "--headless", "-sc", NGRAM], 41234)
    assert raised.value.code == EXIT_USAGE and "\n" not in raised.value.message
    assert "needs an API server, which --headless leaves out" in raised.value.message


def words_after(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_client_asks_the_server_as_the_user_would_tokenize() -> None:
    """`vllm bench serve` through the same vLLM, at one concurrency: the model, tokenizer,
    first served name and remote-code trust of the serve command, none of its server
    options; the prompts per start grow with the concurrency unless given."""
    program = ["/env/bin/python", "/env/bin/vllm"]
    serve = ["serve", "/models/m", "--tokenizer", "/tok", "--served-model-name", "a", "b"]
    serve += ["--trust-remote-code", "--port", "8000", "-sc", NGRAM]
    load = Load((1, 4), "/p/prompts.jsonl", ("say this back to me",), None, 64)
    url, dataset = "http://127.0.0.1:41234", "/work/prompts.json"
    argv = client_command(program, serve, load, url, dataset, 4, "/work/libgomp-c4.json")
    assert argv[:4] == [*program, "bench", "serve"]
    expected = {
        "--base-url": url,
        "--model": "/models/m",
        "--dataset-name": "sharegpt",
        "--dataset-path": dataset,
        "--sharegpt-output-len": "64",
        "--num-prompts": "16",
        "--max-concurrency": "4",
        "--num-warmups": "4",
        "--temperature": "0",
        "--result-dir": "/work",
        "--result-filename": "libgomp-c4.json",
        "--tokenizer": "/tok",
        "--served-model-name": "a",
    }
    assert {name: words_after(argv, name) for name in expected} == expected
    assert "--trust-remote-code" in argv and argv[-3:] == [
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
    ]
    assert "--port" not in argv and "-sc" not in argv and "b" not in argv
    at_one = client_command(program, serve, load, url, dataset, 1, "/work/c1.json")
    assert words_after(at_one, "--num-prompts") == "8"  # never fewer than 8
    given = Load((1, 4), "/p/prompts.jsonl", ("say this back to me",), 5, 64)
    chosen = client_command(program, serve, given, url, dataset, 4, "/work/c4.json")
    assert words_after(chosen, "--num-prompts") == "5"


def test_chat_requests_or_with_completions_the_text_as_it_is() -> None:
    """Chat requests by default (the server applies the model's chat template); with
    --completions, vLLM's completions backend, which applies none: a model without one."""
    serve = ["serve", "/models/m", "-sc", NGRAM]
    ends = {}
    for completions in (False, True):
        load = Load((1,), "/p/prompts.jsonl", ("say this back to me",), None, 64, completions)
        argv = client_command(["vllm"], serve, load, "http://h:1", "/d.json", 1, "/r/c.json")
        ends[completions] = (words_after(argv, "--backend"), words_after(argv, "--endpoint"))
    assert ends == {
        False: ("openai-chat", "/v1/chat/completions"),
        True: ("openai", "/v1/completions"),
    }


@pytest.mark.parametrize(
    ("value", "levels"), [("1", (1,)), ("8,1,4,4", (1, 4, 8)), (" 2, 16", (2, 16))]
)
def test_concurrencies_are_distinct_and_ascending(value: str, levels: tuple[int, ...]) -> None:
    assert parse_concurrencies(value) == levels


@pytest.mark.parametrize("value", ["0,2", "-1", "x", "", "1,,2", "1.5", None])
def test_a_concurrency_that_is_no_positive_whole_number_is_refused(value: object) -> None:
    with pytest.raises(LaunchError) as raised:
        parse_concurrencies(value)
    assert raised.value.code == EXIT_USAGE
    assert raised.value.message == (
        f"--concurrency {value!r}: needs positive whole numbers, comma-separated (1,4,8)"
    )


def test_the_shipped_prompts_are_read_as_the_client_will_send_them() -> None:
    path, prompts = check_prompts(SHIPPED_PROMPTS)
    assert path == SHIPPED_PROMPTS and len(prompts) >= 16
    assert all(len(prompt.split()) >= 4 for prompt in prompts)  # vLLM's reader skips shorter


def test_a_prompts_file_is_read_whoever_can_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its prompts only weigh the runtimes compared, so the settings files' trust rule does
    not apply; blank lines are skipped and the path is made absolute for the client."""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Repeat this sentence back to me."}\n\n{"prompt": "Hi"}\n')
    prompts.chmod(0o666)
    monkeypatch.chdir(tmp_path)
    assert check_prompts("mine.jsonl") == (str(prompts), ("Repeat this sentence back to me.", "Hi"))


def test_a_prompts_file_that_is_a_fifo_or_not_utf8_is_one_error(tmp_path: Path) -> None:
    """A FIFO is refused at once, not read until a writer comes."""
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9 au lait, s\'il vous pla\xeet"}\n')
    for path, part in ((fifo, "is a FIFO"), (latin, "can't decode byte 0xe9")):
        with pytest.raises(LaunchError) as raised:
            check_prompts(str(path))
        assert raised.value.code == EXIT_USAGE and "\n" not in raised.value.message
        assert raised.value.message.startswith(f"--prompts {path}: cannot be read: ")
        assert part in raised.value.message

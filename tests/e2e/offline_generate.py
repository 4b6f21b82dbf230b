"""vLLM's offline API as a user's script calls it, for tests/e2e/test_plugin.py.

`python offline_generate.py MODEL SPECULATIVE_CONFIG` builds `LLM(MODEL,
speculative_config=...)`, generates once, prints `generated N tokens`, then waits until
its standard input closes, so that the test can inspect its processes, and exits. Run by
the vLLM environment's Python; the `__main__` guard is what vLLM's spawned engine core
needs (it imports this file again).
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams

PROMPT = "ab ba " * 8  # repetitive: the ngram proposer finds matches at once
TOKENS = 16


def main() -> None:
    model, speculative_config = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model, speculative_config=speculative_config, max_model_len=256)
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    (output,) = llm.generate([PROMPT], sampling)
    print(f"generated {len(output.outputs[0].token_ids)} tokens", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()

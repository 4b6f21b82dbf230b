"""Child of omp_measure.py: time speculative-decoding-like steps and print one JSON line.

Run by path with the target environment's Python, which has torch but not this package:
the standard library and torch only. The parent picks the runtime (LD_PRELOAD, OMP_*,
KMP_*); this process reports which runtime it really got.
"""

import argparse
import ctypes
import importlib
import json
import os
import sys
import time
from types import ModuleType

# Run by path, Python puts scripts/ first on sys.path, where module names such as `demo`
# or `checkout` could shadow what torch imports.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

# A small decoder verifying 1 + 3 draft tokens per step: every matmul, softmax and
# reduction is big enough that torch runs it as an OpenMP parallel region (about 30 per
# step, each well under a millisecond), with Python work between them as in vLLM.
HIDDEN = 512
HEAD_DIM = 64
CONTEXT = 512
FFN = 1408
VOCAB = 8192
LAYERS = 4
HEADS = HIDDEN // HEAD_DIM
DRAFT = 3
NO_TORCH_EXIT = 3


class Decoder:
    """Random weights and an n-gram drafter: the shape of an SD step, not a real model."""

    def __init__(self, torch: ModuleType) -> None:
        self.torch = torch
        torch.manual_seed(0)
        self.layers = [
            {
                "qkv": torch.randn(HIDDEN, 3 * HIDDEN) * 0.02,
                "o": torch.randn(HIDDEN, HIDDEN) * 0.02,
                "up": torch.randn(HIDDEN, 2 * FFN) * 0.02,
                "down": torch.randn(FFN, HIDDEN) * 0.02,
                "k": torch.randn(HEADS, CONTEXT, HEAD_DIM),
                "v": torch.randn(HEADS, CONTEXT, HEAD_DIM),
            }
            for _ in range(LAYERS)
        ]
        self.embed = torch.randn(VOCAB, HIDDEN)
        self.lm_head = torch.randn(HIDDEN, VOCAB) * 0.02
        self.history: list[int] = torch.randint(0, VOCAB, (CONTEXT,)).tolist()

    def propose(self) -> list[int]:
        """Prompt-lookup drafting in plain Python, like vLLM's ngram proposer."""
        tail = self.history[-2:]
        for i in range(len(self.history) - 3, 0, -1):
            if self.history[i - 1 : i + 1] == tail:
                return self.history[i + 1 : i + 1 + DRAFT]
        return self.history[-DRAFT:]

    def step(self) -> None:
        torch = self.torch
        draft = self.propose()
        tokens = [self.history[-1], *draft]
        x = self.embed[torch.tensor(tokens)]
        n = len(tokens)
        for w in self.layers:
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            q = (h @ w["qkv"])[:, :HIDDEN].reshape(n, HEADS, HEAD_DIM).transpose(0, 1)
            scores = torch.softmax(q @ w["k"].transpose(1, 2) * HEAD_DIM**-0.5, -1)
            x = x + (scores @ w["v"]).transpose(0, 1).reshape(n, HIDDEN) @ w["o"]
            gate, up = (x @ w["up"]).chunk(2, -1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w["down"]
        verified: list[int] = torch.softmax(x @ self.lm_head, -1).argmax(-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == verified[accepted]:
            accepted += 1
        self.history = self.history[accepted + 1 :] + verified[: accepted + 1]


def shared_libraries() -> tuple[list[str], str]:
    """The shared libraries mapped here (the parent tells the OpenMP runtimes among them by
    what their files say, elf.library_of), and the one serving GOMP_parallel: torch's
    libgomp stays mapped under a preloaded libiomp5; what counts is where its regions bind."""
    ranges: list[tuple[int, int, str]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                low, high = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((low, high, fields[5].strip()))
    mapped = sorted({p for _, _, p in ranges if ".so" in os.path.basename(p)})
    try:
        address = ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value or 0
    except AttributeError:  # no GOMP_parallel in the global scope: no OpenMP to bind to
        return mapped, ""
    serving = next((p for low, high, p in ranges if low <= address < high), "")
    return mapped, serving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        print(json.dumps({"error": "no-torch", "detail": f"{type(exc).__name__}: {exc}"}))
        return NO_TORCH_EXIT
    mapped, serving = shared_libraries()
    with torch.inference_mode():
        decoder = Decoder(torch)
        for _ in range(args.warmup):
            decoder.step()
        step_ms: list[float] = []
        for _ in range(args.steps):
            start = time.perf_counter_ns()
            decoder.step()
            step_ms.append((time.perf_counter_ns() - start) / 1e6)
    threads = int(torch.get_num_threads())
    facts = {"libraries": mapped, "runtime_path": serving, "step_ms": step_ms}
    print(json.dumps({"torch": str(torch.__version__), "threads": threads, **facts}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

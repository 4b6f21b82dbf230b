#!/usr/bin/env python3
"""Turn a GGUF checkpoint into a Hugging Face model directory vLLM serves, and cut a shallow
draft from its first layers.

scripts/real_model.py runs it with the vLLM environment's Python (torch, transformers) and
`gguf`/`accelerate` on PYTHONPATH; run it through that script, which pins what it reads.
transformers dequantizes the GGUF weights to bfloat16 but refuses to save a model it loaded
from GGUF ("not serializable"), so the weights are moved into a model built from the same
configuration without its quantization_config, and that one is saved.

    <vllm-env>/bin/python scripts/gguf_to_hf.py GGUF_FILE MODEL_DIR DRAFT_DIR --draft-layers N
Exit codes: 0 written, 1 a dependency is missing (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from script_cli import ScriptError, exit_code, narrator

# accelerate: transformers refuses to load a GGUF file without it.
NEEDED = ("torch", "transformers", "gguf", "accelerate")
DTYPE = "bfloat16"
say = narrator("gguf_to_hf")


def imported(names: Sequence[str]) -> dict[str, Any]:
    """The converter's dependencies, or one line naming each that cannot be imported."""
    modules, missing = {}, []
    for name in names:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ScriptError(
            f"{sys.executable} cannot import {', '.join(missing)}; "
            "Fix: make the model with scripts/real_model.py, which runs this converter "
            "with the vLLM environment's Python and its own gguf/accelerate"
        )
    return modules


def load(gguf_file: Path, modules: dict[str, Any]) -> tuple[Any, Any]:
    """The tokenizer and the dequantized bfloat16 model from the GGUF file."""
    transformers, torch = modules["transformers"], modules["torch"]
    where, name = str(gguf_file.parent), gguf_file.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, torch_dtype=getattr(torch, DTYPE)
    )
    return tokenizer, model


def save(config: Any, weights: dict[str, Any], tokenizer: Any, output: Path, modules: Any) -> None:
    """A model built from `config` (no quantization_config), given `weights`, saved with the
    tokenizer as safetensors in `output`."""
    transformers, torch = modules["transformers"], modules["torch"]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, DTYPE))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings: lm_head.weight is the embedding's tensor, absent from a cut state dict.
    if unexpected or [key for key in missing if key != "lm_head.weight"]:
        raise ScriptError(f"weights do not fit the model: missing {missing}, extra {unexpected}")
    model.tie_weights()
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)


def first_layers(weights: dict[str, Any], layers: int) -> dict[str, Any]:
    """The state dict without the decoder layers from index `layers` on."""
    kept = {}
    for key, tensor in weights.items():
        parts = key.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
            continue
        kept[key] = tensor
    return kept


def convert(gguf_file: Path, model_dir: Path, draft_dir: Path, draft_layers: int) -> None:
    """Write the full model to model_dir and its first draft_layers layers to draft_dir."""
    modules = imported(NEEDED)
    say(f"dequantizing {gguf_file.name} to {DTYPE}")
    tokenizer, loaded = load(gguf_file, modules)
    config, weights = loaded.config, loaded.state_dict()
    total = config.num_hidden_layers
    if not 0 < draft_layers < total:
        raise ScriptError(
            f"--draft-layers {draft_layers}: the model has {total}; choose 1 to {total - 1}"
        )
    save(config, weights, tokenizer, model_dir, modules)
    config.num_hidden_layers = draft_layers
    save(config, first_layers(weights, draft_layers), tokenizer, draft_dir, modules)
    say(f"wrote {model_dir} ({total} layers) and {draft_dir} ({draft_layers})")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command line: the GGUF file, both outputs and the draft's depth."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("draft_dir", type=Path)
    parser.add_argument("--draft-layers", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return exit_code(
        "gguf_to_hf",
        lambda: convert(args.gguf_file, args.model_dir, args.draft_dir, args.draft_layers),
    )


if __name__ == "__main__":
    raise SystemExit(main())

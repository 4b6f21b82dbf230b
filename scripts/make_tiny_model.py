#!/usr/bin/env python3
"""Write a tiny random-weight Llama with its own byte-level BPE tokenizer into a directory.

Most end-to-end tests need a causal LM that vLLM can serve without a model hub, quickly:
this one is made here, in seconds, from a fixed seed. Its answers are nonsense (the demo
and the real-weights tests serve scripts/real_model.py's model); its
shapes (head_dim 64) are ones vLLM's CPU attention supports. `--size 100m` writes the
compute-bound model of the benchmark map (scripts/bench_vllm.py) the same way. The same
`--seed` gives the same tokenizer whatever the size, so one model can draft for another;
`--eagle-head` writes an EAGLE head for the `--size` model instead, for vLLM's `eagle`
speculative method.

Run it with the Python of the vLLM environment (it needs torch, transformers, tokenizers):
    <vllm-env>/bin/python scripts/make_tiny_model.py OUTPUT_DIR [--size tiny|100m] [--eagle-head]
Prints OUTPUT_DIR on stdout.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch  # type: ignore[import-not-found, unused-ignore]
from safetensors.torch import save_file  # type: ignore[import-not-found, unused-ignore]
from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (  # type: ignore[import-not-found, unused-ignore]
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
VOCAB_SIZE = 1024
# name -> (hidden size, intermediate size, layers, attention heads); head_dim 64 in both.
# "tiny" decodes in ~1 ms a token on 2 CPUs, so Python work in vLLM's processes dominates;
# "100m" (about 105M parameters) takes ~6 ms there, most of it the model's own compute.
SIZES = {"tiny": (128, 256, 2, 2), "100m": (1024, 2816, 8, 16)}
MAX_POSITIONS = 2048
CORPUS_SENTENCES = 4000
WORD_COUNT = 800
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def pseudo_words(rng: random.Random) -> list[str]:
    """Made-up words of one to four syllables: varied enough for about VOCAB_SIZE merges."""
    return ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(WORD_COUNT)]


def generated_corpus(seed: int) -> list[str]:
    """Sentences of pseudo-words, the training text for the tokenizer."""
    rng = random.Random(seed)
    words = pseudo_words(rng)
    return [
        " ".join(rng.choices(words, k=rng.randint(4, 16))) + "." for _ in range(CORPUS_SENTENCES)
    ]


def trained_tokenizer(seed: int) -> Tokenizer:
    """A byte-level BPE (any text encodes) that adds BOS like Llama's tokenizer does."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generated_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, output: Path) -> PreTrainedTokenizerFast:
    """tokenizer.json plus the transformers files vLLM reads (special tokens, chat template)."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(output)
    return wrapped


def llama_config(tokenizer: PreTrainedTokenizerFast, size: str, layers: int) -> LlamaConfig:
    """The Llama shape of `size` with `layers` decoder layers, for this tokenizer."""
    hidden, intermediate, _, heads = SIZES[size]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def random_llama(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Random weights from a fixed seed, in bfloat16 (what vLLM on CPU computes in anyway)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def save_model(tokenizer: PreTrainedTokenizerFast, output: Path, seed: int, size: str) -> None:
    """The whole model of `size`."""
    random_llama(llama_config(tokenizer, size, SIZES[size][2]), seed).save_pretrained(output)


def save_eagle_head(tokenizer: PreTrainedTokenizerFast, output: Path, seed: int, size: str) -> None:
    """An EAGLE head for the model of `size`, as vLLM 0.32 loads one
    (vllm/model_executor/models/llama_eagle.py): a Llama config.json of one layer, whose
    architecture vLLM turns into EagleLlamaForCausalLM, and weights named as its checkpoints
    name them: `fc` (the token's embedding and the target's hidden state joined, 2 x hidden
    to hidden) and decoder layer 0 without `input_layernorm` (vLLM replaces that norm by
    the identity). No embeddings, final norm or lm_head: vLLM then shares the target's."""
    config = llama_config(tokenizer, size, 1)
    # As a whole model's save_pretrained() writes them: vLLM names the head Eagle + the
    # architecture, and refuses `EagleLlamaModel`, what a config without one becomes.
    config.architectures, config.dtype = ["LlamaForCausalLM"], torch.bfloat16
    layer = {
        name.removeprefix("model."): weight
        for name, weight in random_llama(config, seed).state_dict().items()
        if name.startswith("model.layers.0.") and "input_layernorm" not in name
    }
    hidden = config.hidden_size
    fc = torch.randn(hidden, 2 * hidden) * config.initializer_range
    tensors = {**layer, "fc.weight": fc.to(torch.bfloat16)}
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(output)


def make_tiny_model(output: Path, seed: int, size: str = "tiny", eagle_head: bool = False) -> Path:
    """Write tokenizer and model (or the model's EAGLE head) into output (created if
    missing); return it."""
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(trained_tokenizer(seed), output)
    (save_eagle_head if eagle_head else save_model)(tokenizer, output, seed, size)
    return output


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Command line: where to write, and the seed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("output", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="seed for text and weights")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="model shape (default: tiny)"
    )
    parser.add_argument(
        "--eagle-head", action="store_true", help="write an EAGLE head for the --size model"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Make the model and print where it is."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        output = make_tiny_model(args.output.absolute(), args.seed, args.size, args.eagle_head)
    except OSError as error:
        print(f"make_tiny_model: error: {error}", file=sys.stderr)
        return 1
    print(output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

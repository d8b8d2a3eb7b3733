"""Save a ``shardwise bench`` preset as a Hugging Face model folder with a tokenizer.

    python benchmarks/preset_folder.py PRESET OUT_DIR [--tokenizer TOKENIZER] [--dtype fp16]

For runs that take ``--model DIR`` (``benchmarks/serve_load.py``, ``shardwise serve``) at a
model size no embedded model has, e.g. the ≥1B serving load on a GPU (benchmarks/gpu_check.sh,
step ``serve``), or a tiny preset whose step costs almost nothing, so that a served load
measures the serving stack's own per-step work (benchmarks/README.md, "Mixed steps under CUDA
graphs"). The weights are the preset's random ones (seed 0); the vocabulary is widened to
the tokenizer's when it is larger, so every token id it produces has an embedding row.
TOKENIZER: any saved tokenizer folder (``AutoTokenizer.from_pretrained(...).save_pretrained(DIR)``)
or a GGUF file; default: the embedded SmolLM2-135M-Instruct's (its GGUF file).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM

from shardwise.bench.presets import get_preset
from shardwise.models import load_tokenizer

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("out")
    parser.add_argument("--tokenizer", help="a saved tokenizer folder or a GGUF file (default: "
                        "the embedded SmolLM2-135M-Instruct's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        parser.error(f"no tokenizer in {args.tokenizer or 'the embedded model'}: give a saved "
                     f"tokenizer folder or a GGUF file with --tokenizer")
    config = get_preset(args.preset).hf_config()
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype]).eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {args.preset} with vocabulary {config.vocab_size}, "
          f"{params / 1e9:.2f}B parameters in {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

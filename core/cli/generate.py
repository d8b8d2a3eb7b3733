"""``shardwise generate``: load a model, run it through init_inference, print text and latency.

Everything cheap (model path, device, dtype, sampling options, prompt) is checked before the model
is loaded, so bad input fails in well under a second with exit code 2 and a message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import models
from ..config import InferenceConfig
from ..engine import init_inference
from ..errors import ConfigError
from ..generation import TokenTimings, timed_generate
from ..plugins import get_accelerator

DEFAULT_PROMPT = "What is the capital of France?"


def add_parser(sub):
    p = sub.add_parser(
        "generate", help="generate text with a model (default: embedded SmolLM2)",
        description="Generate text with a model run through shardwise.init_inference; prints "
                    "the new text to stdout and prefill / per-token latency to stderr.")
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file (its final newlines dropped)")
    p.add_argument("--model", metavar="PATH",
                   help="a Hugging Face model directory (with config.json) or a .gguf file "
                        f"(default: the embedded {models.DEFAULT_MODEL_NAME})")
    p.add_argument("--device", help="accelerator plugin name (default: detection)")
    p.add_argument("--dtype", help="fp32, bf16, fp16 or auto (the device's preferred); "
                                   "default: keep the model's")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="most tokens to generate (default: 64)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, help="sampling temperature (needs --sample)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (needs --sample)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, timings, model, device, dtype)")
    return p


def run(args) -> int:
    path = models.check_model_path(args.model) if args.model else models.default_model_path()
    config = _checked_config(args.device, args.dtype)
    gen_kwargs = generation_kwargs(args)
    prompt = read_prompt(args.prompt, args.prompt_file)
    if path.is_dir():  # a prompt has at least one token: refuse what cannot fit before loading
        check_new_tokens(args.max_new_tokens, 1, models.max_positions(models.read_config(path)))

    # Loading straight into the target dtype avoids a transient full-precision copy.
    model, tokenizer = models.load_model(args.model, dtype=config.dtype)
    if tokenizer is None:
        raise ConfigError(f"{path} has no tokenizer; save one next to the model with "
                          f"tokenizer.save_pretrained(DIR)")
    inputs = encode_prompt(tokenizer, prompt)
    check_new_tokens(args.max_new_tokens, inputs["input_ids"].shape[1],
                     models.max_positions(getattr(model, "config", None)))
    engine = init_inference(model, config)
    inputs = inputs.to(engine.device)
    output, timings = timed_generate(engine.module, inputs, **gen_kwargs)
    new_ids = output[0, inputs["input_ids"].shape[1]:].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    _print_result(args.json, text, new_ids, timings, str(path), engine)
    return 0


def _print_result(as_json: bool, text: str, new_ids: list[int], timings: TokenTimings,
                  model: str, engine) -> None:
    """The text to stdout and the timing line to stderr, or one JSON object to stdout."""
    dtype = str(engine.dtype).removeprefix("torch.")
    if as_json:
        print(json.dumps({"text": text, "token_ids": new_ids, "timings": timings.to_dict(),
                          "model": model, "device": str(engine.device), "dtype": dtype},
                         indent=2))
    else:
        print(text)
        print(f"{timings.summary()} | {engine.device} {dtype}", file=sys.stderr)


def _checked_config(device: str | None, dtype: str | None) -> InferenceConfig:
    """The engine config, with the device resolved and the dtype vetted by it (no model needed)."""
    config = InferenceConfig.build(device=device, dtype=dtype)
    accelerator = get_accelerator(config.device)
    if config.dtype == "auto":
        config.dtype = accelerator.preferred_dtype
    elif config.dtype is not None:
        accelerator.check_dtype(config.dtype)
    return config


def generation_kwargs(args) -> dict:
    """``generate`` keyword arguments from the CLI options (greedy unless ``--sample``)."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.sample:
        given = [f for f, v in (("--temperature", args.temperature), ("--top-p", args.top_p))
                 if v is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} set sampling options, but decoding is "
                              f"greedy unless you also pass --sample")
        return {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": True}
    if args.temperature is not None:
        if args.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0, got {args.temperature}")
        kwargs["temperature"] = args.temperature
    if args.top_p is not None:
        if not 0 < args.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
        kwargs["top_p"] = args.top_p
    return kwargs


def check_new_tokens(max_new_tokens: int, prompt_tokens: int, positions: int | None) -> None:
    """Refuse ``--max-new-tokens`` beyond the model's positions (``positions`` None: the model
    declares no limit): prompt and new tokens together must fit."""
    if positions is None or prompt_tokens + max_new_tokens <= positions:
        return
    room = positions - prompt_tokens
    prompt = f"the prompt is {prompt_tokens} token{'s' if prompt_tokens != 1 else ''}" \
        if prompt_tokens > 1 else "a prompt has at least 1 token"
    if room < 1:
        raise ConfigError(f"{prompt}, but the model takes at most {positions} positions "
                          f"(max_position_embeddings), so no new token fits; shorten the prompt")
    raise ConfigError(f"--max-new-tokens {max_new_tokens} does not fit: {prompt} and the model "
                      f"takes at most {positions} positions (max_position_embeddings), so at most "
                      f"{room} new tokens; pass --max-new-tokens {room} or less, or shorten the "
                      f"prompt")


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from the argument or the file (not both); the default question otherwise."""
    if prompt is not None and prompt_file is not None:
        raise ConfigError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is None:
        text = DEFAULT_PROMPT if prompt is None else prompt
    else:
        try:
            text = Path(prompt_file).read_text().rstrip("\n")  # an editor's final newline
        except OSError as exc:
            raise ConfigError(f"cannot read --prompt-file {prompt_file!r}: {exc.strerror}") from None
    if not text.strip():
        raise ConfigError("the prompt is empty; pass some text to continue")
    return text


def encode_prompt(tokenizer, prompt: str):
    """Token ids (``BatchEncoding``) for ``prompt``: through the chat template as a user turn
    when the tokenizer has one, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, return_dict=True,
                                             return_tensors="pt")
    return tokenizer(prompt, return_tensors="pt")

"""shardwise against llama.cpp on this CPU: same weights, same threads, one process (issue 21).

    python benchmarks/peers/llama_cpp.py --llama-cpp-src SRC [--model DIR | --shape NAME]
        [--threads N] [--rounds R] [--new-tokens N] [--precisions 32 16 8 4] [--output FILE.json]

What it does, in order:

1. The model: an HF folder (``--model``), a random-weight shape (``--shape llama-1.7b``: hidden
   2048, 24 layers, 32 heads, vocab 49152, tied embeddings, saved with the SmolLM2 tokenizer),
   or by default the embedded SmolLM2-135M-Instruct (shardwise's default model; its weights are
   dequantized from the bundled Q4_1 GGUF and saved as an fp32 HF folder, the "fp32 model"
   every quality number is measured against).
2. GGUFs of the same weights: F32/F16/BF16/Q8_0 written by llama.cpp's own converter
   (``convert_hf_to_gguf.py --outtype``), Q4_0 by ``llama_cpp.llama_model_quantize`` from the
   F32 (or F16) file. ``SRC`` is llama.cpp's source: the llama-cpp-python sdist (a ``.tar.gz``,
   unpacked into the work folder) or an unpacked tree holding ``vendor/llama.cpp`` or
   ``convert_hf_to_gguf.py``. Get the sdist with
   ``python -m pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp``; build and
   install the same sdist (the ``peers`` extra) so the converter and the library agree.
   The converter needs ``gguf`` and ``sentencepiece``. Files are cached in ``--work``.
3. Engines, each variant loaded once and kept: llama.cpp (``llama_cpp.Llama``, ``n_threads`` =
   ``n_threads_batch`` = ``--threads``) and shardwise (``init_inference(...,
   replace_with_kernel_inject=True, enable_graph=True)`` in fp32, fp32 over 16-bit weights
   (``weight_dtype``), and with ``quant={"weight": {"num_bits": 8 | 4}}`` in bf16 compute, as
   ``shardwise bench`` runs them (``--quant-compute fp32``: the quantized models' other parts in
   fp32, as llama.cpp keeps them); torch gets the same thread count). Pairs by precision: 32:
   fp32 / F32; 16: fp32 over fp16 weights / F16 (fp32 over bf16 weights / BF16 with
   ``--gguf-16 bf16``; ``--sw-16 bf16``: the bf16 model); 8: int8 / Q8_0; 4: int4 / Q4_0.
4. Speed, in interleaved rounds (every variant once per round, order rotated each round; one
   untimed warm-up first): batch 1, greedy, a fixed 64-token prompt, ``--new-tokens`` tokens,
   per-token decode ms (median of the steps; the report gives the median over rounds); the
   first-token time for a 512-token prompt; batch-8 aggregate tokens/s. The warm-up runs each
   of these once, batch 8 included: shardwise compiles its decode step once per batch bucket
   on first use, and a batch-8 run that held that compile reported it as decode time. llama.cpp is driven
   through its context directly (``eval`` + argmax of the last logits, batch 8 as eight
   sequences of one ``llama_batch``); shardwise through ``engine.generate`` (its own decode
   loop around the captured step, as a user calls it; before 2026-11-27 this script timed HF's
   ``generate`` on ``engine.module``).
5. Quality: teacher-forced next-token agreement with the fp32 HF model (argmax at every
   position), the mean KL divergence from the fp32 model's next-token distribution, and
   perplexity of the same fixed text, for every variant of both engines (llama.cpp logits from a
   ``logits_all=True`` context, fed the same token ids).

Thread pools: llama.cpp (OpenMP from the system libgomp) and torch (its own OpenMP runtime)
each keep worker threads spinning for a while after a parallel region. Two pools spinning on
2 cores slow whichever engine runs next, so before every timed call the script sleeps
``--idle-s`` seconds (default 0.5) and lets both pools go idle. Nothing else is changed: no
OMP_WAIT_POLICY / KMP_BLOCKTIME, which would change how each engine runs on its own. The pool
check (``--no-pool-check`` skips it) measures whether the pause matters: shardwise's int4 decode
right after llama.cpp's Q4_0 decode, with no pause and with the pause (``pool_check`` in the
JSON).

Writes JSON (machine, versions, command, every sample) and a PNG chart (with matplotlib) to
``benchmarks/results/peers-<model>.json``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
# Run as a script, this file's folder is on sys.path, where ``import llama_cpp`` would find this
# file instead of llama-cpp-python.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
RESULTS = ROOT / "benchmarks" / "results"

#: Random-weight shapes (``--shape``): LlamaConfig fields.
SHAPES = {
    "llama-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                       num_key_value_heads=32, intermediate_size=8192, vocab_size=49152,
                       tie_word_embeddings=True, max_position_embeddings=8192,
                       rope_theta=130000.0, rms_norm_eps=1e-5),
}

#: A fixed English text: the prompts are cut from it, and the quality numbers are measured on it.
TEXT = (
    "The river town woke slowly on market days. Before sunrise the bakers had already lit their "
    "ovens, and the smell of fresh bread drifted down the narrow streets toward the water. "
    "Fishermen pulled their boats onto the gravel, sorting the night's catch into baskets while "
    "gulls circled overhead. By seven o'clock the square was full: farmers sold apples, cheese "
    "and honey from wooden carts, a blacksmith repaired hinges and knives, and children ran "
    "between the stalls with coins their grandparents had given them. The mayor, an old man "
    "with a loud voice and a soft heart, walked from one end of the square to the other, "
    "greeting everyone by name. At noon the church bell rang twelve times, and the traders "
    "paused to eat. In the afternoon the clouds came in from the west, and a light rain began "
    "to fall. People opened umbrellas, covered their goods with canvas, and kept on talking, "
    "because a little rain had never stopped the market. When evening came, the lamps were lit "
    "one by one along the river, the carts rolled home over the old stone bridge, and the town "
    "grew quiet again until the next week. Travellers who passed through often said that the "
    "town had not changed in a hundred years, and the people who lived there were proud of it. "
    "Yet much had changed: the school had a new roof, the mill now made electricity instead of "
    "flour, and the young doctor had opened a clinic beside the post office."
)

#: llama.cpp's name of each GGUF type the script builds, by ``--gguf`` key.
GGUF_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


@dataclass
class Pair:
    """One precision: the shardwise variant and the llama.cpp file compared with it."""

    precision: str
    shardwise: str | None           # name of the shardwise variant (None: none at this precision)
    gguf: str | None                # key of GGUF_NAMES (None: none)


#: shardwise's 16-bit variant by the 16-bit GGUF it is compared with: the same weights under
#: fp32 activations, as llama.cpp runs that file (``--sw-16`` picks another)
SW_16_FOR_GGUF = {"f16": "fp32-fp16w", "bf16": "fp32-bf16w"}


def pairs_for(precisions: list[str], gguf_16: str, sw_16: str | None = None) -> list[Pair]:
    """The pairs of ``precisions`` (``32 16 8 4``); ``sw_16``: shardwise's 16-bit variant
    (None: :data:`SW_16_FOR_GGUF` of ``gguf_16``)."""
    sw_16 = sw_16 or SW_16_FOR_GGUF[gguf_16]
    table = {"32": Pair("32", "fp32", "f32"), "16": Pair("16", sw_16, gguf_16),
             "8": Pair("8", "int8", "q8_0"), "4": Pair("4", "int4", "q4_0")}
    return [table[p] for p in precisions]


#: shardwise variants: init_inference keywords beside the injection and graphs.
SHARDWISE_VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": torch.float32},
    "bf16": {"dtype": torch.bfloat16},
    # 16-bit weights under fp32 activations (as llama.cpp's F16/BF16 files run)
    "fp32-bf16w": {"dtype": torch.float32, "weight_dtype": torch.bfloat16},
    "fp32-fp16w": {"dtype": torch.float32, "weight_dtype": torch.float16},
    "int8": {"dtype": torch.bfloat16, "quant": {"weight": {"num_bits": 8}}},
    "int4": {"dtype": torch.bfloat16, "quant": {"weight": {"num_bits": 4}}},
}



#: ``--quant-compute``: the dtype of everything but the quantized matrices (norms, attention,
#: the residual stream) in the int8 / int4 variants.
QUANT_COMPUTE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def shardwise_kwargs(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """:data:`SHARDWISE_VARIANTS`' keywords for ``variant``, with ``--quant-group`` (the weight
    group size, e.g. 32 as Q8_0/Q4_0 block) and ``--quant-head`` (quantize the output head too,
    as llama.cpp's files do) applied to the quantized ones."""
    kw = dict(SHARDWISE_VARIANTS[variant])
    if "quant" in kw:
        weight = dict(kw["quant"]["weight"])
        if args.quant_group is not None:
            weight["group_size"] = args.quant_group
        head: Any = bool(args.quant_head)
        if args.quant_head and args.quant_head_bits:
            head = {"num_bits": args.quant_head_bits}
        kw["quant"] = {"weight": weight, "lm_head": head}
        kw["dtype"] = QUANT_COMPUTE[args.quant_compute]
    return kw


# --------------------------------------------------------------------------- model and GGUFs

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def save_default_model(out: Path) -> None:
    """The embedded SmolLM2-135M-Instruct as a plain fp32 HF folder (transformers will not save
    a model it loaded from GGUF, so its dequantized weights move into a fresh model)."""
    from transformers import AutoModelForCausalLM

    from shardwise.models import load_model

    model, tokenizer = load_model(None)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def save_shape_model(shape: str, out: Path, tokenizer_dir: Path) -> None:
    """A random-weight Llama of ``shape`` (seed 0, bf16 on disk) with the SmolLM2 tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def prepare_model(args, work: Path) -> tuple[Path, str]:
    """The HF folder to benchmark and its short name (saved into ``work`` when needed)."""
    if args.model:
        return Path(args.model), Path(args.model).name.lower()
    default_dir = work / "smollm2-135m-hf"
    if not (default_dir / "config.json").exists():
        log(f"saving the embedded SmolLM2-135M-Instruct to {default_dir}")
        save_default_model(default_dir)
    if not args.shape:
        return default_dir, "smollm2-135m"
    shape_dir = work / f"{args.shape}-hf"
    if not (shape_dir / "config.json").exists():
        log(f"saving random-weight {args.shape} to {shape_dir}")
        save_shape_model(args.shape, shape_dir, default_dir)
    return shape_dir, args.shape


def find_converter(src: str, work: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` in ``src`` (an sdist ``.tar.gz`` is unpacked)."""
    path = Path(src)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        target = work / "llama-cpp-src"
        if not target.exists():
            log(f"unpacking {path} into {target}")
            with tarfile.open(path) as tar:
                tar.extractall(target, filter="data")
        path = target
    hits = sorted(path.rglob("convert_hf_to_gguf.py")) if path.is_dir() else []
    if not hits:
        raise SystemExit(f"--llama-cpp-src {src}: no convert_hf_to_gguf.py in it; pass the "
                         "llama-cpp-python sdist (.tar.gz) or a llama.cpp source tree")
    return hits[0]


def convert(folder: Path, outtype: str, out: Path, converter: Path) -> None:
    """``convert_hf_to_gguf.py folder --outtype outtype`` with the converter's own gguf-py."""
    env = dict(os.environ)
    gguf_py = converter.parent / "gguf-py"
    if gguf_py.is_dir():
        env["PYTHONPATH"] = f"{gguf_py}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, str(converter), str(folder), "--outtype", outtype, "--outfile", str(out)]
    log(" ".join(cmd))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the converter failed ({done.returncode}):\n{done.stderr[-3000:]}")


def quantize(src: Path, out: Path, gguf_type: str, threads: int) -> None:
    """llama.cpp's own quantizer (``llama_model_quantize``) from ``src`` to ``gguf_type``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{GGUF_NAMES[gguf_type]}")
    params.nthread = threads
    log(f"llama_model_quantize {src.name} -> {out.name}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize to {gguf_type} failed ({rc})")


def build_ggufs(folder: Path, name: str, keys: list[str], args, work: Path) -> dict[str, Path]:
    """The GGUF file of each key in ``keys`` (cached in ``work``)."""
    converter = find_converter(args.llama_cpp_src, work)
    files: dict[str, Path] = {}
    for key in keys:
        out = work / f"{name}-{key}.gguf"
        files[key] = out
        if out.exists():
            continue
        if key == "q4_0":  # the converter writes no Q4_0; quantize the most precise file there is
            base = next((files[k] for k in ("f32", "f16", "bf16") if k in files), None)
            if base is None:
                base = work / f"{name}-f16.gguf"
                if not base.exists():
                    convert(folder, "f16", base, converter)
            quantize(base, out, key, args.threads)
        else:
            convert(folder, key, out, converter)
    return files


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type ``path`` holds (Q4_0 files keep some tensors finer)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


# --------------------------------------------------------------------------- engines

@dataclass
class Sample:
    """One timed generate: time to first token and the later per-step times (seconds)."""

    first_s: float
    steps_s: list[float] = field(default_factory=list)
    batch: int = 1

    def to_dict(self) -> dict[str, Any]:
        med = statistics.median(self.steps_s) if self.steps_s else None
        return {"first_s": self.first_s, "steps_s": self.steps_s, "batch": self.batch,
                "median_step_ms": None if med is None else med * 1e3,
                "tokens_per_s": (len(self.steps_s) * self.batch / sum(self.steps_s)
                                 if self.steps_s else None),
                # batch / median step: not swayed by one slow step (a compile, a busy machine)
                "median_tokens_per_s": self.batch / med if med else None}


class LlamaCppVariant:
    """One GGUF file in llama.cpp: batch-1 greedy decode, prefill, batch-N decode, all logits."""

    def __init__(self, path: Path, threads: int, n_ctx: int, batch: int) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self.llama_cpp = llama_cpp
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.threads, self.n_ctx, self.batch = threads, n_ctx, batch
        self._multi = None  # the batch-N context, made at first use

    def _last_logits(self, ctx, index: int = -1) -> np.ndarray:
        ptr = self.llama_cpp.llama_get_logits_ith(ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[Sample, list[int]]:
        """Greedy ``new_tokens`` tokens after ``prompt`` from an empty cache."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(self._last_logits(llm._ctx.ctx).argmax())
        times, out = [time.perf_counter()], [token]
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(self._last_logits(llm._ctx.ctx).argmax())
            times.append(time.perf_counter())
            out.append(token)
        steps = [b - a for a, b in zip(times, times[1:])]
        return Sample(times[0] - start, steps), out

    def _multi_context(self, prompt_len: int):
        """A context of ``self.batch`` sequences and a llama_batch holding all their prompts."""
        if self._multi is None:
            from llama_cpp import _internals

            params = self.llama_cpp.llama_context_default_params()
            params.n_ctx = self.n_ctx * self.batch
            params.n_batch = max(512, prompt_len * self.batch)
            params.n_ubatch = 512
            params.n_seq_max = self.batch
            params.n_threads = params.n_threads_batch = self.threads
            params.flash_attn_type = self.llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as Llama()
            ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
            batch = _internals.LlamaBatch(n_tokens=params.n_batch, embd=0,
                                          n_seq_max=self.batch, verbose=False)
            self._multi = (ctx, batch)
        return self._multi

    def generate_batch(self, prompt: list[int], new_tokens: int) -> Sample:
        """``self.batch`` copies of ``prompt`` as separate sequences, prefilled in one
        llama_batch, then decoded together: one llama_batch of ``self.batch`` tokens a step."""
        ctx, batch = self._multi_context(len(prompt))
        ctx.kv_cache_clear()
        n = len(prompt)
        start = time.perf_counter()
        batch.reset()
        for seq in range(self.batch):
            batch.add_sequence(prompt, seq, False)  # positions 0..n-1, logits at the last
        ctx.decode(batch)
        tokens = [int(self._last_logits(ctx.ctx, seq * n + n - 1).argmax())
                  for seq in range(self.batch)]
        times = [time.perf_counter()]
        b = batch.batch
        for step in range(new_tokens - 1):
            b.n_tokens = self.batch
            for i, tok in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, n + step, 1, True
                b.seq_id[i][0] = i
            ctx.decode(batch)
            tokens = [int(self._last_logits(ctx.ctx, i).argmax()) for i in range(self.batch)]
            times.append(time.perf_counter())
        steps = [t1 - t0 for t0, t1 in zip(times, times[1:])]
        return Sample(times[0] - start, steps, self.batch)

    def all_logits(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of ``ids`` (a separate ``logits_all`` context)."""
        from llama_cpp import Llama

        llm = Llama(model_path=self.llm.model_path, n_ctx=len(ids) + 8, n_batch=len(ids),
                    n_ubatch=len(ids), n_threads=self.threads, n_threads_batch=self.threads,
                    logits_all=True, verbose=False)
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        llm.close()
        return logits


class ShardwiseVariant:
    """``init_inference`` on a fresh copy of the HF model, injected with graphs."""

    def __init__(self, model, kwargs: dict[str, Any], max_tokens: int) -> None:
        import shardwise

        start = time.perf_counter()
        self.engine = shardwise.init_inference(model, replace_with_kernel_inject=True,
                                               enable_graph=True, max_tokens=max_tokens, **kwargs)
        self.init_s = time.perf_counter() - start
        report = getattr(self.engine, "quantization", None)
        self.quant_summary = report.summary() if report is not None else None
        self.module = self.engine.module
        cfg = self.module.generation_config
        eos = cfg.eos_token_id
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else (
            (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0)

    def _generate(self, ids: torch.Tensor, new_tokens: int):
        from shardwise.generation import timed_generate

        kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                  "do_sample": False, "pad_token_id": self.pad}
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return timed_generate(self.engine, inputs, **kwargs)  # engine.generate: shardwise's loop

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[Sample, list[int]]:
        output, t = self._generate(torch.tensor([prompt]), new_tokens)
        return Sample(t.prefill_s, list(t.per_token_s)), output[0, len(prompt):].tolist()

    def generate_batch(self, prompt: list[int], new_tokens: int, batch: int) -> Sample:
        _, t = self._generate(torch.tensor([prompt] * batch), new_tokens)
        return Sample(t.prefill_s, list(t.per_token_s), batch)

    def all_logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.module(torch.tensor([ids])).logits[0].float().numpy()


# --------------------------------------------------------------------------- measurements

def quality(logits: np.ndarray, ids: list[int], ref_logits: np.ndarray) -> dict[str, float]:
    """Against the fp32 model's ``ref_logits`` at every position but the last: agreement of the
    argmax, and the mean KL divergence KL(fp32 || this) of the next-token distributions (as
    llama.cpp's ``llama-perplexity --kl-divergence`` reports it: far less noisy than the
    agreement, which counts only the positions where the top token flips); and the perplexity
    of the text's next tokens."""
    x = torch.from_numpy(logits[:-1]).double()
    ref = torch.from_numpy(ref_logits[:-1]).double()
    target = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(x, target).item()
    kl = torch.nn.functional.kl_div(x.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    agree = float((x.argmax(-1) == ref.argmax(-1)).double().mean())
    return {"agreement": agree, "kl_divergence": kl, "perplexity": math.exp(nll),
            "positions": len(ids) - 1}


def idle(seconds: float) -> None:
    """Let both engines' OpenMP pools stop spinning (see the module docstring)."""
    if seconds > 0:
        time.sleep(seconds)


def warm_up(variant, prompt: list[int], long_prompt: list[int], args) -> None:
    """One untimed run of every timed call: batch 1, the long prompt, and the batched decode.
    shardwise compiles its decode step once per batch bucket on first use (tens of seconds on
    a shared 2-core machine, minutes for a large model); without this warm-up the batched
    decode's first step held that compile and its tokens/s was the compile's, not decode's."""
    variant.generate(prompt, args.new_tokens)
    if long_prompt:
        variant.generate(long_prompt, 1)
    if args.batch > 1:
        if isinstance(variant, LlamaCppVariant):
            variant.generate_batch(prompt, 2)
        else:
            variant.generate_batch(prompt, 2, args.batch)


def pool_check(llama_variant, shard_variant, prompt, new_tokens, idle_s, tries=3) -> dict:
    """shardwise's decode ms/token right after llama.cpp's decode, with no pause and with
    ``idle_s`` (median of ``tries`` each, alternated)."""
    result: dict[str, list[float]] = {"no_pause": [], "pause": []}
    for _ in range(tries):
        for key, pause in (("no_pause", 0.0), ("pause", idle_s)):
            idle(idle_s)
            llama_variant.generate(prompt, new_tokens)
            idle(pause)
            sample, _ = shard_variant.generate(prompt, new_tokens)
            result[key].append(statistics.median(sample.steps_s) * 1e3)
    return {"idle_s": idle_s, "shardwise_ms_after_llama_cpp": result,
            "median_no_pause_ms": statistics.median(result["no_pause"]),
            "median_pause_ms": statistics.median(result["pause"])}


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "load_average_start": os.getloadavg()}


def versions() -> dict[str, Any]:
    import gguf
    import llama_cpp
    import transformers

    import shardwise

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    try:
        gguf_version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        gguf_version = getattr(gguf, "__version__", None)
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "shardwise": getattr(shardwise, "__version__", None), "shardwise_commit": commit,
            "llama_cpp_python": llama_cpp.__version__, "gguf": gguf_version,
            "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode()}


def summarize(samples: list[dict], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(values) if values else None


def write_chart(report: dict, out: Path) -> None:
    """Grouped bars: decode ms/token of both engines per precision."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no chart")
        return
    rows = report["summary"]
    labels = [r["precision"] + "-bit" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, engine in ((-0.2, "shardwise"), (0.2, "llama_cpp")):
        vals = [r[engine]["decode_ms"] or 0 if r[engine] else 0 for r in rows]
        names = [(r[engine] or {}).get("variant", "") for r in rows]
        bars = ax.bar(x + offset, vals, 0.4, label=engine.replace("_", "."))
        for bar, name in zip(bars, names):
            ax.annotate(name, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_ylabel("decode ms/token (batch 1, lower is better)")
    ax.set_title(f"{report['model']}: shardwise vs llama.cpp, {report['settings']['threads']} "
                 f"threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    log(f"wrote {out}")


# --------------------------------------------------------------------------- the run

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp-src", required=True,
                   help="llama-cpp-python sdist (.tar.gz) or a llama.cpp source tree")
    p.add_argument("--model", help="a Hugging Face model folder (default: embedded SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape")
    p.add_argument("--work", default="/tmp/shardwise-peers", help="model folders and GGUFs")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--precisions", nargs="+", default=["32", "16", "8", "4"],
                   choices=["32", "16", "8", "4"])
    p.add_argument("--sw-16", choices=["bf16", "fp32-bf16w", "fp32-fp16w"], default=None,
                   help="shardwise's 16-bit variant: the bf16 model, or fp32 compute over "
                        "bf16/fp16 weights (weight_dtype; the default: the --gguf-16 file's "
                        "weight dtype, as llama.cpp runs it)")
    p.add_argument("--gguf-16", choices=["f16", "bf16"], default="f16",
                   help="llama.cpp's 16-bit file (default f16)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each variant once)")
    p.add_argument("--quant-group", type=int, default=None,
                   help="shardwise int8/int4 group size (default: its own, int4 128; 32 is "
                        "Q8_0/Q4_0's block)")
    p.add_argument("--int8-activation-block", type=int, choices=[16, 32], default=None,
                   help="A/B of the native int8 kernel's activation blocks: the largest block "
                        "under 8-bit weights (kernels/reference/quant.py MAX_ACTIVATION_BLOCK; "
                        "default: the library's, 16)")
    p.add_argument("--quant-head", action="store_true",
                   help="quantize shardwise's output head too (llama.cpp's files quantize theirs)")
    p.add_argument("--quant-compute", choices=sorted(QUANT_COMPUTE), default="bf16",
                   help="compute dtype of the int8/int4 variants (llama.cpp keeps f32 activations)")
    p.add_argument("--quant-head-bits", type=int, choices=[4, 8], default=None,
                   help="with --quant-head: the head's bits (default: shardwise's, 8 for a head "
                        "tied to the embeddings, as llama.cpp's Q4_0 files keep theirs at Q8_0)")
    p.add_argument("--quality-only", action="store_true",
                   help="only the quality pass: no warm-up, no timed rounds, no pool check")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--long-prompt", type=int, default=512, help="first-token prompt (0: skip)")
    p.add_argument("--batch", type=int, default=8, help="batched decode size (0: skip)")
    p.add_argument("--batch-tokens", type=int, default=16, help="tokens per batched run")
    p.add_argument("--batch-rounds", type=int, default=1,
                   help="rounds that also time the batched decode (the first ones)")
    p.add_argument("--idle-s", type=float, default=0.5, help="pause before every timed call")
    p.add_argument("--no-pool-check", action="store_true",
                   help="skip measuring the pause's effect (int4 after Q4_0, with and without)")
    p.add_argument("--no-quality", action="store_true", help="skip the logits comparison")
    p.add_argument("--quality-tokens", type=int, default=256)
    p.add_argument("--output", help="JSON path (default benchmarks/results/peers-<model>.json)")
    return p.parse_args(argv)


def token_ids(folder: Path, n: int) -> list[int]:
    """The first ``n`` token ids of TEXT (repeated as needed) with the model's tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(TEXT, add_special_tokens=False)["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_quality(variants: dict, hf_logits: np.ndarray, ids: list[int]) -> dict:
    out = {"hf_fp32": quality(hf_logits, ids, hf_logits)}
    for name, v in variants.items():
        log(f"quality: {name}")
        out[name] = quality(v.all_logits(ids), ids, hf_logits)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info()  # the load average at the start
    if args.int8_activation_block:  # before any weight is packed (the block is packed with it)
        from shardwise.kernels.reference import quant as ref_quant

        ref_quant.MAX_ACTIVATION_BLOCK[8] = args.int8_activation_block
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder, name = prepare_model(args, work)
    pairs = pairs_for(args.precisions, args.gguf_16, args.sw_16)
    keys = [p.gguf for p in pairs if p.gguf]
    ggufs = build_ggufs(folder, name, keys, args, work)

    prompt = token_ids(folder, args.prompt_len)
    long_prompt = token_ids(folder, args.long_prompt) if args.long_prompt else []
    quality = 0 if args.no_quality else args.quality_tokens  # the quality pass's prompt too
    max_tokens = max(args.prompt_len + args.new_tokens, args.long_prompt + 1, quality) + 16
    variants: dict[str, Any] = {}
    init_s: dict[str, float] = {}
    hf_logits = None
    qids = token_ids(folder, args.quality_tokens)
    for pair in pairs:
        if pair.gguf:
            key = f"llama.cpp {GGUF_NAMES[pair.gguf]}"
            log(f"loading {key}")
            start = time.perf_counter()
            variants[key] = LlamaCppVariant(ggufs[pair.gguf], args.threads, max_tokens,
                                            args.batch)
            init_s[key] = time.perf_counter() - start
        if pair.shardwise:
            key = f"shardwise {pair.shardwise}"
            log(f"init_inference {key}")
            model = load_hf(folder)
            if hf_logits is None and not args.no_quality:
                with torch.no_grad():
                    hf_logits = model(torch.tensor([qids])).logits[0].float().numpy()
            variants[key] = ShardwiseVariant(model, shardwise_kwargs(pair.shardwise, args),
                                             max_tokens)
            init_s[key] = variants[key].init_s
            log(f"  {init_s[key]:.1f} s")

    names = list(variants)
    if args.quality_only:
        args.rounds, args.no_pool_check = 0, True
    else:
        log("warm-up (graph capture, batch buckets 1 and --batch)")
        for n in names:
            warm_up(variants[n], prompt, long_prompt, args)
    report_pool = None
    if not args.no_pool_check and "llama.cpp Q4_0" in variants and "shardwise int4" in variants:
        log("pool check")
        report_pool = pool_check(variants["llama.cpp Q4_0"], variants["shardwise int4"],
                                 prompt, args.new_tokens, args.idle_s)
        log(f"  {report_pool['median_no_pause_ms']:.2f} ms without pause, "
            f"{report_pool['median_pause_ms']:.2f} ms with")

    samples: dict[str, dict[str, list]] = {n: {"decode": [], "first_token_long": [],
                                               "batch": [], "tokens": []} for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        log(f"round {r + 1}/{args.rounds}")
        for n in order:
            v = variants[n]
            idle(args.idle_s)
            sample, tokens = v.generate(prompt, args.new_tokens)
            samples[n]["decode"].append(sample.to_dict())
            samples[n]["tokens"].append(tokens)
            if long_prompt:
                idle(args.idle_s)
                sample, _ = v.generate(long_prompt, 1)
                samples[n]["first_token_long"].append(sample.to_dict())
            if args.batch > 1 and r < args.batch_rounds:
                idle(args.idle_s)
                try:
                    if isinstance(v, LlamaCppVariant):
                        sample = v.generate_batch(prompt, args.batch_tokens)
                    else:
                        sample = v.generate_batch(prompt, args.batch_tokens, args.batch)
                    samples[n]["batch"].append(sample.to_dict())
                except Exception as exc:  # noqa: BLE001 - reported, the rest goes on
                    samples[n]["batch"].append({"error": f"{type(exc).__name__}: {exc}"})

    qual = None
    if not args.no_quality:
        idle(args.idle_s)
        qual = run_quality(variants, hf_logits, qids)

    summary = []
    for pair in pairs:
        row: dict[str, Any] = {"precision": pair.precision}
        for engine, key in (("shardwise", f"shardwise {pair.shardwise}" if pair.shardwise else None),
                            ("llama_cpp", f"llama.cpp {GGUF_NAMES[pair.gguf]}" if pair.gguf
                             else None)):
            if key is None:
                row[engine] = None
                continue
            s = samples[key]
            row[engine] = {
                "variant": key.split(" ", 1)[1],
                "decode_ms": summarize(s["decode"], "median_step_ms"),
                "first_token_64_s": summarize(s["decode"], "first_s"),
                "first_token_long_s": summarize(s["first_token_long"], "first_s"),
                "batch_tokens_per_s": summarize(s["batch"], "tokens_per_s"),
                "batch_median_tokens_per_s": summarize(s["batch"], "median_tokens_per_s"),
                "init_s": init_s[key],
                "quality": qual.get(key) if qual else None,
            }
            summary_line = getattr(variants[key], "quant_summary", None)
            if summary_line:
                row[engine]["quantization"] = summary_line
        sw, lc = row["shardwise"], row["llama_cpp"]
        row["ratio_shardwise_over_llama_cpp"] = (
            sw["decode_ms"] / lc["decode_ms"] if sw and lc and sw["decode_ms"] and lc["decode_ms"]
            else None)
        summary.append(row)
        log(json.dumps(row))

    machine["load_average_end"] = os.getloadavg()
    report = {
        "benchmark": "peers/llama_cpp", "model": name, "model_folder": str(folder),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine, "versions": versions(),
        "settings": {k: v for k, v in vars(args).items()},
        # e.g. SHARDWISE_CPU_QUANT_KERNEL=torch (native kernels off): part of what was measured
        "environment": {k: v for k, v in os.environ.items() if k.startswith("SHARDWISE_")},
        "ggufs": {k: {"path": str(p), "bytes": p.stat().st_size,
                      "tensor_types": gguf_tensor_types(p)} for k, p in ggufs.items()},
        "pool_check": report_pool, "quality_reference": "HF fp32 model, teacher-forced",
        "hf_fp32_quality": qual.get("hf_fp32") if qual else None,
        "summary": summary, "samples": samples,
    }
    out = Path(args.output) if args.output else RESULTS / f"peers-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    log(f"wrote {out}")
    write_chart(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

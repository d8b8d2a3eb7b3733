"""Pipeline stages composed with the checkpoint loader, weight quantization, offload and saving.

* ``checkpoint=`` with ``pipeline_parallel``: each rank reads only its stage's tensors of a
  ``save_pretrained`` folder (single file and sharded safetensors) — its decoder layers, the
  embedding on the first stage, the head on the last (GPT-2's tied head: both end stages read the
  one tensor), the small shared tensors (final norm, position embeddings) on every stage. The
  reader is wrapped (a subclass swapped in for the loader's) to record every key each rank read.
  Parity with ``from_pretrained``: fp32 logits within :data:`ATOL`, 32 greedy tokens identical,
  at PP=2 (2 ranks) and PP=2 × TP=2 (4 ranks).
* ``quant=`` (int8 / int4 weight-only) with ``pipeline_parallel``: each rank quantizes only its
  stage's linears; the tokens equal the single-process quantized engine's, the logits are within
  the quant bounds of tests/test_quant.py against HF, and ``close()`` gives back the same
  dequantized weights as the single-process engine's close. Also quantize-on-read from a
  checkpoint, and int8 at PP=2 × TP=2 (against HF within the bounds). The output head too
  (``lm_head``, from a checkpoint; GPT-2's tied table, Llama's own head): fp32 logits within
  1e-4 of the single-process engine quantized alike, 32 tokens identical.
* ``offload=`` (from disk) with ``pipeline_parallel``: each rank streams, and stores, only its
  stage's modules; logits and tokens equal the resident model's. Also with ``checkpoint=``
  (loaded straight into blobs): each rank reads only its stage's tensors into its own shard.
* Saving (``engine.save_checkpoint``) from plain and from injected stages: the folder reloads
  with and without stages.
* Bad input: a checkpoint missing a tensor of stage 1 fails on every rank — stage 0 too, which
  would not read it — with the loader's named error before any data is read.

The references (HF and the single-process quantized engines) are computed once in the test
process; all 2-rank cases run in ONE pair of processes, the 4-rank ones in one launch.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import shardwise
from families import QUANT_BOUNDS
from models import logit_parity, prompt_ids, tiny_causal_lm
from tp_harness import with_random_biases

NEW_TOKENS = 32
#: fp32, PP=2 (× TP=2) from a checkpoint vs HF's from_pretrained (the issue's bound)
ATOL = 1e-4
GEN = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
           pad_token_id=0)
PP = {"pipeline_parallel": {"pp_size": 2}}
#: the folders written once: name → (family, save_pretrained kwargs)
FOLDERS = {"llama": ("llama", {}), "gpt2-sharded": ("gpt2", {"max_shard_size": "20KB"})}
#: quantized runs: name → (family, bits, checkpoint folder or None)
QUANT = {"llama-int8": ("llama", 8, None), "gpt2-int4": ("gpt2", 4, None),
         "llama-int8-ckpt": ("llama", 8, "llama")}
QDTYPE = torch.bfloat16
#: models handed in whose resident fp32 outputs the offloaded and the injected-and-saved stages
#: must match: Llama (untied), GPT-2 (tied head)
RESIDENT_ARCHS = ("llama", "gpt2")
#: the output head quantized too (``lm_head``), fp32: name → (family, checkpoint folder or None
#: for the model handed in, bits); GPT-2's head is tied to its embedding (int4 weights: the tied
#: table gets 8 bits), Llama's not
QUANT_HEAD = {"gpt2-int4-head": ("gpt2", "gpt2-sharded", 4),
              "llama-int8-head": ("llama", "llama", 8),
              "gpt2-int4-head-handed-in": ("gpt2", None, 4),
              "opt-int8-head-handed-in": ("opt", None, 8)}


def _ids(vocab: int) -> torch.Tensor:
    return prompt_ids(batch=2, length=8, vocab=vocab)


def _layers(model: nn.Module) -> nn.ModuleList:
    from shardwise.moe.block import decoder_layers
    from shardwise.policy import policy_for

    return decoder_layers(model, policy_for(model))


# ----- references, in the test process --------------------------------------------------------

def _quant_reference(arch: str, bits: int, folder: Path | None) -> dict:
    """The single-process quantized engine: its logits, tokens, quantized layers, and the
    weights its close() gives back (dequantized)."""
    quant = {"weight": {"num_bits": bits}}
    if folder is None:
        model = tiny_causal_lm(arch)
        engine = shardwise.init_inference(model, device="cpu", dtype=QDTYPE, quant=quant)
    else:
        engine = shardwise.init_inference(None, checkpoint=str(folder), device="cpu",
                                          dtype=QDTYPE, quant=quant)
    ids = _ids(engine.module.config.vocab_size)
    out = dict(logits=engine(input_ids=ids).logits.float(),
               tokens=engine.generate(ids, **GEN),
               layers=sorted(engine.quantization.layers))
    given_back = engine.close()
    if given_back is not None:
        out["given_back"] = {k: v.clone() for k, v in given_back.state_dict().items()}
    return out


def _references(root: Path) -> None:
    """Every reference the ranks compare with, saved to ``root / "refs.pt"``."""
    refs: dict = {"hf": {}, "quant": {}}
    for name, (arch, kwargs) in FOLDERS.items():
        with_random_biases(tiny_causal_lm(arch)).save_pretrained(root / name, **kwargs)
        ref = transformers.AutoModelForCausalLM.from_pretrained(root / name,
                                                                dtype=torch.float32).eval()
        ids = _ids(ref.config.vocab_size)
        with torch.no_grad():
            refs["hf"][name] = dict(logits=ref(ids).logits, tokens=ref.generate(ids, **GEN),
                                    keys=sorted(_checkpoint_keys(root / name)))
    for name, (arch, bits, folder) in QUANT.items():
        if folder is None:
            ref = tiny_causal_lm(arch)
        else:
            ref = transformers.AutoModelForCausalLM.from_pretrained(root / folder).eval()
        with torch.no_grad():
            hf_logits = ref(_ids(ref.config.vocab_size)).logits
        refs["quant"][name] = dict(hf_logits=hf_logits, **_quant_reference(
            arch, bits, root / folder if folder else None))
    refs["resident"] = {}
    for arch in RESIDENT_ARCHS:  # the resident fp32 model the offloaded stages must match
        model = tiny_causal_lm(arch)
        ids = _ids(model.config.vocab_size)
        with torch.no_grad():
            refs["resident"][arch] = dict(logits=model(ids).logits,
                                          tokens=model.generate(ids, **GEN))
    refs["quant_head"] = {name: _quant_head_reference(arch, root / folder if folder else None,
                                                      bits)
                          for name, (arch, folder, bits) in QUANT_HEAD.items()}
    _broken(root / "llama", root / "llama-no-layer1-q")
    torch.save(refs, root / "refs.pt")


def _head_quant(bits: int) -> dict:
    return {"weight": {"num_bits": bits}, "lm_head": True}


def _head_engine(arch: str, folder: Path | None, bits: int, **kwargs):
    """An fp32 engine with the head quantized too: from ``folder``, or ``arch``'s tiny model
    handed in (None)."""
    if folder is None:
        return shardwise.init_inference(tiny_causal_lm(arch), device="cpu", dtype=torch.float32,
                                        quant=_head_quant(bits), **kwargs)
    return shardwise.init_inference(None, checkpoint=str(folder), device="cpu",
                                    dtype=torch.float32, quant=_head_quant(bits), **kwargs)


def _quant_head_reference(arch: str, folder: Path | None, bits: int) -> dict:
    """The single-process fp32 engine (:func:`_head_engine`) with its head quantized: logits,
    tokens, the settings its head got."""
    engine = _head_engine(arch, folder, bits)
    ids = _ids(engine.module.config.vocab_size)
    head = engine.quantization.layers["lm_head"]
    out = dict(logits=engine(input_ids=ids).logits, tokens=engine.generate(ids, **GEN),
               head=(head.bits, head.group_size))
    engine.close()
    return out


def _broken(good: Path, out: Path) -> None:
    """A copy of ``good`` without one tensor of decoder layer 1 (stage 1's)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    state = load_file(str(good / "model.safetensors"))
    del state["model.layers.1.self_attn.q_proj.weight"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((good / "config.json").read_text())


def _checkpoint_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as fh:
            keys |= set(fh.keys())
    return keys


# ----- the ranks' cases -----------------------------------------------------------------------

class _Recorded:
    """Swaps a subclass of the loader's ``Reader`` in that records every key read (and the
    files opened), for the duration of a ``with`` block."""

    def __enter__(self) -> "_Recorded":
        from shardwise.checkpoint import loader

        self.keys, self.files, self._module = set(), set(), loader
        self._original = original = loader.Reader
        record = self

        class RecordingReader(original):
            def read(self, key, dim, ranges, dtype):
                record.keys.add(key)
                return super().read(key, dim, ranges, dtype)

            def read_into(self, key, dest):
                record.keys.add(key)
                return super().read_into(key, dest)

            def _fd(self, path):
                record.files.add(Path(path).name)
                return super()._fd(path)

        loader.Reader = RecordingReader
        return self

    def __exit__(self, *exc) -> None:
        self._module.Reader = self._original


def checkpoint_case(rank: int, root: str, name: str, tp: int = 1, meta_model: bool = False
                    ) -> dict:
    """Load folder ``name`` with PP=2 (× tp): the keys this rank read, parity with HF, and for
    ``meta_model`` (the user's model on meta) that close() gives it back."""
    refs = torch.load(Path(root, "refs.pt"))["hf"][name]
    folder = Path(root, name)
    model = None
    if meta_model:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(folder))
    kwargs = {**PP, **({"tensor_parallel": {"tp_size": tp}} if tp > 1 else {})}
    with _Recorded() as read:
        engine = shardwise.init_inference(model, checkpoint=str(folder), device="cpu",
                                          dtype=torch.float32, **kwargs)
    ids = _ids(engine.module.config.vocab_size)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    logits = engine(input_ids=mine).logits
    tokens = engine.generate(mine, **GEN)
    stages, load = engine.stages, engine.checkpoint_load
    names = {id(m): n for n, m in engine.module.named_modules()}
    layer_names = [names[id(layer)] for layer in _layers(engine.module)]
    meta_left = [n for n, p in engine.module.named_parameters() if p.is_meta]
    out = dict(
        max_abs=(logits - refs["logits"]).abs().max().item(),
        tokens_equal=torch.equal(tokens, refs["tokens"]), tokens=tokens.tolist(),
        read=sorted(read.keys), files=sorted(read.files), all_keys=refs["keys"],
        layers=list(stages.layers), bounds=[list(b) for b in stages.plan.bounds],
        cost=stages.plan.costs[stages.plan.coord],
        first=stages.plan.first, last=stages.plan.last, layer_names=layer_names,
        skipped=load.skipped, bytes_read=load.bytes_read, meta_left=meta_left,
        param_bytes=sum(p.numel() * p.element_size() for p in engine.module.parameters()),
        summary=load.summary())
    given_back = engine.close()
    out["given_back_meta"] = (given_back is model and all(
        p.is_meta for p in given_back.parameters())) if meta_model else None
    return out


def broken_case(rank: int, root: str) -> dict:
    """A checkpoint missing a tensor of stage 1's layer: every rank — stage 0 too, which would
    not read it — fails with the loader's named error before reading any data."""
    with _Recorded() as read:
        try:
            shardwise.init_inference(None, checkpoint=str(Path(root, "llama-no-layer1-q")),
                                     device="cpu", dtype=torch.float32, **PP)
        except shardwise.ConfigError as exc:
            return dict(error=f"{type(exc).__name__}: {exc}", read=sorted(read.keys))
    return dict(error=None, read=sorted(read.keys))


def quant_tp_case(rank: int, root: str, bits: int) -> dict:
    """Llama quantized at PP=2 × TP=2: against HF within the quant bounds; the linears this
    rank quantized."""
    ref, model = tiny_causal_lm("llama"), tiny_causal_lm("llama")
    ids = _ids(ref.config.vocab_size)
    with torch.no_grad():
        hf_logits = ref(ids).logits
    engine = shardwise.init_inference(model, device="cpu", dtype=QDTYPE,
                                      quant={"weight": {"num_bits": bits}},
                                      tensor_parallel={"tp_size": 2}, **PP)
    logits = engine(input_ids=ids).logits.float()
    rel, agree = logit_parity(hf_logits, logits)
    names = {id(m): n for n, m in model.named_modules()}
    own = [names[id(layer)] for i, layer in enumerate(_layers(model)) if i in engine.stages.layers]
    quantized = sorted(engine.quantization.layers)
    tokens = engine.generate(ids, **GEN)
    engine.close()
    return dict(rel=rel, agree=agree, bits=bits, quantized=quantized, tokens=tokens.tolist(),
                outside_stage=[n for n in quantized
                               if not any(n.startswith(p + ".") for p in own)])


def quant_case(rank: int, root: str, name: str, offload: bool = False) -> dict:
    """A quantized PP=2 engine against the single-process quantized one and HF (``offload``:
    from the checkpoint straight into ``nvme`` blobs, quantized while read)."""
    arch, bits, folder = QUANT[name]
    ref = torch.load(Path(root, "refs.pt"))["quant"][name]
    quant = {"weight": {"num_bits": bits}}
    kwargs = {}
    if offload:
        blobs = Path(root, f"blobs-quant-{name}")
        blobs.mkdir(exist_ok=True)
        kwargs["offload"] = {"device": "nvme", "nvme_path": str(blobs)}
    if folder is None:
        model = tiny_causal_lm(arch)
        engine = shardwise.init_inference(model, device="cpu", dtype=QDTYPE, quant=quant, **PP)
    else:
        model = None
        engine = shardwise.init_inference(None, checkpoint=str(Path(root, folder)),
                                          device="cpu", dtype=QDTYPE, quant=quant, **PP,
                                          **kwargs)
    ids = _ids(engine.module.config.vocab_size)
    logits = engine(input_ids=ids).logits.float()
    tokens = engine.generate(ids, **GEN)
    rel, agree = logit_parity(ref["hf_logits"], logits)
    names = {id(m): n for n, m in engine.module.named_modules()}
    own = [names[id(layer)] for i, layer in enumerate(_layers(engine.module))
           if i in engine.stages.layers]
    quantized = sorted(engine.quantization.layers)
    from shardwise.quant import QuantLinear

    out = dict(
        tokens_equal=torch.equal(tokens, ref["tokens"]), tokens=tokens.tolist(),
        vs_single=(logits - ref["logits"]).abs().max().item(),
        single_scale=ref["logits"].abs().max().item(), rel=rel, agree=agree, bits=bits,
        quantized=quantized, single_layers=ref["layers"],
        outside_stage=[n for n in quantized if not any(n.startswith(p + ".") for p in own)],
        quant_modules=sum(isinstance(m, QuantLinear) for m in engine.module.modules()),
        offloaded=sorted(engine.offload.units) if engine.offload else None,
        own=sorted(own + [engine.stages.plan.embed_name if engine.stages.plan.first
                          else engine.stages.plan.head_name]))
    given_back = engine.close()
    if model is not None:
        out["given_back_equal"] = given_back is model and all(
            torch.equal(v, ref["given_back"][k]) for k, v in model.state_dict().items())
    return out


def quant_head_case(rank: int, root: str, name: str) -> dict:
    """The head quantized too (``lm_head``) at PP=2: against the single-process engine
    quantized alike; what each end stage holds of the head."""
    from shardwise.pipeline.quant import StageQuantEmbedding
    from shardwise.quant import QuantLinear

    arch, folder, bits = QUANT_HEAD[name]
    ref = torch.load(Path(root, "refs.pt"))["quant_head"][name]
    engine = _head_engine(arch, Path(root, folder) if folder else None, bits, **PP)
    ids = _ids(engine.module.config.vocab_size)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    logits = engine(input_ids=mine).logits
    tokens = engine.generate(mine, **GEN)
    model, plan = engine.module, engine.stages.plan
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    layers = engine.quantization.layers
    mine_head = layers.get(plan.embed_name if plan.first else plan.head_name)
    out = dict(
        vs_single=(logits - ref["logits"]).abs().max().item(),
        tokens_equal=torch.equal(tokens, ref["tokens"]), tied=plan.tied,
        first=plan.first, embed=type(embed).__name__, head=type(head).__name__,
        head_is_quant=isinstance(head, QuantLinear),
        embed_owns_table=isinstance(embed, StageQuantEmbedding)
        and isinstance(embed.table, QuantLinear),
        head_settings=(mine_head.bits, mine_head.group_size) if mine_head else None,
        ref_head_settings=list(ref["head"]),
        float_tables=[n for n, p in model.named_parameters() if p.dim() == 2 and any(
            n.startswith(part + ".") for part in (plan.embed_name, plan.head_name))])
    engine.close()
    return out


def offload_case(rank: int, root: str, arch: str, micro_batches: int = 1,
                 inject: bool = False) -> dict:
    """An fp32 model handed in (``inject``: kernel-injected), offloaded from disk at PP=2 (both
    ranks under one ``nvme_path``): tokens and logits against the resident model; the units
    this rank streams and the ones its store's manifest holds, against its stage's modules."""
    ref = torch.load(Path(root, "refs.pt"))["resident"][arch]
    blobs = Path(root, f"blobs-{arch}-{micro_batches}-{inject}")
    blobs.mkdir(exist_ok=True)
    pp = {"pipeline_parallel": {"pp_size": 2, "micro_batches": micro_batches},
          "replace_with_kernel_inject": inject}
    engine = shardwise.init_inference(tiny_causal_lm(arch), device="cpu", dtype=torch.float32,
                                      offload={"device": "nvme", "nvme_path": str(blobs)}, **pp)
    ids = _ids(engine.module.config.vocab_size)
    logits = engine(input_ids=ids).logits
    tokens = engine.generate(ids, **GEN)
    model, plan = engine.module, engine.stages.plan
    names = {id(m): n for n, m in model.named_modules()}
    stage = [names[id(layer)] for i, layer in enumerate(_layers(model)) if i in plan.layers]
    stage += [plan.embed_name] if plan.first else [plan.head_name]
    report = engine.offload
    manifest = json.loads(Path(report.path, "manifest.json").read_text())
    out = dict(max_abs=(logits - ref["logits"]).abs().max().item(),
               tokens_equal=torch.equal(tokens, ref["tokens"]), units=report.units,
               stage=sorted(stage), path=report.path,
               stored=sorted(u["name"] for u in manifest["units"]),
               coords=manifest["shard"]["coords"], reused=report.reused)
    engine.close()
    return out


def offload_checkpoint_case(rank: int, root: str, name: str) -> dict:
    """Folder ``name`` loaded with ``checkpoint=`` straight into offload blobs (``nvme``, both
    ranks under one ``nvme_path``) at PP=2: tokens and logits against HF's ``from_pretrained``;
    the keys this rank read, the units it streams and what its blob directory holds, against
    its stage's modules."""
    refs = torch.load(Path(root, "refs.pt"))["hf"][name]
    blobs = Path(root, f"blobs-ckpt-{name}")
    blobs.mkdir(exist_ok=True)
    with _Recorded() as read:
        engine = shardwise.init_inference(None, checkpoint=str(Path(root, name)), device="cpu",
                                          dtype=torch.float32, **PP,
                                          offload={"device": "nvme", "nvme_path": str(blobs)})
    ids = _ids(engine.module.config.vocab_size)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    logits = engine(input_ids=mine).logits
    tokens = engine.generate(mine, **GEN)
    model, plan, load, report = engine.module, engine.stages.plan, engine.checkpoint_load, \
        engine.offload
    names = {id(m): n for n, m in model.named_modules()}
    layer_names = [names[id(layer)] for layer in _layers(model)]
    stage = [layer_names[i] for i in plan.layers]
    stage += [plan.embed_name] if plan.first else [plan.head_name]
    manifest = json.loads(Path(report.path, "manifest.json").read_text())
    out = dict(max_abs=(logits - refs["logits"]).abs().max().item(),
               tokens_equal=torch.equal(tokens, refs["tokens"]), units=report.units,
               stage=sorted(stage), path=report.path, reused=report.reused,
               stored=sorted(u["name"] for u in manifest["units"]),
               blob_files=sorted(f.name for f in Path(report.path).iterdir()
                                 if f.name.startswith("unit")),
               shard=manifest["shard"], split=manifest["fingerprint"]["pp"],
               read=sorted(read.keys), all_keys=refs["keys"], layer_names=layer_names,
               layers=list(plan.layers), first=plan.first, last=plan.last,
               bounds=[list(b) for b in plan.bounds], skipped=load.skipped, summary=load.summary(),
               meta_left=[n for n, p in model.named_parameters() if p.is_meta])
    engine.close()
    return out


def _file_keys(folder: Path) -> dict[str, list[str]]:
    """Every safetensors file of ``folder`` → its tensor names."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            out[f.name] = sorted(handle.keys())
    return out


def save_case(rank: int, root: str, name: str) -> dict:
    """A PP=2 engine loaded from folder ``name`` (each rank holding only its stage's tensors)
    saves through ``engine.save_checkpoint`` (each stage its own file: ``save_stages_checkpoint``);
    the saved folder reloads at PP=2, at TP=2 (no stages) and with ``from_pretrained`` (rank 0),
    each against HF on the original folder."""
    refs = torch.load(Path(root, "refs.pt"))["hf"][name]
    out_dir = Path(root, f"saved-{name}")
    engine = shardwise.init_inference(None, checkpoint=str(Path(root, name)), device="cpu",
                                      dtype=torch.float32, **PP)
    index = Path(engine.save_checkpoint(str(out_dir)))
    engine.close()
    results = {}
    for label, kwargs in (("pp2", PP), ("tp2", {"tensor_parallel": {"tp_size": 2}})):
        again = shardwise.init_inference(None, checkpoint=str(out_dir), device="cpu",
                                         dtype=torch.float32, **kwargs)
        ids = _ids(again.module.config.vocab_size)
        mine = ids if rank == 0 else torch.zeros_like(ids)
        logits = again(input_ids=mine).logits
        tokens = again.generate(mine, **GEN)
        results[label] = dict(max_abs=(logits - refs["logits"]).abs().max().item(),
                              tokens_equal=torch.equal(tokens, refs["tokens"]))
        again.close()
    hf = None
    if rank == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(out_dir,
                                                                  dtype=torch.float32).eval()
        ids = _ids(model.config.vocab_size)
        with torch.no_grad():
            hf = dict(max_abs=(model(ids).logits - refs["logits"]).abs().max().item(),
                      tokens_equal=torch.equal(model.generate(ids, **GEN), refs["tokens"]))
    index_body = json.loads(index.read_text())
    return dict(reloaded=results, hf=hf, files=_file_keys(out_dir), all_keys=refs["keys"],
                index_files=sorted(set(index_body["weight_map"].values())),
                index_keys=sorted(index_body["weight_map"]))


def save_injected_case(rank: int, root: str, arch: str) -> dict:
    """Injected PP=2 stages (a model handed in) save through ``engine.save_checkpoint``; the
    folder reloads at PP=2, at TP=2 (no stages) and injected at PP=2, each against the
    resident model."""
    ref = torch.load(Path(root, "refs.pt"))["resident"][arch]
    out_dir = Path(root, f"saved-injected-{arch}")
    engine = shardwise.init_inference(tiny_causal_lm(arch), device="cpu", dtype=torch.float32,
                                      replace_with_kernel_inject=True, **PP)
    injected = type(engine._stack).__name__ if engine._stack is not None else None
    engine.save_checkpoint(str(out_dir))
    engine.close()
    results = {}
    for label, kwargs in (("pp2", PP), ("tp2", {"tensor_parallel": {"tp_size": 2}}),
                          ("pp2-injected", {**PP, "replace_with_kernel_inject": True})):
        again = shardwise.init_inference(None, checkpoint=str(out_dir), device="cpu",
                                         dtype=torch.float32, **kwargs)
        ids = _ids(again.module.config.vocab_size)
        logits = again(input_ids=ids).logits
        results[label] = dict(max_abs=(logits - ref["logits"]).abs().max().item(),
                              tokens_equal=torch.equal(again.generate(ids, **GEN),
                                                       ref["tokens"]))
        again.close()
    return dict(injected=injected, reloaded=results, files=_file_keys(out_dir))


#: quantized stages saved: name → (family, quant=, checkpoint folder or None: handed in)
SAVE_QUANT = {"llama-int8": ("llama", {"weight": {"num_bits": 8}}, None),
              "gpt2-int4-head": ("gpt2", _head_quant(4), "gpt2-sharded")}


def save_quant_case(rank: int, root: str, name: str) -> dict:
    """Quantized PP=2 stages (fp32) save through ``engine.save_checkpoint``: one shardwise
    quantized checkpoint of the whole model. Rank 0 keeps the saving engine's logits and
    tokens for the test process, which reloads the folder without stages."""
    arch, quant, folder = SAVE_QUANT[name]
    if folder is None:
        engine = shardwise.init_inference(tiny_causal_lm(arch), device="cpu",
                                          dtype=torch.float32, quant=quant, **PP)
    else:
        engine = shardwise.init_inference(None, checkpoint=str(Path(root, folder)),
                                          device="cpu", dtype=torch.float32, quant=quant, **PP)
    ids = _ids(engine.module.config.vocab_size)
    outputs = dict(logits=engine(input_ids=ids).logits, tokens=engine.generate(ids, **GEN))
    out_dir = Path(root, f"saved-quant-{name}")
    description = engine.save_checkpoint(str(out_dir))
    layers = sorted(engine.quantization.layers)
    engine.close()
    if rank == 0:
        torch.save(outputs, Path(root, f"saved-quant-{name}.pt"))
    again = shardwise.init_inference(None, checkpoint=description, device="cpu",
                                     dtype=torch.float32, **PP)  # each stage its layers
    staged = dict(max_abs=(again(input_ids=ids).logits - outputs["logits"]).abs().max().item(),
                  tokens_equal=torch.equal(again.generate(ids, **GEN), outputs["tokens"]))
    again.close()
    return dict(description=description, layers=layers, staged=staged, files=sorted(
        f.name for f in out_dir.iterdir()))


def _run_all(rank: int, world: int, root: str, table: dict) -> dict:
    os.environ.pop("OMP_NUM_THREADS", None)  # the accelerator splits the cores between ranks
    shardwise.get_accelerator("cpu").configure_process(rank, world)
    out = {}
    for name, (fn, *args) in table.items():
        start = time.perf_counter()
        try:
            out[name] = {"ok": True, **fn(rank, root, *args), "seconds":
                         time.perf_counter() - start}
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()}
    return out


PAIR = {
    "ckpt-llama": (checkpoint_case, "llama"),
    "ckpt-gpt2-sharded": (checkpoint_case, "gpt2-sharded"),
    "ckpt-llama-meta-model": (checkpoint_case, "llama", 1, True),
    **{f"quant-{name}": (quant_case, name) for name in QUANT},
    **{f"quant-{name}": (quant_head_case, name) for name in QUANT_HEAD},
    **{f"offload-{arch}": (offload_case, arch) for arch in RESIDENT_ARCHS},
    "offload-llama-micro-batches": (offload_case, "llama", 2),
    "offload-gpt2-injected": (offload_case, "gpt2", 1, True),
    **{f"offload-ckpt-{name}": (offload_checkpoint_case, name) for name in FOLDERS},
    "offload-ckpt-quant-llama-int8": (quant_case, "llama-int8-ckpt", True),
    "ckpt-missing-key": (broken_case,),
    "save-llama": (save_case, "llama"),
    "save-gpt2-sharded": (save_case, "gpt2-sharded"),
    **{f"save-injected-{arch}": (save_injected_case, arch) for arch in RESIDENT_ARCHS},
    **{f"save-quant-{name}": (save_quant_case, name) for name in SAVE_QUANT},
}
FOUR = {
    "ckpt-llama-tp2": (checkpoint_case, "llama", 2),
    "ckpt-gpt2-sharded-tp2": (checkpoint_case, "gpt2-sharded", 2),
    "quant-llama-int8-tp2": (quant_tp_case, 8),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pp-compose")
    _references(path)
    return path


def _launch(root: Path, world: int, table: dict, tmp: Path) -> list[dict]:
    from distributed import run_ranks

    results = run_ranks(partial(_run_all, world=world, root=str(root), table=table), world,
                        tmp, deadline_s=500)
    for res in results:
        assert res["ok"], res.get("trace", res.get("error"))
    return [res["value"] for res in results]


@pytest.fixture(scope="module")
def pair(root, tmp_path_factory):
    return _launch(root, 2, PAIR, tmp_path_factory.mktemp("pp-compose-2"))


@pytest.fixture(scope="module")
def four(root, tmp_path_factory):
    return _launch(root, 4, FOUR, tmp_path_factory.mktemp("pp-compose-4"))


def _case(ranks: list[dict], name: str) -> list[dict]:
    results = [r[name] for r in ranks]
    for r in results:
        assert r["ok"], r.get("trace", r.get("error"))
    return results


# ----- checkpoint= ----------------------------------------------------------------------------

def _stage_keys(r: dict) -> tuple[set[str], set[str]]:
    """(keys of this rank's decoder layers, keys of the other stages' layers) among all."""
    mine, others = set(), set()
    for key in r["all_keys"]:
        for i, layer in enumerate(r["layer_names"]):
            if key.startswith(layer + "."):
                (mine if i in r["layers"] else others).add(key)
    return mine, others


def _check_reads(results: list[dict], name: str) -> None:
    everything = set(results[0]["all_keys"])
    union = set()
    for r in results:
        read, (mine, others) = set(r["read"]), _stage_keys(r)
        assert mine and others, r["layer_names"]
        assert mine <= read, f"{name}: this stage's layers not all read: {sorted(mine - read)}"
        assert not read & others, f"{name}: another stage's tensors read: {sorted(read & others)}"
        assert r["skipped"] > 0 and not r["meta_left"], r["summary"]
        embed = {k for k in everything if "embed_tokens" in k or k.endswith("wte.weight")}
        head = {k for k in everything if k.startswith("lm_head.")}
        assert embed and (head or "gpt2" in name)  # GPT-2 saves its tied head as wte alone
        if r["first"] or (r["last"] and not head):  # tied: the last stage reads wte as its head
            assert embed <= read, f"{name}: the embedding is not read"
        else:
            assert not embed & read, f"{name}: the embedding read off the first stage"
        assert (head <= read) if r["last"] else not (head & read), f"{name}: the head"
        union |= read
    assert union == everything, f"{name}: never read: {sorted(everything - union)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt-llama", "ckpt-gpt2-sharded", "ckpt-llama-meta-model"])
def test_pp2_checkpoint_matches_from_pretrained(pair, name):
    results = _case(pair, name)
    print(f"{name} PP=2 fp32: max |logit diff| {max(r['max_abs'] for r in results):.2e}")
    for r in results:
        assert r["max_abs"] < ATOL, r["summary"]
        assert r["tokens_equal"], f"{name}: {NEW_TOKENS} greedy tokens differ from HF's"
    assert results[0]["tokens"] == results[1]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt-llama", "ckpt-gpt2-sharded", "ckpt-llama-meta-model"])
def test_each_pp_rank_reads_only_its_stages_tensors(pair, name):
    results = _case(pair, name)
    _check_reads(results, name)
    for r in results:  # about half the layers' bytes each (the embedding or head on top)
        assert r["bytes_read"] == r["param_bytes"], r["summary"]
    if "sharded" in name:  # a file holding none of a rank's tensors is never opened
        assert results[0]["files"] != results[1]["files"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt-llama", "ckpt-gpt2-sharded"])
def test_the_balance_counts_what_each_stage_holds(pair, name):
    """A stage's planned cost (its layers' bytes, the embedding's on the first stage, the
    head's on the last) is what it holds beyond the small tensors every stage keeps a copy of
    (final norm, position table): the same remainder on both. GPT-2's tied table is counted on
    both end stages because both hold it (the first as its embedding, the last as its head:
    two ranks, two copies), not once."""
    r0, r1 = _case(pair, name)
    assert r0["param_bytes"] - r0["cost"] == r1["param_bytes"] - r1["cost"] >= 0
    assert r0["cost"] > 0 and r1["cost"] > 0


@pytest.mark.slow
def test_a_meta_model_loaded_by_stages_comes_back_on_meta(pair):
    for r in _case(pair, "ckpt-llama-meta-model"):
        assert r["given_back_meta"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt-llama-tp2", "ckpt-gpt2-sharded-tp2"])
def test_pp2_tp2_checkpoint_reads_its_stage_and_matches_from_pretrained(four, name):
    results = _case(four, name)
    print(f"{name} PP=2 x TP=2 fp32: max |logit diff| {max(r['max_abs'] for r in results):.2e}")
    for r in results:
        assert r["max_abs"] < ATOL, r["summary"]
        assert r["tokens_equal"], f"{name}: {NEW_TOKENS} greedy tokens differ from HF's"
    assert len({str(r["tokens"]) for r in results}) == 1
    # a stage's two tp ranks (2s, 2s + 1) read its keys between them, each its own slices (a
    # row-parallel bias is read by tp rank 0 alone: the other adds zeros)
    stages = [dict(results[2 * s], read=sorted({*results[2 * s]["read"],
                                                 *results[2 * s + 1]["read"]}))
              for s in (0, 1)]
    _check_reads(stages, name)
    for s in (0, 1):
        assert set(results[2 * s + 1]["read"]) <= set(results[2 * s]["read"])
    for r in results:  # each rank its slices of its stage: under half of a whole stage
        assert r["bytes_read"] <= r["param_bytes"], r["summary"]


@pytest.mark.slow
def test_a_missing_tensor_of_another_stage_fails_every_rank_before_reading(pair):
    for r in _case(pair, "ckpt-missing-key"):
        assert r["error"] and "CheckpointError" in r["error"], r["error"]
        assert "missing keys (1): model.layers.1.self_attn.q_proj.weight" in r["error"]
        assert r["read"] == []


# ----- quant= ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUANT))
def test_pp2_quantized_matches_the_single_process_quantized_engine(pair, name):
    results = _case(pair, f"quant-{name}")
    for r in results:
        print(f"{name} PP=2: vs single-process {r['vs_single']:.2e}, vs HF rel {r['rel']:.4f} "
              f"agree {r['agree']:.2f}")
        assert r["tokens_equal"], f"{name}: tokens differ from the single-process quantized"
        assert r["vs_single"] <= 1e-2 * r["single_scale"]  # measured 0.0: the same layers
        max_rel, min_agree = QUANT_BOUNDS[r["bits"]]
        assert r["rel"] <= max_rel and r["agree"] >= min_agree, (r["rel"], r["agree"])
    assert results[0]["tokens"] == results[1]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUANT))
def test_each_pp_rank_quantizes_only_its_stages_layers(pair, name):
    results = _case(pair, f"quant-{name}")
    for r in results:
        assert r["quantized"] and not r["outside_stage"], r["outside_stage"]
        assert r["quant_modules"] == len(r["quantized"])
    both = results[0]["quantized"] + results[1]["quantized"]
    assert sorted(both) == results[0]["single_layers"]  # each layer once, all of them


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-int8", "gpt2-int4"])
def test_close_gives_back_the_single_process_dequantized_weights(pair, name):
    for r in _case(pair, f"quant-{name}"):
        assert r["given_back_equal"]


@pytest.mark.slow
def test_pp2_tp2_quantized_within_the_quant_bounds(four):
    results = _case(four, "quant-llama-int8-tp2")
    max_rel, min_agree = QUANT_BOUNDS[8]
    for r in results:
        print(f"llama int8 PP=2 x TP=2: vs HF rel {r['rel']:.4f} agree {r['agree']:.2f}")
        assert r["rel"] <= max_rel and r["agree"] >= min_agree, (r["rel"], r["agree"])
        assert r["quantized"] and not r["outside_stage"], r["outside_stage"]
    assert results[0]["quantized"] == results[1]["quantized"] != results[2]["quantized"]
    assert len({str(r["tokens"]) for r in results}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUANT_HEAD))
def test_pp2_with_the_head_quantized_matches_the_single_process_engine(pair, name):
    """``lm_head`` at PP=2: fp32 logits within 1e-4 of the single-process engine quantized
    alike and 32 greedy tokens identical; the last stage holds the quantized head, the first
    (tied) the same table quantized as its embedding, with the settings the whole model's
    head gets (8 bits for GPT-2's tied table under int4 weights), and no full-precision
    vocabulary table on either."""
    first, last = _case(pair, f"quant-{name}")
    for r in (first, last):
        print(f"{name} PP=2: vs single-process {r['vs_single']:.2e}")
        assert r["vs_single"] < ATOL and r["tokens_equal"], name
        assert r["embed"] == "RemoteEmbedding" if not r["first"] else r["head"] == "RemoteHead"
    assert first["first"] and not last["first"] and first["tied"] == last["tied"]
    assert last["head_is_quant"] and last["head_settings"] == last["ref_head_settings"]
    if first["tied"]:
        assert first["embed_owns_table"] and first["head_settings"] == last["head_settings"]
        assert first["head_settings"][0] == 8  # GPT-2's int4 weights, its tied table at 8
        assert first["float_tables"] == [] and last["float_tables"] == []
    else:  # an untied head: the first stage's embedding stays as it is
        assert first["embed"] == "Embedding" and first["head_settings"] is None
        assert last["float_tables"] == []


# ----- offload= -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [*RESIDENT_ARCHS, "llama-micro-batches", "gpt2-injected"])
def test_pp2_offloaded_stages_stream_only_their_own_layers(pair, name):
    """``offload=`` (from disk) at PP=2, also with micro-batches and kernel-injected: fp32
    logits within 1e-4 of the resident model and 32 greedy tokens identical; each rank
    streams, and its store holds, exactly its stage's
    modules (its layers, the embedding on the first stage, the head on the last), in a shard
    directory of its own."""
    first, last = _case(pair, f"offload-{name}")
    for r in (first, last):
        print(f"offload {name} PP=2: max |logit diff| {r['max_abs']:.2e}")
        assert r["max_abs"] < ATOL and r["tokens_equal"], name
        assert sorted(r["units"]) == r["stage"] == r["stored"], (r["units"], r["stored"])
    assert not set(first["units"]) & set(last["units"])
    assert first["path"] != last["path"]
    assert (first["coords"]["pp"], last["coords"]["pp"]) == (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDERS))
def test_pp2_offload_from_a_checkpoint_reads_and_stores_only_its_stage(pair, name):
    """``checkpoint=`` straight into offload blobs at PP=2 (Llama; GPT-2, tied head, sharded
    files): fp32 logits within 1e-4 of HF's ``from_pretrained`` and 32 greedy tokens identical;
    each rank reads only its stage's tensors, and its blob directory (a shard of its own:
    its stage, its units; the split in the shared fingerprint) holds exactly its stage's
    modules, one blob each."""
    first, last = _case(pair, f"offload-ckpt-{name}")
    _check_reads([first, last], name)
    for r in (first, last):
        print(f"offload from checkpoint {name} PP=2: max |logit diff| {r['max_abs']:.2e}")
        assert r["max_abs"] < ATOL and r["tokens_equal"], r["summary"]
        assert sorted(r["units"]) == r["stage"] == r["stored"], (r["units"], r["stored"])
        assert len(r["blob_files"]) == len(r["units"]) and not r["reused"], r["blob_files"]
        assert sorted(r["shard"]["units"]) == r["stage"]
    assert not set(first["units"]) & set(last["units"])
    assert first["path"] != last["path"]
    assert Path(first["path"]).parent == Path(last["path"]).parent  # one group: one split
    assert (first["shard"]["stage"], last["shard"]["stage"]) == (0, 1)
    assert first["split"] == last["split"] == {"size": 2, "bounds": first["bounds"]}


@pytest.mark.slow
def test_pp2_offload_from_a_checkpoint_quantized_while_read(pair):
    """``checkpoint=`` + ``quant=`` int8 + offload at PP=2: each rank quantizes its stage's
    linears while reading them into its blobs; tokens equal the single-process quantized
    engine's (no offload, no stages), logits within 1e-2 of its scale (measured 0.0)."""
    results = _case(pair, "offload-ckpt-quant-llama-int8")
    for r in results:
        assert r["tokens_equal"], "tokens differ from the single-process quantized engine"
        assert r["vs_single"] <= 1e-2 * r["single_scale"], r["vs_single"]
        assert r["quantized"] and not r["outside_stage"], r["outside_stage"]
        assert r["offloaded"] == r["own"], (r["offloaded"], r["own"])
    assert results[0]["tokens"] == results[1]["tokens"]


# ----- one process: what still does not compose -------------------------------------------------

def test_checkpoint_and_quant_are_accepted_with_stages():
    cfg = shardwise.InferenceConfig.build(**PP, checkpoint="/some/folder",
                                          quant={"weight": {"num_bits": 4}})
    assert cfg.pipeline_parallel.pp_size == 2 and cfg.quant["weight"]["num_bits"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2-sharded"])
def test_pipeline_stages_save_and_reload_at_another_parallelism(pair, name):
    """Each stage writes its own file of a Hugging Face sharded checkpoint (its layers; the
    first stage the embedding and the shared tensors, the last the head unless tied); the
    folder reloads at PP=2, at TP=2 and with from_pretrained, matching HF on the original."""
    r0, r1 = _case(pair, f"save-{name}")
    files = r0["files"]
    assert sorted(files) == r0["index_files"] == ["model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"]
    first, second = files["model-00001-of-00002.safetensors"], \
        files["model-00002-of-00002.safetensors"]
    assert not set(first) & set(second)  # each tensor once
    assert sorted(first + second) == r0["index_keys"] == r0["all_keys"]
    assert all(".layers.1." not in k and ".h.1." not in k for k in first)
    assert all(".layers.0." not in k and ".h.0." not in k for k in second)
    assert any(".layers.1." in k or ".h.1." in k for k in second)
    for r in (r0, r1):
        for label, got in r["reloaded"].items():
            assert got["max_abs"] < ATOL, f"{name} reloaded at {label}: {got['max_abs']}"
            assert got["tokens_equal"], f"{name} reloaded at {label}: tokens differ"
    assert r0["hf"]["max_abs"] < ATOL and r0["hf"]["tokens_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", RESIDENT_ARCHS)
def test_injected_stages_save_and_reload_with_and_without_stages(pair, arch):
    """Injected PP=2 stages save the model's own tensors, each stage its file: the folder
    reloads at PP=2, at TP=2 and injected at PP=2 with fp32 logits within 1e-4 of the resident
    model and 32 greedy tokens identical."""
    r0, r1 = _case(pair, f"save-injected-{arch}")
    assert r0["injected"] and r1["injected"]  # the stages ran injected when they saved
    first, second = r0["files"].values()  # each stage's file, each tensor once
    assert len(r0["files"]) == 2 and first and second and not set(first) & set(second)
    for r in (r0, r1):
        for label, got in r["reloaded"].items():
            print(f"{arch} injected stages saved, reloaded at {label}: {got['max_abs']:.2e}")
            assert got["max_abs"] < ATOL and got["tokens_equal"], (label, got)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAVE_QUANT))
def test_quantized_stages_save_one_checkpoint_that_reloads_without_stages(pair, root, name):
    """Quantized PP=2 stages (int8 handed in; int4 with GPT-2's tied head quantized, from a
    checkpoint) save one shardwise quantized checkpoint of the whole model: a rank file and
    the description, every stage's quantized layers in it (the tied table once, as the head);
    it reloads in one process without re-quantizing, with the saving stages' fp32 logits
    (within 1e-4) and 32 greedy tokens."""
    r0, r1 = _case(pair, f"save-quant-{name}")
    assert r0["description"] == r1["description"]
    for r in (r0, r1):  # reloaded at PP=2 too
        assert r["staged"]["max_abs"] < ATOL and r["staged"]["tokens_equal"], r["staged"]
    assert r0["files"] == ["config.json", "rank00-of-01.safetensors", "shardwise_checkpoint.json"]
    saved = torch.load(Path(root, f"saved-quant-{name}.pt"))
    engine = shardwise.init_inference(None, checkpoint=r0["description"], device="cpu",
                                      dtype=torch.float32)
    try:
        ids = _ids(engine.module.config.vocab_size)
        logits = engine(input_ids=ids).logits
        tokens = engine.generate(ids, **GEN)
        reloaded = sorted(engine.quantization.layers)
        embed = engine.module.get_input_embeddings()
    finally:
        engine.close()
    print(f"{name}: quantized stages saved, reloaded: {(logits - saved['logits']).abs().max():.2e}")
    assert (logits - saved["logits"]).abs().max() < ATOL
    assert torch.equal(tokens, saved["tokens"])
    stage_layers = set(r0["layers"]) | set(r1["layers"])
    if "head" in name:  # the first stage's copy of the tied table is not saved: the head's is
        stage_layers -= {n for n in r0["layers"] if "wte" in n}
        assert "lm_head" in reloaded and type(embed).__name__ == "QuantEmbedding"
    assert reloaded == sorted(stage_layers)

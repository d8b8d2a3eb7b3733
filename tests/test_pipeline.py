"""Pipeline-parallel inference (``pipeline_parallel={"pp_size": 2}``) on 2 gloo ranks: each rank
keeps about half the decoder layers (its stage), hidden states travel point-to-point, and every
rank returns the HF model's outputs — fp32 logits within :data:`ATOL`, 32 greedy tokens equal
(``engine.generate`` and the bare HF ``generate``), the same sampled tokens on both ranks — for
Llama, GPT-2, OPT, BLOOM and BERT (hidden states); ``engine.close()`` gives the whole model back
bit for bit. Bad settings fail with a ConfigError before any work, in one process.

All 2-rank cases run in ONE pair of processes (a module-scoped fixture, as in test_tp.py).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from torch import nn

import shardwise
from families import family
from models import forced_decode_logits, prompt_ids, tiny_causal_lm, tiny_encoder
from shardwise.pipeline import PipelineConfigError, RemoteLayer, balanced_bounds
from shardwise.plan import build_plan
from tp_harness import assert_parity, case, digest, pipeline_beam_case, table_fixture

PP = {"pipeline_parallel": {"pp_size": 2}}
NEW_TOKENS = 32
#: fp32, PP=2 vs the single-process model (the issue's bound). Each stage runs HF's own layers on
#: the hidden states it receives, so the measured difference is 0.0 on every family here.
ATOL = 1e-4


def _layers(model: nn.Module) -> nn.ModuleList:
    from shardwise.moe.block import decoder_layers
    from shardwise.policy import policy_for

    return decoder_layers(model, policy_for(model))


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _expected_numel(ref: nn.Module, owned: range, first: bool, last: bool) -> int:
    """Parameters a stage holds: the whole model minus the other stages' layers, minus the
    embedding off the first stage and the head off the last (tied: one tensor, which a stage
    at either end keeps)."""
    embed, head = ref.get_input_embeddings(), ref.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    others = sum(_numel(layer) for i, layer in enumerate(_layers(ref)) if i not in owned)
    if tied:  # one tensor: kept by a stage at either end, dropped by a middle one
        drop = 0 if first or last else _numel(embed)
    else:
        drop = (0 if first else _numel(embed)) + (0 if last else _numel(head))
    return _numel(ref) - others - drop


def causal_lm(arch: str, layers: int | None = None) -> nn.Module:
    """``tiny_causal_lm(arch)``, or with ``layers`` decoder layers instead of the family's."""
    if layers is None:
        return tiny_causal_lm(arch)
    spec = dict(family(arch).config)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def causal_case(rank: int, arch: str, layers: int | None = None, split=None,
                pp_size: int = 2) -> dict:
    ref, model = causal_lm(arch, layers), causal_lm(arch, layers)
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
               pad_token_id=0)
    with torch.no_grad():
        ref_logits = ref(ids).logits
        ref_tokens = ref.generate(ids, **gen)
    pp = {"pp_size": pp_size, **({"split": split} if split else {})}
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      pipeline_parallel=pp)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    out = engine(input_ids=mine, use_cache=True)
    tokens = engine.generate(mine, **gen)
    with torch.no_grad():  # the hooks live on the modules: the bare HF generate works too
        module_tokens = model.generate(ids, **dict(gen, max_new_tokens=8, min_new_tokens=8))
    sampled = engine.generate(mine, max_new_tokens=8, do_sample=True, pad_token_id=0)
    stages = engine.stages
    owned = [i for i, layer in enumerate(_layers(model)) if not isinstance(layer, RemoteLayer)]
    kv_width = [layer.keys.shape[-1] for layer in out.cache.layers]  # 1: another stage's layer
    # decode step by step through the cache, without generate's own positions: every stage must
    # count the cached tokens itself
    forced = forced_decode_logits(model, ref_tokens[:, :16], ids.shape[1])
    with torch.no_grad():
        ref_forced = forced_decode_logits(ref, ref_tokens[:, :16], ids.shape[1])
    numel = _numel(model)
    given_back = engine.close()
    return dict(
        max_abs=(out.logits - ref_logits).abs().max().item(), digest=digest(out.logits),
        forced_abs=(forced - ref_forced).abs().max().item(),
        tokens_equal=torch.equal(tokens, ref_tokens), tokens=tokens.tolist(),
        module_tokens_equal=torch.equal(module_tokens, ref_tokens[:, :ids.shape[1] + 8]),
        sampled=sampled.tolist(), owned=owned, planned=list(stages.layers),
        bounds=[list(b) for b in stages.plan.bounds], source=stages.plan.source,
        kv_width=kv_width, cache_len=out.cache.get_seq_length(),
        numel=numel, expected_numel=_expected_numel(ref, range(*stages.plan.bounds[rank]),
                                                     stages.plan.first, stages.plan.last),
        ref_numel=_numel(ref), ref_layer_numel=_numel(_layers(ref)),
        layer_numel=sum(_numel(_layers(ref)[i]) for i in owned),
        report_bytes=stages.param_bytes,
        given_back=given_back is model and all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                              ref.state_dict().values())),
        summary=stages.summary())


def bert_case(rank: int) -> dict:
    """BERT (the bare encoder): hidden states and pooler output, padded batch."""
    ref, model = tiny_encoder("bert", head="base"), tiny_encoder("bert", head="base")
    ids = prompt_ids(batch=2, length=8)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded row
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32, **PP)
    out = engine(input_ids=ids if rank == 0 else torch.zeros_like(ids),
                 attention_mask=mask if rank == 0 else torch.zeros_like(mask))
    owned = [i for i, layer in enumerate(_layers(model)) if not isinstance(layer, RemoteLayer)]
    return dict(
        max_abs=(out.last_hidden_state - expected.last_hidden_state).abs().max().item(),
        pooler_abs=(out.pooler_output - expected.pooler_output).abs().max().item(),
        digest=digest(out.last_hidden_state), owned=owned)


def refused_case(rank: int, kwargs: dict, layers: int | None = None) -> dict:
    """init_inference with bad pipeline settings on 2 ranks: the error, and whether the model
    was left untouched."""
    model = causal_lm("llama", layers)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        shardwise.init_inference(model, device="cpu", **kwargs)
    except shardwise.ConfigError as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    untouched = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return dict(error=error, untouched=untouched,
                layers_kept=sum(not isinstance(m, RemoteLayer) for m in _layers(model)))


def too_big_case(rank: int) -> dict:
    """A bf16 model run in fp32 (every weight newly allocated) on a CPU that reports 1000
    bytes free: the stage check refuses it on every rank, the model untouched."""
    accelerator = type(shardwise.get_accelerator("cpu"))
    free_memory = accelerator.free_memory
    accelerator.free_memory = lambda self, index=0: 1000
    try:
        model = tiny_causal_lm("llama", dtype=torch.bfloat16)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            shardwise.init_inference(model, device="cpu", dtype=torch.float32, **PP)
        except shardwise.ConfigError as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            error = None
    finally:
        accelerator.free_memory = free_memory
    untouched = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return dict(error=error, untouched=untouched)


def micro_batch_case(rank: int, arch: str, micro_batches: int, delay_s: float = 0.0) -> dict:
    """A batch of 4 split into ``micro_batches`` through the stages; with ``delay_s`` each
    stage's layer sleeps that long per call (a stage's compute well above the noise)."""
    import time

    ref = tiny_causal_lm(arch) if arch != "bert" else tiny_encoder("bert", head="base")
    model = tiny_causal_lm(arch) if arch != "bert" else tiny_encoder("bert", head="base")
    ids = prompt_ids(batch=4, length=8)
    with torch.no_grad():
        expected = ref(ids)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      pipeline_parallel={"pp_size": 2,
                                                         "micro_batches": micro_batches})
    if delay_s:
        for layer in _layers(model):
            if not isinstance(layer, RemoteLayer):
                # a pre-hook registered after the engine's: inside the stage's measured time
                layer.register_forward_pre_hook(lambda *_: time.sleep(delay_s))
    out = engine(input_ids=ids)
    field = "logits" if arch != "bert" else "last_hidden_state"
    stats = engine.pipeline_stats
    return dict(max_abs=(out[field] - expected[field]).abs().max().item(),
                shape=list(out[field].shape), digest=digest(out[field]),
                micro_batches=stats.micro_batches, busy=list(stats.busy_s),
                bubble=list(stats.bubble), theoretical=stats.theoretical_bubble,
                summary=stats.summary())


def generate_micro_case(rank: int, arch: str, micro_batches: int, delay_s: float = 0.0,
                        new_tokens: int = NEW_TOKENS) -> dict:
    """``generate`` on a batch of 4 (row 0 left-padded) with ``micro_batches`` micro-batches
    in flight, each with its own KV cache on each stage; with ``delay_s`` each stage's layer
    sleeps that long per call (a stage's compute well above the noise)."""
    import time

    ref, model = causal_lm(arch), causal_lm(arch)
    ids = prompt_ids(batch=4, length=8, vocab=ref.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the mask is split with the rows
    gen = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
               do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **gen)
        ref_logits = ref(ids, attention_mask=mask).logits
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      pipeline_parallel={"pp_size": 2,
                                                         "micro_batches": micro_batches})
    if delay_s:
        for layer in _layers(model):
            if not isinstance(layer, RemoteLayer):  # inside the stage's measured time
                layer.register_forward_pre_hook(lambda *_: time.sleep(delay_s))
    tokens = engine.generate(ids, **gen)
    stats = engine.pipeline_stats
    out = engine(input_ids=ids, attention_mask=mask, use_cache=True)
    parts = vars(out.cache).get("_shardwise_micro_batch_caches", [])
    owned = [i for i, layer in enumerate(_layers(model)) if not isinstance(layer, RemoteLayer)]
    with torch.no_grad():  # the bare HF generate goes through the micro-batches too
        module_tokens = model.generate(ids, **dict(gen, max_new_tokens=8, min_new_tokens=8))
    forced = forced_decode_logits(model, ref_tokens[:, :16], ids.shape[1])
    with torch.no_grad():
        ref_forced = forced_decode_logits(ref, ref_tokens[:, :16], ids.shape[1])
    return dict(tokens_equal=torch.equal(tokens, ref_tokens), tokens=tokens.tolist(),
                module_tokens_equal=torch.equal(module_tokens, ref_tokens[:, :16]),
                max_abs=(out.logits - ref_logits).abs().max().item(),
                forced_abs=(forced - ref_forced).abs().max().item(),
                part_rows=[c.layers[owned[0]].keys.shape[0] for c in parts],
                part_widths=[[layer.keys.shape[-1] for layer in c.layers] for c in parts],
                part_len=[c.get_seq_length() for c in parts], owned=owned,
                cache_len=out.cache.get_seq_length(), steps=stats.steps,
                micro_batches=stats.micro_batches, busy=list(stats.busy_s),
                bubble=list(stats.bubble), theoretical=stats.theoretical_bubble,
                summary=stats.summary(), rebalanced=list(engine.stages.rebalanced_split()))


def beam_case(rank: int, arch: str, micro_batches: int) -> dict:
    """Beam search with micro-batches (tp_harness.pipeline_beam_case): each stage's cache follows
    HF's reorder across the micro-batches' boundaries."""
    return pipeline_beam_case(arch, micro_batches)


#: the dense families the issue names, a Mixture-of-Experts one (HF's own MoE blocks, ep 1), and
#: two whose layers' forwards are unannotated (Falcon returns a tuple, GPT-NeoX the tensor)
CAUSAL = ("llama", "gpt2", "opt", "bloom", "mixtral", "falcon", "gpt_neox")
TABLE = {
    **{arch: (causal_case, arch) for arch in CAUSAL},
    "llama-4l": (causal_case, "llama", 4),
    "llama-4l-split-1-3": (causal_case, "llama", 4, [1, 3]),
    "bert": (bert_case,),
    "llama-mb2": (micro_batch_case, "llama", 2),
    "bert-mb3": (micro_batch_case, "bert", 3),
    "llama-mb4-delay": (micro_batch_case, "llama", 4, 0.2),
    "llama-gen-mb2": (generate_micro_case, "llama", 2),
    "gpt2-gen-mb4": (generate_micro_case, "gpt2", 4),
    "bloom-gen-mb3": (generate_micro_case, "bloom", 3),
    "opt-gen-mb3": (generate_micro_case, "opt", 3),
    "mixtral-gen-mb2": (generate_micro_case, "mixtral", 2),
    "mistral-sw4-gen-mb2": (generate_micro_case, "mistral-sw4", 2),  # sliding-window caches
    "llama-gen-mb4-delay": (generate_micro_case, "llama", 4, 0.1, 6),
    "llama-beam-mb4": (beam_case, "llama", 4),
    "gpt2-beam-mb2": (beam_case, "gpt2", 2),
    "tp-and-pp": (refused_case, {"tensor_parallel": {"tp_size": 2}, **PP}),
    "stage-too-big": (too_big_case,),
    "split-misses-layers": (refused_case, {"pipeline_parallel": {"pp_size": 2,
                                                                 "split": [1, 1]}}, 4),
}


def _run(rank: int, fn, *args) -> dict:
    return fn(rank, *args)


ranks = table_fixture(_run, TABLE, "pipeline", deadline_s=400)


# ----- 2 ranks ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [*CAUSAL, "llama-4l", "llama-4l-split-1-3"])
def test_pp2_matches_the_single_process_model(ranks, name):
    for r in assert_parity(ranks, name, "PP=2"):
        assert r["forced_abs"] < ATOL, f"{name}: step-by-step decoding through the cache"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CAUSAL, "llama-4l"])
def test_each_rank_holds_half_the_layers(ranks, name):
    r0, r1 = case(ranks, name)
    layers = len(r0["kv_width"])
    assert r0["source"] == "balanced"
    assert r0["owned"] == list(range(layers // 2)) == r0["planned"]
    assert r1["owned"] == list(range(layers // 2, layers)) == r1["planned"]
    for r in (r0, r1):
        assert r["layer_numel"] * 2 == r["ref_layer_numel"]
        assert r["numel"] == r["expected_numel"] < r["ref_numel"], r["summary"]
        assert r["report_bytes"] == 4 * r["numel"]  # fp32


@pytest.mark.slow
def test_a_user_split_is_followed(ranks):
    r0, r1 = case(ranks, "llama-4l-split-1-3")
    assert r0["source"] == "split" and r0["bounds"] == [[0, 1], [1, 4]]
    assert r0["owned"] == [0] and r1["owned"] == [1, 2, 3]
    assert r0["numel"] == r0["expected_numel"] and r1["numel"] == r1["expected_numel"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "llama-4l-split-1-3"])
def test_each_stage_caches_only_its_own_layers(ranks, name):
    r0, r1 = case(ranks, name)
    head_dim = 16  # tiny Llama: hidden 64 over 4 heads
    for r in (r0, r1):
        assert r["cache_len"] == 8  # the prompt, as HF counts it, on every stage
        assert r["kv_width"] == [head_dim if i in r["owned"] else 1  # a placeholder
                                 for i in range(len(r["kv_width"]))]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CAUSAL, "llama-4l-split-1-3"])
def test_close_gives_the_whole_model_back(ranks, name):
    for r in case(ranks, name):
        assert r["given_back"], f"{name}: close() did not give back HF's weights bit for bit"


@pytest.mark.slow
def test_bert_hidden_states(ranks):
    r0, r1 = case(ranks, "bert")
    print(f"bert PP=2 fp32: max |hidden diff| {max(r0['max_abs'], r1['max_abs']):.2e}")
    for r in (r0, r1):
        assert r["max_abs"] < ATOL and r["pooler_abs"] < ATOL
    assert r0["digest"] == r1["digest"]
    assert r0["owned"] == [0] and r1["owned"] == [1]


@pytest.mark.slow
def test_pp_times_tp_above_the_world_is_refused_on_every_rank(ranks):
    for r in case(ranks, "tp-and-pp"):
        assert r["error"] and "ShardingError" in r["error"], r["error"]
        assert "pp_size=2 × tp_size=2 does not divide the world of 2" in r["error"]
        assert r["untouched"] and r["layers_kept"] == 2


@pytest.mark.slow
def test_a_split_that_misses_layers_is_refused_on_every_rank(ranks):
    for r in case(ranks, "split-misses-layers"):
        assert r["error"] and "PipelineConfigError" in r["error"], r["error"]
        assert "covers 2 layers" in r["error"] and "has 4" in r["error"]
        assert r["untouched"] and r["layers_kept"] == 4


@pytest.mark.slow
def test_a_stage_that_does_not_fit_its_device_is_refused_on_every_rank(ranks):
    for r in case(ranks, "stage-too-big"):
        assert r["error"] and "PipelineConfigError" in r["error"], r["error"]
        assert "pipeline stage 0 (decoder layers [0, 1) of 2 stages) needs" in r["error"]
        assert "1000 bytes free" in r["error"] and r["untouched"]


@pytest.mark.slow
@pytest.mark.parametrize("name, micro_batches", [("llama-mb2", 2), ("bert-mb3", 3)])
def test_micro_batches_give_the_whole_batch_outputs(ranks, name, micro_batches):
    r0, r1 = case(ranks, name)
    for r in (r0, r1):
        assert r["max_abs"] < ATOL and r["shape"][0] == 4
        assert r["micro_batches"] == micro_batches
    assert r0["digest"] == r1["digest"]


@pytest.mark.slow
def test_the_measured_bubble_is_near_the_theoretical(ranks):
    """P = 2, M = 4: theoretical bubble 1/5. Each stage's layer sleeps 0.2 s per micro-batch,
    so a stage is busy 0.8 s of about 1 s; the bubble must stay within 1.2x of 1/5 on every
    stage (the issue's bound), i.e. the stages really overlap (run one after the other, the
    bubble would be 1/2)."""
    r0, r1 = case(ranks, "llama-mb4-delay")
    print(f"PP=2 M=4: {r0['summary']}")
    assert r0["theoretical"] == pytest.approx(0.2)
    assert r0["bubble"] == r1["bubble"]  # every rank reports every stage
    for busy in r0["busy"]:
        assert busy >= 0.8
    for bubble in r0["bubble"]:
        assert 0 <= bubble <= 1.2 * r0["theoretical"], r0["summary"]


GENERATE = {"llama-gen-mb2": [2, 2], "gpt2-gen-mb4": [1, 1, 1, 1], "bloom-gen-mb3": [2, 1, 1],
            "opt-gen-mb3": [2, 1, 1], "mixtral-gen-mb2": [2, 2], "mistral-sw4-gen-mb2": [2, 2]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GENERATE))
def test_generate_with_micro_batches_in_flight_matches_hf(ranks, name):
    """Greedy tokens (engine.generate and the bare HF generate) equal HF's — hence M=1's —
    with every prefill and decode step split into micro-batches, each with its own cache."""
    r0, r1 = case(ranks, name)
    for r in (r0, r1):
        assert r["tokens_equal"], f"{name}: {NEW_TOKENS} greedy tokens differ from HF's"
        assert r["module_tokens_equal"], f"{name}: engine.module.generate differs from HF's"
        assert r["max_abs"] < ATOL and r["forced_abs"] < ATOL
        assert r["steps"] == NEW_TOKENS  # prefill + 31 decode steps, each micro-batched
        assert r["micro_batches"] == len(GENERATE[name])
        # a split balanced on this run's seconds: every layer once, every stage at least one
        assert sum(r["rebalanced"]) == len(r["part_widths"][0]) and min(r["rebalanced"]) >= 1
    assert r0["tokens"] == r1["tokens"]
    assert r0["rebalanced"] == r1["rebalanced"]  # the same gathered stats on every rank


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GENERATE))
def test_each_micro_batch_keeps_its_own_cache_of_its_stages_layers(ranks, name):
    for r in case(ranks, name):
        assert r["part_rows"] == GENERATE[name]  # batch 4 split, rows per micro-batch
        assert r["cache_len"] == 8 and r["part_len"] == [8] * len(GENERATE[name])
        for widths in r["part_widths"]:  # this stage's layers real, the other's placeholders
            assert [w > 1 for w in widths] == [i in r["owned"] for i in range(len(widths))]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-beam-mb4", "gpt2-beam-mb2"])
def test_beam_search_with_micro_batches_matches_hf(ranks, name):
    r0, r1 = case(ranks, name)
    for r in (r0, r1):
        assert r["tokens_equal"], f"{name}: beam search differs from HF's"
        assert r["steps"] == 12  # every step micro-batched
    assert r0["tokens"] == r1["tokens"]


@pytest.mark.slow
def test_the_generate_bubble_is_near_the_theoretical(ranks):
    """P = 2, M = 4 over 6 generate steps, each stage's layer sleeping 0.1 s per micro-batch:
    within every step the stages work on different micro-batches at once, so each stage idles
    about 1/5 of the time (the theoretical bubble; 1/2 if the micro-batches ran one stage
    after the other), within 1.2x of it on every stage."""
    r0, r1 = case(ranks, "llama-gen-mb4-delay")
    print(f"PP=2 M=4 generate: {r0['summary']}")
    assert r0["theoretical"] == pytest.approx(0.2) and r0["steps"] == 6
    assert r0["bubble"] == r1["bubble"]
    for busy in r0["busy"]:
        assert busy >= 6 * 4 * 0.1
    for bubble in r0["bubble"]:
        assert 0 <= bubble <= 1.2 * r0["theoretical"], r0["summary"]


# ----- one process: bad settings, planning --------------------------------------------------------

def _plan(model, world: int = 2, tp_size: int = 1, **pp):
    return build_plan(model, world=world, rank=0, tp_size=tp_size,
                      pipeline=shardwise.pipeline.parse_pipeline({"pp_size": 2, **pp}))


@pytest.mark.parametrize("value, match", [
    ({"pp_size": 0}, "pp_size must be a positive integer"),
    ({"pp_size": 2, "split": [2]}, "has 1 entries but pp_size=2"),
    ({"pp_size": 2, "split": [2, 0]}, "every stage needs at least one layer"),
    ({"pp_size": 2, "split": "1,1"}, "must be a list of layer counts"),
    ({"pp_size": 2, "stages": 2}, r"unknown pipeline_parallel field\(s\) \['stages'\]"),
    ("2", "must be a dict"),
    ({"pp_size": 2, "micro_batches": 0}, "micro_batches must be a positive integer"),
    ({"pp_size": 1, "micro_batches": 4}, "pp_size=1 has one stage"),
])
def test_malformed_settings_are_config_errors(value, match):
    with pytest.raises(PipelineConfigError, match=match):
        shardwise.InferenceConfig.build(pipeline_parallel=value)


TP2 = {"tensor_parallel": {"tp_size": 2}}


@pytest.mark.parametrize("other, what", [
    ({"quant": {"weight": {"num_bits": 8}}}, "quant="),
    ({"replace_with_kernel_inject": True}, "replace_with_kernel_inject")])
def test_saving_stages_split_by_tp_quantized_or_injected_is_refused_up_front(other, what):
    """Stages split by tp save gathered whole tensors (tests/test_pipeline_tp.py); quantized or
    injected ones, without tp, save too; the two together are refused before any work."""
    with pytest.raises(shardwise.ConfigError,
                       match=f"save_mp_checkpoint_path with pipeline_parallel and "
                             f"tensor_parallel .* which {what} does not support yet; drop"):
        shardwise.InferenceConfig.build(**PP, **TP2, save_mp_checkpoint_path="/nonexistent",
                                        **other)
    for settings in (TP2, other):  # each alone saves
        shardwise.InferenceConfig.build(**PP, save_mp_checkpoint_path="/nonexistent",
                                        **settings)


def test_pp_size_off_is_no_pipeline():
    for value in (None, {"pp_size": 1}, {"enabled": False, "pp_size": 2}):
        assert shardwise.InferenceConfig.build(pipeline_parallel=value).pipeline_parallel is None


def test_more_stages_than_layers_fails_before_any_work(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tiny_causal_lm("llama")  # 2 layers
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(PipelineConfigError, match=r"pp_size=3 is more than the 2 decoder layers"):
        shardwise.init_inference(model, device="cpu", pipeline_parallel={"pp_size": 3})
    with pytest.raises(PipelineConfigError, match=r"split \[2, 1\] covers 3 layers.*has 2"):
        shardwise.init_inference(model, device="cpu",
                                 pipeline_parallel={"pp_size": 2, "split": [2, 1]})
    assert not torch.distributed.is_initialized()
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
    assert not any(isinstance(m, RemoteLayer) for m in model.modules())


def test_pp_without_enough_ranks_fails_before_any_work(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(shardwise.ConfigError, match=r"pp_size=2 needs 2 ranks.*WORLD_SIZE"):
        shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", **PP)
    assert not torch.distributed.is_initialized()


def test_the_world_must_be_pp_times_tp_times_dp_ranks():
    model = tiny_causal_lm("llama")
    with pytest.raises(shardwise.ConfigError, match="does not divide the world of 3"):
        _plan(model, world=3)
    plan = _plan(model, world=4)  # two replicas of a pipeline: test_pipeline_tp.py runs it
    assert (plan.pp.size, plan.tp.size, plan.dp.size) == (2, 1, 2)
    plan = _plan(model, world=4, tp_size=2)  # pp × tp: test_pipeline_tp.py runs it
    assert (plan.pp.size, plan.tp.size, plan.dp.size) == (2, 2, 1)


def test_the_plan_names_each_stage():
    model = causal_lm("llama", 4)
    plan = _plan(model)
    assert plan.pp.size == 2 and plan.pp.coord == 0
    assert plan.stages.bounds == ((0, 2), (2, 4)) and plan.stages.source == "balanced"
    assert "stages: 2 stages (balanced): [0, 2), [2, 4)" in repr(plan)
    split = _plan(model, split=[3, 1]).stages
    assert split.bounds == ((0, 3), (3, 4)) and split.source == "split"
    assert split.costs[0] > split.costs[1]


@pytest.mark.parametrize("arch, as_tuple", [("llama", False), ("gpt2", False), ("bloom", True),
                                             ("falcon", True), ("gpt_neo", True),
                                             ("gpt_neox", False)])
def test_stand_ins_return_what_the_layer_returns(arch, as_tuple):
    from shardwise.pipeline.transform import _returns_tuple

    layer = _layers(tiny_causal_lm(arch))[0]
    assert _returns_tuple(layer) is as_tuple
    hidden = torch.randn(2, 3, 64)
    out = RemoteLayer(0, 1, as_tuple)(hidden)
    assert (out[0] if as_tuple else out) is hidden


def test_a_stage_counts_the_bytes_it_must_newly_place():
    from shardwise.pipeline.stages import check_stages_fit, stage_bytes

    model = causal_lm("llama", 4)
    plan = _plan(model, split=[3, 1]).stages  # [0, 3) with the embedding, [3, 4) the head
    layers, cpu = _layers(model), torch.device("cpu")
    whole = [sum(_numel(m) for m in layers[a:b]) for a, b in plan.bounds]
    whole[0] += _numel(model.get_input_embeddings())
    whole[1] += _numel(model.get_output_embeddings())
    assert [stage_bytes(model, layers, plan, s, torch.float32, cpu) for s in (0, 1)] == [0, 0]
    assert [stage_bytes(model, layers, plan, s, torch.bfloat16, cpu) for s in (0, 1)] == \
        [2 * n for n in whole]  # a cast allocates every weight anew
    assert stage_bytes(model, layers, plan, 1, torch.bfloat16, cpu, tp_size=2) == whole[1]
    check_stages_fit(model, layers, plan, torch.bfloat16, cpu, free=2 * max(whole))
    check_stages_fit(model, layers, plan, torch.bfloat16, cpu, free=None)  # cannot tell
    assert whole[0] > whole[1]
    with pytest.raises(PipelineConfigError,
                       match=rf"pipeline stage 0 \(decoder layers \[0, 3\) of 2 stages\) needs "
                             rf"{2 * whole[0]} bytes of weights in torch.bfloat16 on cpu, but it "
                             rf"has {2 * whole[1]} bytes free; use more stages"):
        check_stages_fit(model, layers, plan, torch.bfloat16, cpu, free=2 * whole[1])


def test_balanced_bounds_minimise_the_largest_stage():
    assert balanced_bounds([1, 1, 1, 1], 2) == ((0, 2), (2, 4))
    assert balanced_bounds([1, 1, 1, 10], 2) == ((0, 3), (3, 4))
    assert balanced_bounds([5, 1, 1, 1, 1, 1], 2) == ((0, 1), (1, 6))
    # the embedding's bytes count on the first stage, the head's on the last
    assert balanced_bounds([1, 1, 1, 1], 2, first_extra=2) == ((0, 1), (1, 4))
    assert balanced_bounds([1] * 6, 3) == ((0, 2), (2, 4), (4, 6))


def test_balanced_bounds_per_stage_extras():
    assert balanced_bounds([1] * 4, 2, extras=[0, 2]) == ((0, 3), (3, 4))
    assert balanced_bounds([1] * 7, 3, extras=[2, 0, 0]) == ((0, 1), (1, 4), (4, 7))
    with pytest.raises(ValueError, match="extras gives 1 stages, not 2"):
        balanced_bounds([1] * 4, 2, extras=[1])


def test_rebalanced_split_moves_layers_off_the_stage_with_more_work_of_its_own():
    """Stage 1 spends 3 s outside its layers (the head, say) against stage 0's 1 s, all layers
    1 s: 3 + 1 layers balance at 4 s each. The layers' seconds are pooled over the stages and
    shared out by weight bytes (one rank's slower layers are noise, not a heavier layer)."""
    from shardwise.pipeline import PipelineStats, rebalanced_split

    stats = PipelineStats(micro_batches=4, stages=2, wall_s=6.0, busy_s=(3.0, 5.0),
                          layers_s=(2.0, 2.0))
    assert rebalanced_split(stats, ((0, 2), (2, 4))) == (3, 1)
    noisy = PipelineStats(micro_batches=4, stages=2, wall_s=6.0, busy_s=(3.4, 4.6),
                          layers_s=(2.4, 1.6))  # the same work, stage 0's layers timed slower
    assert rebalanced_split(noisy, ((0, 2), (2, 4))) == (3, 1)
    even = PipelineStats(micro_batches=4, stages=2, wall_s=4.0, busy_s=(3.0, 3.0),
                         layers_s=(2.0, 2.0))
    assert rebalanced_split(even, ((0, 2), (2, 4))) == (2, 2)
    # the last layer holds 5 of the 8 weight bytes: it weighs more than the other three
    assert rebalanced_split(even, ((0, 2), (2, 4)), layer_bytes=(1, 1, 1, 5)) == (3, 1)
    bare = PipelineStats(micro_batches=4, stages=2, wall_s=6.0, busy_s=(3.0, 5.0))
    with pytest.raises(PipelineConfigError, match="needs every stage's seconds in its layers"):
        rebalanced_split(bare, ((0, 2), (2, 4)))


def _slowed(layer: nn.Module, seconds: float) -> None:
    """``layer``'s forward sleeps ``seconds`` first (instance-scoped: inside its own call)."""
    forward = layer.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)
    layer.forward = slow


@pytest.mark.parametrize("slow, split", [(0, (1, 3)), (3, (3, 1))])
def test_measured_split_balances_the_seconds_each_layer_takes(slow, split):
    """A layer that takes 300 ms a call weighs more than the other three together: the cut
    puts it alone in its stage (the bytes cut would be 2/2). The hooks are gone afterwards.
    (One thread: on a loaded machine a tiny layer's two-thread forward can take 0.2 s.)"""
    from shardwise.pipeline import measured_split

    model = causal_lm("llama", 4)
    _slowed(_layers(model)[slow], 0.3)
    ids = prompt_ids(batch=2, length=8)
    calls = []

    def run():
        calls.append(1)
        with torch.no_grad():
            model(input_ids=ids)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert measured_split(model, run, 2, warmup=1, repeats=2) == split
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with pytest.raises(PipelineConfigError, match=r"pp_size=5 must be between 1 and the 4 "
                                                  r"decoder layers of LlamaForCausalLM"):
        measured_split(model, run, 5)


# ----- three stages: a middle stage holds neither the embedding nor the head ----------------------

THREE = {"llama-4l": (causal_case, "llama", 4, None, 3),
         "gpt2-4l": (causal_case, "gpt2", 4, None, 3)}  # tied: the middle stage drops it


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    from functools import partial

    from distributed import run_ranks
    from tp_harness import run_table

    results = run_ranks(partial(run_table, fn=_run, table=THREE), 3,
                        tmp_path_factory.mktemp("pipeline3"), deadline_s=300)
    for res in results:
        assert res["ok"], res.get("trace", res.get("error"))
    return [res["value"] for res in results]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(THREE))
def test_three_stages_match_the_single_process_model(three_ranks, name):
    results = [three_ranks[rank][name] for rank in range(3)]
    for r in results:
        assert r["ok"], r.get("trace")
        assert r["max_abs"] < ATOL and r["forced_abs"] < ATOL, r["summary"]
        assert r["tokens_equal"] and r["module_tokens_equal"]
        assert r["numel"] == r["expected_numel"], r["summary"]
        assert r["given_back"]
    assert len({r["digest"] for r in results}) == 1
    assert len({str(r["sampled"]) for r in results}) == 1
    owned = [r["owned"] for r in results]
    assert sorted(i for layers in owned for i in layers) == [0, 1, 2, 3]  # each layer once
    assert all(layers for layers in owned) and owned == [r["planned"] for r in results]


# ----- a stage that dies --------------------------------------------------------------------------

#: seconds a point-to-point op waits for a dead stage here (``comm_timeout``)
TIMEOUT_S = 5


def _stage_dies(rank: int, dead: int) -> dict:
    """Both ranks build the PP=2 engine; rank ``dead`` exits (code 9); the other runs a forward,
    which must fail with a CollectiveError within the timeout: its message and seconds."""
    import os
    import time

    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      comm_timeout=TIMEOUT_S, **PP)
    engine(input_ids=prompt_ids())  # both stages run once: the links are up
    if rank == dead:
        os._exit(9)
    start = time.monotonic()
    try:
        engine.module(prompt_ids())  # the bare module: no input broadcast first
    except shardwise.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.parametrize("dead, op", [(1, "send"), (0, "recv")])
def test_a_dead_stage_fails_the_other_within_the_timeout(tmp_path, dead, op):
    from distributed import run_ranks

    results = run_ranks(_stage_dies, 2, tmp_path, dead, deadline_s=120)
    assert results[dead]["error"].startswith("no result (exit code 9)")
    survivor = results[1 - dead]
    assert survivor["ok"], survivor.get("trace")
    error = survivor["value"]["error"]
    assert error and f"{op} failed on rank {1 - dead}/2" in error, error
    print(f"stage {dead} died: {op} failed after {survivor['value']['seconds']:.1f}s")
    assert survivor["value"]["seconds"] < TIMEOUT_S + 10


# ----- the point-to-point ops in flight (one process, a recording communicator) ------------------

class _RecordingComm(shardwise.Communicator):
    """Records every point-to-point op; a receive fills its buffer with the call's number."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _note(self, name, tensor, peer):
        self.calls.append((name, tuple(tensor.shape), peer))
        if name in ("recv", "irecv"):
            tensor.fill_(len(self.calls))

    def send(self, tensor, dst):
        self._note("send", tensor, dst)

    def recv(self, tensor, src):
        self._note("recv", tensor, src)
        return tensor

    def isend(self, tensor, dst):
        self._note("isend", tensor, dst)
        return shardwise.communicator.PendingOp()

    def irecv(self, tensor, src):
        self._note("irecv", tensor, src)
        return shardwise.communicator.PendingOp()


def test_in_flight_receives_the_next_micro_batch_while_this_one_computes():
    from shardwise.pipeline.transform import InFlight

    comm, links = _RecordingComm(), InFlight()
    links.arm([2, 1, 1])  # rows of 3 micro-batches of [rows, 5, 8]
    first = links.receive(comm, torch.zeros(2, 5, 8), src=0)
    assert comm.calls == [("recv", (2, 5, 8), 0), ("irecv", (1, 5, 8), 0)]
    second = links.receive(comm, torch.zeros(1, 5, 8), src=0)  # the prefetched buffer
    assert comm.calls[2:] == [("irecv", (1, 5, 8), 0)]
    third = links.receive(comm, torch.zeros(1, 5, 8), src=0)
    assert len(comm.calls) == 3  # nothing left to post
    assert (first.unique().tolist(), second.unique().tolist(), third.unique().tolist()) == \
        ([1.0], [2.0], [3.0])
    hidden = torch.ones(1, 5, 8)
    links.send(comm, hidden, dst=1)
    hidden.add_(1)  # the stage goes on: the copy in flight keeps what was sent
    assert comm.calls[-1] == ("isend", (1, 5, 8), 1) and links._sends[0][0].eq(1).all()
    links.disarm(complete=True)
    links.send(comm, hidden, dst=1)  # unarmed: a forward of the batch whole, blocking
    assert comm.calls[-1] == ("send", (1, 5, 8), 1)


def test_in_flight_names_a_micro_batch_of_another_shape():
    from shardwise.pipeline.transform import InFlight

    comm, links = _RecordingComm(), InFlight()
    links.arm([2, 2])
    links.receive(comm, torch.zeros(2, 5, 8), src=0)
    with pytest.raises(PipelineConfigError, match=r"received hidden states \(2, 5, 8\) for a "
                                                  r"micro-batch whose inputs are \(2, 6, 8\)"):
        links.receive(comm, torch.zeros(2, 6, 8), src=0)


def test_the_micro_batch_forward_shows_hf_the_models_parameters():
    """HF's generate reads the forward's parameters to choose its inputs (logits_to_keep ...):
    the micro-batching instance forward shows the model's own."""
    import inspect

    from shardwise.pipeline.schedule import CachedMicroBatches

    model = tiny_causal_lm("llama")
    wrapped = CachedMicroBatches(model, model.forward, report=None)
    assert inspect.signature(wrapped) == inspect.signature(model.forward)
    assert wrapped.cache_key == "cache"


@pytest.mark.parametrize("kwargs, split", [
    ({}, True), ({"use_cache": True}, False), ({"labels": 1}, False),
    ({"cache": "a cache"}, False), ({"past_key_values": "a cache"}, False),
    ({"cache": None, "past_key_values": None}, True)])
def test_only_cacheless_calls_are_split_into_micro_batches(kwargs, split, monkeypatch):
    """A forward given a cache runs whole here (the model's instance forward splits a cached
    call once, per micro-batch cache); splitting it here too mixed micro-batches' rows into the
    same caches (logits 0.54 off in the reviewer's repro)."""
    from types import SimpleNamespace

    from shardwise.pipeline import schedule, transform

    ran = []
    monkeypatch.setattr(schedule, "run_micro_batches",
                        lambda module, args, kw, report: (ran.append("split") or "parts", None))
    report = SimpleNamespace(micro_batches=2, stats=None)
    out = transform.PipelineReport.call(report, lambda *a, **k: ran.append("whole") or "whole",
                                        (), kwargs)
    assert ran == (["split"] if split else ["whole"]) and out == ("parts" if split else "whole")


def test_a_forward_failing_with_messages_in_flight_breaks_the_stage_by_name():
    """A receive posted for the next micro-batch outlives a failed forward in the process
    group, where it would take the next forward's message: every later use says so."""
    from shardwise.pipeline.transform import InFlight

    comm, links = _RecordingComm(), InFlight()
    links.arm([2, 2])
    links.receive(comm, torch.zeros(2, 5, 8), src=0)  # posts micro-batch 2's irecv
    links.disarm(complete=False)  # micro-batch 1 raised
    for use in (lambda: links.arm([2]), lambda: links.send(comm, torch.ones(2, 5, 8), dst=1),
                lambda: links.receive(comm, torch.zeros(2, 5, 8), src=0)):
        with pytest.raises(PipelineConfigError, match="out of step.*init_inference again"):
            use()
    clean = InFlight()
    clean.arm([2])  # one micro-batch: nothing posted beyond it
    clean.disarm(complete=False)
    clean.arm([2])  # an error with nothing in flight leaves the stage usable


class _SlowComm(_RecordingComm):
    """A receive, and the wait on a posted op, that take ``delay_s`` (the peer is late)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def recv(self, tensor, src):
        time.sleep(self.delay_s)
        return super().recv(tensor, src)

    def _late(self):
        delay = self.delay_s

        class Late(shardwise.communicator.PendingOp):
            def wait(self):
                time.sleep(delay)
        return Late()

    def irecv(self, tensor, src):
        super().irecv(tensor, src)
        return self._late()

    def isend(self, tensor, dst):
        super().isend(tensor, dst)
        return self._late()


def test_a_stage_counts_its_waits_on_the_other_stages_as_idle():
    """The bubble is the time a stage waits on another one: a blocking receive, the wait on a
    posted receive, and the wait on its sends at the end of the forward are counted; the work
    between them is not (it is busy even outside the stage's layers)."""
    from shardwise.pipeline.transform import InFlight, StageClock

    clock = StageClock()
    links = InFlight(clock)
    comm = _SlowComm(0.05)
    links.arm([1, 1])
    links.receive(comm, torch.zeros(1, 2, 4), src=0)  # blocking recv of micro-batch 0: 50 ms
    time.sleep(0.3)  # the stage's own work: not waiting
    links.receive(comm, torch.zeros(1, 2, 4), src=0)  # the posted irecv, waited: 50 ms
    links.send(comm, torch.ones(1, 2, 4), dst=1)
    links.disarm(complete=True)  # its send waited for: 50 ms
    # 150 ms of waits; the 300 ms of work counted too would make it 450 (the slack: sleeps
    # overshoot on a loaded machine)
    assert 0.15 <= clock.wait_s < 0.40, clock.wait_s
    assert clock.layers_s == 0.0  # the layers' clock is apart


def test_pipeline_stats_report_the_bubble_and_the_share_in_the_layers():
    from shardwise.pipeline import PipelineStats

    stats = PipelineStats(4, 2, wall_s=1.0, busy_s=(0.9, 0.8), steps=3, layers_s=(0.6, 0.7))
    assert stats.bubble == pytest.approx((0.1, 0.2))
    assert stats.layer_share == pytest.approx((0.6, 0.7))
    assert stats.theoretical_bubble == pytest.approx(0.2)
    d = stats.to_dict()
    assert d["layers_s"] == [0.6, 0.7] and d["busy_s"] == [0.9, 0.8] and d["steps"] == 3
    assert "in its layers 60.0%, 70.0%" in stats.summary()
    assert PipelineStats(2, 2, 1.0, (0.5, 0.5)).layer_share == ()


def test_the_ideal_wall_separates_the_schedule_from_unequal_stages():
    """A perfect schedule of stages costing 20 and 25 ms per micro-batch, M = 4, 2 forwards:
    each forward 20 + 4 x 25 = 120 ms. The slow stage's cost, not the schedule, puts the fast
    stage's bubble above the theoretical 1/5."""
    from shardwise.pipeline import PipelineStats

    stats = PipelineStats(4, 2, wall_s=0.240, busy_s=(0.160, 0.200), steps=2)
    assert stats.ideal_wall_s == pytest.approx(0.240)
    assert stats.bubble[0] == pytest.approx(1 / 3) and stats.bubble[0] > stats.theoretical_bubble
    equal = PipelineStats(4, 2, wall_s=0.100, busy_s=(0.080, 0.080))
    assert equal.ideal_wall_s == pytest.approx(0.100)
    assert equal.bubble == pytest.approx((equal.theoretical_bubble,) * 2)


class _BroadcastComm(_RecordingComm):
    """Records broadcasts; a receiving rank's buffer is filled with 7."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def broadcast(self, tensor, src):
        self.calls.append(("broadcast", tuple(tensor.shape), src))
        if self.rank != src:
            tensor.fill_(7.0)
        return tensor


@pytest.mark.parametrize("coord, head, deferred, broadcast", [
    (1, None, False, "sent"), (0, None, False, "received"),  # no head: the last stage's output
    (0, 100, False, None),  # a head: its hook broadcasts the logits instead
    (0, None, True, None),  # micro-batches: the schedule broadcasts once all ran
])
def test_a_stack_with_its_own_layer_loop_gets_the_last_stages_output(coord, head, deferred,
                                                                      broadcast):
    """StageLink.output, for an injected encoder's own loop (no HF last-layer hook fires)."""
    from shardwise.pipeline import StagePlan
    from shardwise.pipeline.transform import InFlight, StageClock, StageLink

    plan = StagePlan(((0, 1), (1, 2)), coord, (0, 1), (1, 1), "balanced", 8, head)
    comm, clock = _BroadcastComm(coord), StageClock()
    clock.deferred = deferred
    link = StageLink(plan, comm, InFlight(clock), clock)
    hidden = torch.ones(2, 3, 8)
    out = link.output(hidden)
    if broadcast is None:
        assert out is hidden and comm.calls == []
    else:
        assert comm.calls == [("broadcast", (2, 3, 8), 1)]
        assert out.eq(1.0 if broadcast == "sent" else 7.0).all()

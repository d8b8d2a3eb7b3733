"""Tiny Hugging Face models with fixed-seed random weights, for tests (no hub access)."""

from __future__ import annotations

import torch
import transformers

#: architecture → config kwargs for a small model (a few layers, hidden 64).
TINY_CONFIGS = {
    "llama": dict(cls="LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256),
    "gpt2": dict(cls="GPT2Config", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "opt": dict(cls="OPTConfig", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=256, max_position_embeddings=256,
                word_embed_proj_dim=64),
    # tensor-parallel coverage: multi-query (1 kv head), q/k/v biases, uneven heads and vocab
    "mistral": dict(cls="MistralConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=256,
                    max_position_embeddings=256),
    "qwen2": dict(cls="Qwen2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256),
    "llama-7heads": dict(cls="LlamaConfig", hidden_size=112, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=7,
                         vocab_size=257, max_position_embeddings=256),
    "llama-gqa-6q3kv": dict(cls="LlamaConfig", hidden_size=96, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                            vocab_size=256, max_position_embeddings=256),
    # tensor-parallel families A: local/global attention, partial rotary + parallel attn/MLP,
    # per-head interleaved fused qkv, fused [q|k|v] and [gate|up]
    "gpt_neo": dict(cls="GPTNeoConfig", hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4,
                    vocab_size=256, max_position_embeddings=256, bos_token_id=0, eos_token_id=0),
    "gptj": dict(cls="GPTJConfig", n_embd=64, n_inner=128, n_layer=2, n_head=4, rotary_dim=8,
                 vocab_size=256, n_positions=256, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(cls="GPTNeoXConfig", hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                     use_parallel_residual=True, vocab_size=256, max_position_embeddings=256),
    "phi3": dict(cls="Phi3Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # 7 heads of 16 (hidden 112) over 2 ranks: 4 | 3 whole [q, k, v] head blocks; vocab 257
    "gpt_neox-7heads": dict(cls="GPTNeoXConfig", hidden_size=112, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=7, rotary_pct=0.25,
                            use_parallel_residual=True, vocab_size=257,
                            max_position_embeddings=256),
    # tensor-parallel families B. BLOOM: fused per-head q|k|v, ALiBi (4 heads: slopes 1/4 … 1/256)
    "bloom": dict(cls="BloomConfig", hidden_size=64, n_layer=2, n_head=4, vocab_size=256),
    # Falcon, its layouts: new decoder architecture (grouped kv, two LayerNorms, biases here) …
    "falcon": dict(cls="FalconConfig", hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                   bias=True, vocab_size=256),
    # … multi-query [q | k | v] with parallel attention (Falcon-7B) …
    "falcon-mqa": dict(cls="FalconConfig", hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, multi_query=True, new_decoder_architecture=False,
                       parallel_attn=True, vocab_size=256),
    # … with uneven heads (7 over 2 ranks: 4 | 3, like Falcon-7B's 71) …
    "falcon-7heads-mqa": dict(cls="FalconConfig", hidden_size=112, num_hidden_layers=2,
                              num_attention_heads=7, multi_query=True,
                              new_decoder_architecture=False, parallel_attn=True,
                              vocab_size=256),
    # … and multi-head [heads, 3, head_dim], sequential, ALiBi (Falcon-RW)
    "falcon-alibi": dict(cls="FalconConfig", hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, multi_query=False,
                         new_decoder_architecture=False, parallel_attn=False, alibi=True,
                         bias=True, vocab_size=256),
    # the same with eager attention (Falcon cannot switch it after construction)
    "falcon-alibi-eager": dict(cls="FalconConfig", hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, multi_query=False,
                               new_decoder_architecture=False, parallel_attn=False, alibi=True,
                               bias=True, vocab_size=256, attn_implementation="eager"),
    # sliding windows shorter than the test prompts: every layer (Mistral), the layers past
    # max_window_layers (Qwen2's layer_types)
    "mistral-sw4": dict(cls="MistralConfig", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=4, vocab_size=256, max_position_embeddings=256),
    "qwen2-sw4": dict(cls="Qwen2Config", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      use_sliding_window=True, sliding_window=4, max_window_layers=1,
                      vocab_size=256, max_position_embeddings=256),
    # an encoder: build it with tiny_encoder, not tiny_causal_lm
    "bert": dict(cls="BertConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=64),
}


def tiny_causal_lm(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A small ``AutoModelForCausalLM`` of ``arch`` with weights drawn from ``seed``."""
    spec = dict(TINY_CONFIGS[arch])
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def tiny_encoder(arch: str = "bert", seed: int = 0, head: str = "masked_lm",
                 dtype: torch.dtype = torch.float32):
    """A small encoder of ``arch`` with weights drawn from ``seed``: ``head="masked_lm"`` gives
    ``AutoModelForMaskedLM`` (no pooler), ``head="base"`` the bare ``AutoModel`` (with pooler)."""
    spec = dict(TINY_CONFIGS[arch])
    config = getattr(transformers, spec.pop("cls"))(**spec)
    auto = {"masked_lm": transformers.AutoModelForMaskedLM, "base": transformers.AutoModel}[head]
    torch.manual_seed(seed)
    return auto.from_config(config, dtype=dtype).eval()


def prompt_ids(batch: int = 1, length: int = 8, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)



#: The least teacher-forced agreement (:func:`teacher_forced_agreement`) a reduced-precision or
#: tensor-parallel run may show against HF: every test uses this one bound.
MIN_FORCED_AGREEMENT = 0.9


def teacher_forced_agreement(ref_logits: torch.Tensor, logits: torch.Tensor,
                             prompt_len: int) -> float:
    """Teacher-forced greedy agreement: the fraction of positions where the model under test
    picks the same next token as the reference given the same prefix.

    ``ref_logits`` ``[batch, seq, vocab]``: the reference's ONE forward over its own greedy
    continuation of a prompt of ``prompt_len`` tokens. ``logits``: the model under test fed the
    same sequence, either in one forward (``[batch, seq, vocab]``) or step by step after the
    prompt (:func:`forced_decode_logits`, ``[batch, seq - prompt_len + 1, vocab]``). Compared are
    the positions from the prompt's last token on, those whose argmax chose each generated
    token. Unlike free-running agreement, one near-tie costs one position, not the rest of its
    sequence, so the bound can be tight.
    """
    batch, seq, vocab = ref_logits.shape
    tail = seq - prompt_len + 1  # positions prompt_len - 1 … seq - 1
    if not 1 <= prompt_len <= seq:
        raise ValueError(f"prompt_len {prompt_len} outside the sequence of {seq}")
    if logits.shape not in ((batch, seq, vocab), (batch, tail, vocab)):
        raise ValueError(f"logits of shape {tuple(logits.shape)} vs reference {(batch, seq, vocab)}"
                         f": run the model on the same sequence (whole, or its last {tail})")
    picks = logits[:, -tail:].argmax(-1) == ref_logits[:, -tail:].argmax(-1)  # [batch, tail]
    return picks.float().mean().item()


def forced_decode_logits(model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits ``[batch, seq - prompt_len + 1, vocab]`` of ``model`` (an HF causal LM or an
    engine's module) prefilled with ``tokens[:, :prompt_len]`` and then fed the rest of
    ``tokens`` ``[batch, seq]`` one decode step at a time, through its KV cache: teacher forcing
    that runs the decode step (and its captured graph, where there is one)."""
    with torch.no_grad():
        out = model(tokens[:, :prompt_len], use_cache=True)
        steps = [out.logits[:, -1:].float()]
        for pos in range(prompt_len, tokens.shape[1]):
            out = model(tokens[:, pos:pos + 1], past_key_values=out.past_key_values,
                        use_cache=True)
            steps.append(out.logits[:, -1:].float())
    return torch.cat(steps, dim=1)

"""Tiny Hugging Face models with fixed-seed random weights, for tests (no hub access), built from
the registry of test families (tests/families.py); the inputs, tokenizer and parity measures the
test files share."""

from __future__ import annotations

import copy

import torch
import transformers
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

from families import FAMILIES, family

#: family name → config kwargs (``cls``: the transformers config class), read from the one registry
#: of test families (tests/families.py: what each family is and which tests cover it)
TINY_CONFIGS = {name: fam.config for name, fam in FAMILIES.items()}


def tiny_causal_lm(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A small ``AutoModelForCausalLM`` of ``arch`` with weights drawn from ``seed``."""
    spec = dict(family(arch).config)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def tiny_encoder(arch: str = "bert", seed: int = 0, head: str = "masked_lm",
                 dtype: torch.dtype = torch.float32):
    """A small encoder of ``arch`` with weights drawn from ``seed``: ``head="masked_lm"`` gives
    ``AutoModelForMaskedLM`` (no pooler), ``head="base"`` the bare ``AutoModel`` (with pooler)."""
    spec = dict(family(arch).config)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    auto = {"masked_lm": transformers.AutoModelForMaskedLM, "base": transformers.AutoModel}[head]
    torch.manual_seed(seed)
    return auto.from_config(config, dtype=dtype).eval()


def rounded_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (fp32) with every linear / ``Conv1D`` weight (and so an embedding table tied to
    one) rounded once to ``dtype`` and widened back: what an engine with
    ``weight_dtype=dtype`` must compute (tests/test_weight_dtype.py)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for module in out.modules():
            w = getattr(module, "weight", None)
            if (isinstance(w, torch.Tensor) and w.dim() == 2
                    and not isinstance(module, torch.nn.Embedding)):
                w.data = w.data.to(dtype).float()
    return out


def prompt_ids(batch: int = 1, length: int = 8, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 256 ids: ``"t7"`` is id 7; ids 0–2 are
    ``<unk>``, ``<s>``, ``</s>`` (tiny Llama's bos/eos ids)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 256)}}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


def logit_parity(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(relative error ``‖logits - ref‖ / ‖ref‖``, fraction of positions whose argmax agrees) of
    two logit tensors of one shape, e.g. ``[batch, seq, vocab]``; compared in fp32. The bounds
    a quantized model is held to: ``families.QUANT_BOUNDS``."""
    ref_logits, logits = ref_logits.float(), logits.float()
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    return rel, agree


#: The least teacher-forced agreement (:func:`teacher_forced_agreement`) a reduced-precision or
#: tensor-parallel run may show against HF: every test uses this one bound.
MIN_FORCED_AGREEMENT = 0.9


def bf16_against_hf(ref: torch.nn.Module, engine, batch: int = 2, length: int = 8,
                    new_tokens: int = 32) -> tuple[float, float]:
    """(max |logit difference|, teacher-forced agreement) of ``engine`` against the HF model
    ``ref``: HF's own greedy continuation of a fixed prompt ``[batch, length + new_tokens]`` fed
    to both in one forward (the reduced-precision parity check of every injected family)."""
    ids = prompt_ids(batch=batch, length=length).to(ref.device)
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **greedy)
        ref_logits = ref(ref_tokens).logits.float()
        logits = engine(input_ids=ref_tokens).logits.float()
    forced = teacher_forced_agreement(ref_logits, logits, length)
    return (logits - ref_logits).abs().max().item(), forced


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

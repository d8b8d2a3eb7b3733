"""The greedy slot scenario shared by tests/test_serve_runner.py (CPU, graph doubles) and
tests/test_cuda_paths.py (real CUDA graphs): several prompts of different lengths driven through
one SlotRunner — sequences join while others decode, a prompt is prefilled in chunks (one of
them a single token), a finished sequence leaves and a new one takes its slot — and the check
that every sequence got what Hugging Face ``generate`` gives its prompt alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models import prompt_ids
from shardwise.serve.runner import SlotRunner

#: |logit difference| allowed against HF in fp32 on the CPU
FP32_ATOL = 1e-4


@dataclass
class Seq:
    """One sequence of the greedy loop: its prompt, how many tokens it generates, its slot,
    the tokens and logits it got."""

    prompt: list[int]
    new: int
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.new

    def take(self, logits: torch.Tensor) -> None:
        assert logits.dtype == torch.float32 and logits.dim() == 1
        self.logits.append(logits)
        self.tokens.append(int(logits.argmax()))


def prefill(runner: SlotRunner, seq: Seq, slot: int, chunks: list[int]) -> None:
    """Prefill the next tokens of ``seq``'s prompt into ``slot``, in chunks of these sizes."""
    seq.slot, start = slot, runner.length(slot)
    for size in chunks:
        end = start + size
        logits = runner.prefill(slot, seq.prompt[start:end], last=end == len(seq.prompt))
        assert (logits is None) == (end < len(seq.prompt))
        if logits is not None:
            seq.take(logits)
        start = end
    assert runner.length(slot) == start


#: decode steps the greedy loop ran (all tests of this module)
DECODES = [0]


def step(runner: SlotRunner, running: list[Seq]) -> list[Seq]:
    """One decode step over the running sequences; a sequence that is done leaves (its slot
    is released). Returns the ones still running."""
    active = [s for s in running if not s.done]
    if active:
        DECODES[0] += 1
        logits = runner.decode([s.slot for s in active], [s.tokens[-1] for s in active])
        assert logits.shape == (len(active), runner.vocab_size) and logits.dtype == torch.float32
        for seq, row in zip(active, logits):
            seq.take(row)
    for seq in [s for s in running if s.done]:
        runner.release(seq.slot)
        assert runner.length(seq.slot) == 0
    return [s for s in running if not s.done]


def scenario(runner: SlotRunner) -> list[Seq]:
    """A joins slot 0; B is prefilled into slot 2 in chunks (4, 1, rest) between A's decode
    steps; C joins slot 1; A leaves and D takes slot 0; all run to the end."""
    prompts = [prompt_ids(1, n, seed=10 + n)[0].tolist() for n in (5, 9, 3, 6)]
    a, b, c, d = Seq(prompts[0], 4), Seq(prompts[1], 8), Seq(prompts[2], 7), Seq(prompts[3], 6)
    prefill(runner, a, 0, [5])
    prefill(runner, b, 2, [4])  # B joins: a first chunk, no logits yet
    running = step(runner, [a])
    prefill(runner, b, 2, [1])  # a one-token chunk after cached tokens
    running = step(runner, running)
    prefill(runner, b, 2, [4])  # B's last chunk: its first token
    prefill(runner, c, 1, [3])
    running = step(runner, running + [b, c])
    while a in running:
        running = step(runner, running)
    prefill(runner, d, 0, [2, 4])  # A's slot, reused at once
    running.append(d)
    while running:
        running = step(runner, running)
    return [a, b, c, d]


def hf_greedy(ref, prompt: list[int], new: int) -> list[int]:
    """HF generate's greedy tokens for ``prompt`` alone: ``new`` of them, or fewer ending in
    an end-of-sequence token (the loop here runs on past it, as nothing stops it)."""
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt], device=ref.device), max_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    eos = ref.generation_config.eos_token_id
    assert len(tokens) == new or tokens[-1] in (eos if isinstance(eos, list) else [eos])
    return tokens


def check_against_hf(ref, seqs: list[Seq], atol: float = FP32_ATOL) -> float:
    """Each sequence's tokens equal HF generate of its prompt alone (up to an end-of-sequence
    token); its logits are within ``atol`` of HF's over prompt + tokens. Returns the max
    |logit diff|."""
    worst = 0.0
    for seq in seqs:
        expected = hf_greedy(ref, seq.prompt, seq.new)
        with torch.no_grad():
            full = torch.tensor([seq.prompt + seq.tokens[:-1]], device=ref.device)
            ref_logits = ref(full).logits[0, len(seq.prompt) - 1:].float()
        assert seq.tokens[:len(expected)] == expected
        logits = torch.stack(seq.logits).to(ref_logits.device)
        worst = max(worst, (logits - ref_logits).abs().max().item())
    assert worst < atol, worst
    return worst

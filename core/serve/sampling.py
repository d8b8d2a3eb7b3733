"""Picking one sequence's next token from its logits: greedy, temperature, nucleus (``top_p``),
a per-sequence seed, OpenAI's presence/frequency penalties, and log-probabilities.

The scheduler keeps one :class:`Sampler` per running sequence and calls :meth:`Sampler.sample`
once per decode step with that sequence's row of the logits (float32 ``[vocab]``). The sampler
counts the tokens it has returned, for the penalties.

Cost (measured on this project's 2-core CPU, one thread, vocab 49152): a full ``torch.sort`` of the
vocabulary takes ~3 ms and ``torch.multinomial`` over it ~0.8 ms, which is as long as a decode
step of the default model. So the nucleus is found with ``torch.topk`` on a growing ``k`` (64,
512, 4096, ... : a peaked distribution's nucleus is found in the first ~55 µs) and the token is
drawn by inverse CDF (one uniform number, ``cumsum`` + ``searchsorted``: ~45 µs over the whole
vocabulary). A flat distribution (temperature > 1 with top_p) still needs the full sort. The
kept set is exactly transformers' ``TopPLogitsWarper``'s (a test checks it); temperature is a
division (transformers' ``TemperatureLogitsWarper`` is the same division on a ``[1, vocab]``
tensor).

Per call, median over 40 real SmolLM2 logit rows (vocab 49152, one thread, a busy 2-core CPU):
greedy 32 µs; greedy with logprobs=5 104 µs; temperature 1 74 µs; temperature 0.7 + top_p 0.9
112 µs; with both penalties and logprobs=5 203 µs; temperature 1.5 + top_p 0.95 (a flat
distribution, nucleus of thousands) ~1 ms. transformers' TopPLogitsWarper + multinomial on the
same rows: 3–12 ms.
"""

from __future__ import annotations

import math

import torch

from .types import SamplingParams, TokenEvent

#: Temperatures below this are greedy: dividing logits by ~0 overflows (vLLM uses the same bound).
GREEDY_TEMPERATURE = 1e-5
#: The first ``k`` tried when looking for the nucleus; each miss multiplies it by
#: ``_NUCLEUS_GROWTH``, up to the whole vocabulary.
_NUCLEUS_FIRST_K = 64
_NUCLEUS_GROWTH = 8
_GARBAGE = ("the logits are NaN, or -inf everywhere, or overflow: no token can be picked (the "
            "model's output is broken; check its dtype and weights)")


def _check_params(params: SamplingParams) -> None:
    """Reject parameters no sampler can honour (the API layer checks OpenAI's ranges first)."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be ≥ 0 (0 is greedy), got {params.temperature}")
    if not 0.0 <= params.top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] (1 keeps every token), got {params.top_p}")
    if params.logprobs is not None and params.logprobs < 0:
        raise ValueError(f"logprobs must be None or ≥ 0 (how many top tokens to report), "
                         f"got {params.logprobs}")


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus of ``probs`` [vocab] (summing to 1): the smallest set of most likely tokens
    whose mass is ≥ ``top_p``, at least one token (OpenAI's and transformers'
    ``TopPLogitsWarper``'s rule: a token is kept when the mass of the tokens more likely than it
    is < ``top_p``). Returns ``(probabilities, token ids)``, most likely first, both [kept]."""
    vocab = probs.shape[-1]
    k = min(_NUCLEUS_FIRST_K, vocab)
    while True:
        values, ids = torch.topk(probs, k)            # [k] each, descending
        cumulative = torch.cumsum(values, 0)          # [k]
        if k == vocab or cumulative[-1].item() >= top_p:
            break
        k *= _NUCLEUS_GROWTH
        if k > vocab // 4:                            # topk of a big k costs as much as a sort
            k = vocab
    before = cumulative - values                      # mass of the tokens more likely than each
    kept = max(int((before < top_p).sum().item()), 1)
    return values[:kept], ids[:kept]


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Index drawn from the unnormalised, non-negative weights ``probs`` [n] by inverse CDF (one
    uniform number from ``generator``; ~20× faster than ``torch.multinomial`` at n = 49152).
    Zero-weight entries are never drawn."""
    cdf = torch.cumsum(probs, 0)                      # [n]
    total = cdf[-1]
    if not 0.0 < total.item() < math.inf:            # NaN fails both comparisons
        raise ValueError(_GARBAGE)
    u = torch.rand(1, generator=generator, device=probs.device) * total
    index = int(torch.searchsorted(cdf, u, right=True).item())
    if index == probs.shape[0]:
        # u < total, but rounding can put it on the last edge: the last entry of weight > 0
        index = int(torch.searchsorted(cdf, total, right=False).item())
    return index


class Sampler:
    """One sequence's token picker: ``sample(logits)`` → :class:`TokenEvent`.

    Per call, with ``logits`` float32 [vocab] (columns past ``vocab_size`` — a padded embedding —
    are dropped first):

    1. **Penalties** (OpenAI's definition, over the tokens this sampler has returned so far, not
       the prompt):
       ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``.
    2. **Log-probabilities** (``params.logprobs`` = k ≥ 0): ``log_softmax`` of the penalised logits,
       *before* temperature and ``top_p``. The chosen token's value and the k largest
       ``(token id, logprob)`` pairs, most likely first, go in the event. This is the model's
       distribution as the request shaped it with penalties, independent of how it is then
       sampled: a greedy pick is always the top entry, and the numbers are defined at
       temperature 0. (vLLM's default, ``raw_logprobs``, is the same minus the penalties; its
       ``processed_logprobs`` also applies temperature and top-p.)
    3. **Choice**: temperature 0 (or below :data:`GREEDY_TEMPERATURE`) is ``argmax`` — ties go
       to the lowest id, as in transformers' greedy ``generate``, so with no penalties it is
       token-for-token ``generate``'s pick. Otherwise ``softmax(logits / temperature)``, cut to
       the nucleus when ``top_p`` < 1, and one draw from this sampler's own generator.

    ``seed`` given: the generator is seeded with ``seed + index`` (``index``: which of the
    request's ``n`` choices), so choices differ and a repeated request repeats; no seed: seeded
    from the OS (nondeterministic). The global torch RNG is never touched.

    Raises ``ValueError`` for bad parameters (at construction), logits of the wrong shape, or
    logits without a finite maximum (NaN or all -inf: the model produced garbage).
    """

    def __init__(self, params: SamplingParams, index: int = 0,
                 vocab_size: int | None = None) -> None:
        _check_params(params)
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be ≥ 1 or None (use every logit), got {vocab_size}")
        self.params = params
        self.index = index
        self.vocab_size = vocab_size
        self.greedy = params.temperature < GREEDY_TEMPERATURE
        self.counts: dict[int, int] = {}              # token id → times this sampler returned it
        self._penalised = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._penalty: torch.Tensor | None = None     # [vocab] what to subtract, kept up to date
        self._generator: torch.Generator | None = None

    # ----- the steps -------------------------------------------------------------------------

    def _trim(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() != 1:
            raise ValueError(f"Sampler.sample takes one sequence's logits [vocab], got shape "
                             f"{tuple(logits.shape)}; pass logits[i] for row i of a batch")
        if self.vocab_size is not None:
            if logits.shape[0] < self.vocab_size:
                raise ValueError(f"logits have {logits.shape[0]} columns, fewer than the "
                                 f"tokenizer's vocab_size {self.vocab_size}")
            logits = logits[: self.vocab_size]
        return logits.float()

    def _penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` minus the penalties of the tokens returned so far (a new tensor)."""
        if self._penalty is None:
            return logits
        return logits - self._penalty

    def _record(self, token: int, vocab: int, device: torch.device) -> None:
        """Count ``token`` and add its penalty increment for the next call."""
        seen = self.counts.get(token, 0)
        self.counts[token] = seen + 1
        if not self._penalised:
            return
        if self._penalty is None:
            self._penalty = torch.zeros(vocab, dtype=torch.float32, device=device)
        step = self.params.frequency_penalty + (self.params.presence_penalty if seen == 0 else 0.0)
        self._penalty[token] += step

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            generator = torch.Generator(device=device)
            if self.params.seed is None:
                generator.seed()                      # from the OS: nondeterministic
            else:
                generator.manual_seed((self.params.seed + self.index) % 2**64)
            self._generator = generator
        return self._generator

    def _choose(self, logits: torch.Tensor) -> int:
        """The next token from the penalised ``logits`` [vocab]."""
        if self.greedy:
            token = int(torch.argmax(logits).item())  # NaN counts as the maximum
            if math.isnan(value := logits[token].item()) or value == -math.inf:
                raise ValueError(_GARBAGE)
            return token
        probs = torch.softmax(logits / self.params.temperature, dim=-1)      # [vocab]
        generator = self._rng(logits.device)
        if self.params.top_p < 1.0:
            values, ids = nucleus(probs, self.params.top_p)
            return int(ids[draw(values, generator)].item())
        return draw(probs, generator)

    def _logprobs(self, logits: torch.Tensor, token: int
                  ) -> tuple[float, tuple[tuple[int, float], ...]]:
        logprobs = torch.log_softmax(logits, dim=-1)  # [vocab]
        k = min(self.params.logprobs, logprobs.shape[0])
        top = ()
        if k > 0:
            values, ids = torch.topk(logprobs, k)     # descending; ties: lowest id first
            top = tuple(zip(ids.tolist(), values.tolist()))
        return float(logprobs[token].item()), top

    @property
    def batchable(self) -> bool:
        """Plain greedy (no penalties, no logprobs): :func:`sample_rows` picks it with the other
        such rows of a step in one ``argmax`` and one device→host copy."""
        return self.greedy and not self._penalised and self.params.logprobs is None

    def accept(self, token: int) -> TokenEvent:
        """Count ``token``, chosen for this sampler by :func:`sample_rows`, as :meth:`sample`
        counts its own pick."""
        self.counts[token] = self.counts.get(token, 0) + 1
        return TokenEvent(token_id=token)

    # ----- the public call -------------------------------------------------------------------

    def sample(self, logits: torch.Tensor) -> TokenEvent:
        """Pick the next token from this sequence's ``logits`` (float32 [vocab]; not modified)
        and count it for the penalties of later calls."""
        logits = self._penalise(self._trim(logits))
        token = self._choose(logits)
        logprob = top = None
        if self.params.logprobs is not None:
            logprob, top = self._logprobs(logits, token)
        self._record(token, logits.shape[0], logits.device)
        return TokenEvent(token_id=token, logprob=logprob, top_logprobs=top)


def sample_rows(samplers: list, logits: torch.Tensor) -> list[TokenEvent | Exception]:
    """Row ``i`` of ``logits`` (float32 [rows, vocab], one decode step) sampled by
    ``samplers[i]`` → its :class:`TokenEvent`, or the exception its sampling raised (that row
    alone failed; the caller ends its sequence).

    The :attr:`Sampler.batchable` rows (plain greedy: the common case) are picked together: one
    ``argmax`` over all of them and ONE device→host copy of the chosen ids, instead of an
    ``argmax`` and two ``.item()`` synchronisations per row. The pick is the same as
    :meth:`Sampler.sample`'s (``argmax``, ties to the lowest id; a row whose maximum is NaN or
    -inf is garbage, a ``ValueError``). Every other row goes through its own
    :meth:`Sampler.sample`.
    """
    out: list[TokenEvent | Exception | None] = [None] * len(samplers)
    fast = [i for i, s in enumerate(samplers) if isinstance(s, Sampler) and s.batchable]
    vocab = {samplers[i].vocab_size for i in fast}
    if len(vocab) > 1 or logits.dim() != 2:  # mixed vocabularies: no common slice to batch
        fast = []
    if fast:
        try:
            ids = _greedy_ids(logits, fast, vocab.pop())
        except Exception as exc:  # noqa: BLE001 - e.g. too few columns: each such row failed
            ids = [exc] * len(fast)
        for i, token in zip(fast, ids):
            if isinstance(token, Exception):
                out[i] = token
            else:
                out[i] = samplers[i].accept(token) if token >= 0 else ValueError(_GARBAGE)
    for i, sampler in enumerate(samplers):
        if out[i] is None:
            try:
                out[i] = sampler.sample(logits[i])
            except Exception as exc:  # noqa: BLE001 - that row's failure, handed back
                out[i] = exc
    return out


def _greedy_ids(logits: torch.Tensor, rows: list[int], vocab_size: int | None) -> list[int]:
    """``argmax`` of ``logits[rows, :vocab_size]`` per row, -1 where the maximum is NaN or -inf;
    one device→host copy."""
    if len(rows) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
    if vocab_size is not None:
        if logits.shape[1] < vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the "
                             f"tokenizer's vocab_size {vocab_size}")
        logits = logits[:, :vocab_size]
    ids = torch.argmax(logits, dim=-1)                          # [rows]; NaN counts as max
    best = logits.gather(1, ids[:, None])[:, 0]                 # [rows]
    garbage = torch.isnan(best) | (best == -math.inf)
    return ids.masked_fill(garbage, -1).tolist()

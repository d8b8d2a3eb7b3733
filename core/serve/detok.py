"""Text from a stream of generated token ids: :class:`IncrementalDetokenizer` turns each new
token into the text it completes, and :class:`StopMatcher` holds back text that may be the start
of a stop string and cuts the stream where one matches (OpenAI's ``stop``).

Why incremental decoding is not ``decode([token])``: a byte-level BPE token can carry part of a
UTF-8 character (an emoji is often three tokens), and a SentencePiece token's leading space is
dropped when it is decoded alone. So each step decodes a short window of recent tokens twice —
without and with the new ones — and emits the difference, holding it back while it ends in an
incomplete character (U+FFFD). This is the scheme of Hugging Face's text-generation-inference and
vLLM; with no prompt, the deltas joined are ``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

from typing import Sequence

#: Prompt tokens kept as context for the first generated ones (a leading space, a character the
#: prompt started): vLLM and text-generation-inference use the same 5.
PROMPT_CONTEXT_TOKENS = 5
#: What a decoder puts for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, as they come.

    ``add(token_id)`` returns the text this token completes ("" while a character is split over
    tokens, or for a special token such as EOS: special tokens are skipped, as by
    ``decode(..., skip_special_tokens=True)``); ``flush()`` at the end returns whatever was held
    back (an incomplete character decodes to U+FFFD there, as it does in ``decode``).
    ``prompt_ids``: the prompt, whose last few tokens give the first generated ones their context
    (e.g. a SentencePiece "▁Hello" after a prompt is " Hello", not "Hello").

    ``token_text(token_id)`` is one token's own text, for ``logprobs`` (what OpenAI puts in
    ``tokens`` / ``token`` / ``top_logprobs``): with its leading space, special tokens included
    (``"<|im_end|>"``), U+FFFD where the token holds only part of a character.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]
        # the window: _ids[:_read] is decoded already (context), _ids[_read:] not yet emitted
        self._ids: list[int] = context
        self._read = len(context)
        self._emitted = self._decode(context)     # text of _ids[:_read]
        self._anchor: tuple[list[int], str] | None = None
        self._pieces: dict[int, str] = {}

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        if len(text) <= len(self._emitted) or text.endswith(REPLACEMENT):
            return ""                             # nothing new yet, or a character is split
        new = text[len(self._emitted):]
        # the window restarts at the tokens just emitted: they are the next tokens' context
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._emitted = self._decode(self._ids)
        return new

    def flush(self) -> str:
        """The text held back at the end of the sequence (an incomplete character is U+FFFD)."""
        text = self._decode(self._ids)
        new = text[len(self._emitted):] if len(text) > len(self._emitted) else ""
        self._ids = self._ids[len(self._ids):]
        self._read, self._emitted = 0, ""
        return new

    def token_text(self, token_id: int) -> str:
        """The text of ``token_id`` alone, with its leading space (see the class docstring)."""
        token_id = int(token_id)
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._token_text(token_id)
        return piece

    def _token_text(self, token_id: int) -> str:
        # decoded after an ordinary token (the "anchor", e.g. "a"), so a SentencePiece decoder
        # does not strip the token's leading space as the start of the text
        if self._anchor is None:
            ids = list(self.tokenizer.encode("a", add_special_tokens=False))
            self._anchor = (ids, self._plain_decode(ids))
        anchor_ids, anchor_text = self._anchor
        both = self._plain_decode(anchor_ids + [token_id])
        if anchor_ids and both.startswith(anchor_text):
            return both[len(anchor_text):]
        return self._plain_decode([token_id])

    def _plain_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)


class StopMatcher:
    """Cut a text stream at the first of ``stops`` (OpenAI's ``stop``: up to a few strings).

    ``feed(text)`` returns ``(safe, matched)``: ``safe`` is the text that can be sent now. Text
    that could be the start of a stop string is held back until the next chunk decides it; when a
    stop string completes (anywhere, also across chunks), ``safe`` is everything before it, the
    stop string itself is not sent, and ``matched`` is True — the caller then ends the sequence
    (later feeds return ``("", True)``). ``flush()`` returns the held-back text at the end of a
    sequence that no stop string ended. When several stop strings complete in the same chunk, the
    one starting first wins, so the text sent never contains any of them.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = (stops,)
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stops = tuple(stops)
        self.matched = False
        self._held = ""

    def _holdback(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(text safe to send now, whether a stop string matched)``."""
        if self.matched:
            return "", True
        text = self._held + text
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.matched, self._held = True, ""
            return text[:min(found)], True
        keep = self._holdback(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text (no stop string completed it); "" after a match."""
        held, self._held = self._held, ""
        return held

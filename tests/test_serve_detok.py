"""Text of a token stream (shardwise.serve.detok): the incremental detokenizer's deltas join to
what ``tokenizer.decode`` gives for all the ids, never with a U+FFFD fragment of a character split
over tokens, with the real SmolLM2 tokenizer (byte-level BPE) and a SentencePiece-style one (byte
fallback, "▁" spaces); stop strings cut the stream across chunk boundaries."""

from __future__ import annotations

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers

from shardwise.models import default_model_path
from shardwise.serve.detok import IncrementalDetokenizer, StopMatcher

#: Accents, emoji (4 bytes, some with modifiers and joiners), CJK, Greek, and plain words.
MULTILINGUAL = ("Héllo, naïve café! 🤗 Ünïcödé 👍🏽 👨‍👩‍👧 世界 日本語のテキスト Ελληνικά — "
                "déjà vu. Ok 😀😀")


@pytest.fixture(scope="module")
def smollm2():
    """The default model's tokenizer (SmolLM2, byte-level BPE), read from its GGUF file."""
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-style tokenizer: unigram pieces with "▁" for spaces, bytes for everything else
    (``<0xF0>`` ...), and Llama's decoder (which drops the text's leading space)."""
    pieces = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + ["▁", "▁Hello", "▁world", "▁caf", "é", "▁the", "!", ",", "a", "▁a"])
    vocab = [(p, 0.0 if i < 259 else -1.0) for i, p in enumerate(pieces)]
    backend = Tokenizer(tok_models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


def deltas(tokenizer, ids, prompt_ids=()) -> list[str]:
    """Every add()'s text, then flush()'s."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.add(i) for i in ids] + [detok.flush()]


# ----- the incremental detokenizer ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_deltas_join_to_decode_with_no_broken_characters(name, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    out = deltas(tokenizer, ids)
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True) == MULTILINGUAL
    assert not any("\ufffd" in piece for piece in out)
    # characters split over tokens were held back: some tokens completed no text
    assert out.count("") > 1 and len(out) == len(ids) + 1


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_every_delta_is_a_whole_prefix_step(name, request):
    # after each token the text so far is a prefix of the final text, and all of
    # decode(ids so far) unless that ends inside a character (then decode shows U+FFFD: one per
    # byte of the run, with SentencePiece's byte fallback)
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(MULTILINGUAL, add_special_tokens=False)
    detok, text = IncrementalDetokenizer(tokenizer), ""
    for n, token in enumerate(ids, 1):
        text += detok.add(token)
        assert MULTILINGUAL.startswith(text)
        so_far = tokenizer.decode(ids[:n])
        if "\ufffd" not in so_far:
            assert text == so_far                     # nothing held back once it is whole


def test_special_tokens_are_skipped_like_decode(smollm2):
    ids = smollm2.encode("Paris is 🤗 nice", add_special_tokens=False)
    eos = smollm2.convert_tokens_to_ids(smollm2.eos_token)
    ids = [smollm2.convert_tokens_to_ids("<|im_start|>")] + ids[:3] + [eos] + ids[3:] + [eos]
    out = deltas(smollm2, ids)
    assert "".join(out) == smollm2.decode(ids, skip_special_tokens=True) == "Paris is 🤗 nice"
    assert out[0] == "" and out[-2] == ""


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_the_prompt_gives_the_first_tokens_their_context(name, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode("Hello world, café! 🤗 Hello world", add_special_tokens=False)
    for split in range(1, len(ids)):
        prompt, generated = ids[:split], ids[split:]
        if tokenizer.decode(prompt).endswith("\ufffd"):
            continue                                  # the prompt ends inside a character
        expected = tokenizer.decode(ids)[len(tokenizer.decode(prompt)):]
        assert "".join(deltas(tokenizer, generated, prompt)) == expected, split
    # SentencePiece drops the leading space of a text's first token, but not after a prompt
    world = tokenizer.encode("Hello world", add_special_tokens=False)
    assert "".join(deltas(tokenizer, world[-1:], world[:-1])) == " world"


def test_a_character_left_incomplete_at_the_end_is_flushed_as_decode_shows_it(smollm2):
    ids = smollm2.encode("ok 🤗", add_special_tokens=False)[:-1]  # the emoji's last byte is gone
    detok = IncrementalDetokenizer(smollm2)
    held = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in held
    assert held + detok.flush() == smollm2.decode(ids) and smollm2.decode(ids).endswith("\ufffd")
    assert detok.flush() == ""


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece"])
def test_token_text_keeps_the_leading_space_and_special_tokens(name, request):
    tokenizer = request.getfixturevalue(name)
    detok = IncrementalDetokenizer(tokenizer)
    world = tokenizer.encode("Hello world", add_special_tokens=False)[-1]
    assert detok.token_text(world) == " world"
    assert detok.token_text(tokenizer.convert_tokens_to_ids(tokenizer.eos_token)) == \
        tokenizer.eos_token
    # the pieces of a text are its parts; a piece of a character split over tokens is U+FFFD
    # (SentencePiece's first piece keeps the "▁" it was given at the start of the text)
    pieces = [detok.token_text(i) for i in tokenizer.encode("café 🤗!", add_special_tokens=False)]
    assert "\ufffd" in "".join(pieces)
    assert "".join(pieces).replace("\ufffd", "") == {"smollm2": "café !",
                                                      "sentencepiece": " café !"}[name]


# ----- the stop matcher --------------------------------------------------------------------------

def run(stops, chunks) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        safe, matched = matcher.feed(chunk)
        out.append(safe)
        if matched:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_no_stop_passes_everything_through():
    assert run([], ["Hello", " world"]) == ("Hello world", False)
    assert run(["xyz"], ["Hello", " world", " x"]) == ("Hello world x", False)


def test_text_that_may_start_a_stop_is_held_back_until_decided():
    matcher = StopMatcher(["\nUser:"])
    assert matcher.feed("Sure.\n") == ("Sure.", False)
    assert matcher.feed("Us") == ("", False)
    assert matcher.feed("ually") == ("\nUsually", False)   # not the stop: released
    assert matcher.feed(" yes\nUser") == (" yes", False)
    assert matcher.feed(": hi") == ("", True)              # the stop string itself is not sent
    assert matcher.feed("more") == ("", True) and matcher.flush() == ""


@pytest.mark.parametrize("chunks", [["The answer is 42.", "\n\nNext"],
                                    ["The answer is 42.\n", "\nNext"],
                                    list("The answer is 42.\n\nNext"),
                                    ["The answer is 42.\n\nNext question"]])
def test_a_stop_across_any_chunk_boundary(chunks):
    assert run(["\n\n"], chunks) == ("The answer is 42.", True)


def test_the_earliest_of_several_stops_wins():
    assert run(["END", "!"], ["Hi! ", "and END"]) == ("Hi", True)
    assert run(["END", "!"], ["Hi there EN", "D!"]) == ("Hi there ", True)
    # both complete in one chunk: the one starting first wins; apart, the one completing first
    assert run(["abcd", "bc"], ["xa", "b", "cd"]) == ("x", True)
    assert run(["abcd", "bc"], ["xa", "b", "c", "d"]) == ("xa", True)


def test_a_stop_at_the_very_start():
    assert run(["Hello"], ["Hello world"]) == ("", True)
    assert run(["Hello"], ["He", "llo world"]) == ("", True)


def test_held_back_text_is_flushed_at_the_end():
    matcher = StopMatcher(["STOP", "ST!"])
    assert matcher.feed("almost S") == ("almost ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.flush() == "ST"


def test_overlapping_prefixes_hold_the_longest_candidate():
    # "aab" after "aa": the held "aa" may be the stop's start at either a
    assert run(["aab"], ["xaa", "aab tail"]) == ("xaa", True)


@pytest.mark.parametrize("bad", [[""], ["ok", None]])
def test_empty_or_non_string_stops_are_refused(bad):
    with pytest.raises(ValueError, match="non-empty strings"):
        StopMatcher(bad)

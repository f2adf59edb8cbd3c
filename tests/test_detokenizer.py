"""Incremental detokenization against the tokenizer's own full ``decode``, and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.detokenizer import IncrementalDetokenizer, find_stop_string

VOCAB_SIZE = 320


@pytest.fixture(scope="module")
def tokenizer():
    from engine.testing.checkpoints import make_tiny_tokenizer

    return make_tiny_tokenizer(VOCAB_SIZE)


def stream(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed tokens one at a time, checking at every step that the text so far is final."""
    final = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = []
    for token_id in token_ids:
        deltas.append(detokenizer.add_token(token_id))
        assert not deltas[-1].endswith("\ufffd")  # a character cut by the token boundary waits
        # emitted text is never taken back: it is a prefix of the whole decode
        assert final.startswith(detokenizer.output_text)
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.output_text == final
    return detokenizer, deltas


settings_fast = settings(max_examples=150, deadline=None)


@settings_fast
@given(token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40), skip_special_tokens=st.booleans())
def test_random_token_sequences_decode_to_the_full_decode(tokenizer, token_ids, skip_special_tokens):
    # random ids often cut multi-byte characters or leave them invalid (the tokens are byte-level)
    stream(tokenizer, token_ids, skip_special_tokens)


@settings_fast
@given(
    text=st.text(
        alphabet=st.sampled_from(list("abc xyz.!é€ß中文😀🚀ñ\n")) | st.characters(exclude_categories=("Cs",)),
        max_size=30,
    )
)
def test_text_round_trips_and_never_emits_a_partial_character(tokenizer, text):
    token_ids = tokenizer.encode(text)
    detokenizer, deltas = stream(tokenizer, token_ids, skip_special_tokens=True)
    if not any(special in text for special in tokenizer.all_special_tokens):  # "<s>" in text is the special token
        assert detokenizer.output_text == text
    # valid UTF-8 split across tokens: held back until whole, never shown as U+FFFD
    assert not any("\ufffd" in delta for delta in deltas)


def test_a_character_split_across_tokens_is_held_back_until_complete(tokenizer):
    token_ids = tokenizer.encode("a€b")
    pieces = [tokenizer.decode([t]) for t in token_ids]
    assert "\ufffd" in "".join(pieces)  # the byte-level tokens do split the euro sign
    _, deltas = stream(tokenizer, token_ids, skip_special_tokens=True)
    assert "".join(deltas) == "a€b" and "" in deltas
    assert [d for d in deltas if d] == ["a", "€", "b"]


def test_flush_emits_an_incomplete_character_as_decode_does(tokenizer):
    token_ids = tokenizer.encode("x€")[:-1]  # stop inside the euro sign
    detokenizer, deltas = stream(tokenizer, token_ids, skip_special_tokens=True)
    assert deltas[-1].endswith("\ufffd") and detokenizer.output_text == tokenizer.decode(token_ids)


def test_context_dependent_leading_spaces_use_the_previous_tokens():
    """A Metaspace (SentencePiece-style) decoder drops the space of the first token only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁": 3, "!": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    token_ids = [1, 2, 4, 2]
    assert tokenizer.decode(token_ids) == "hello world! world"
    _, deltas = stream(tokenizer, token_ids, skip_special_tokens=True)
    assert deltas[:4] == ["hello", " world", "!", " world"]


def test_take_delta_holds_back_a_possible_stop_string_start(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, stop_hold_back=2)
    for token_id in tokenizer.encode("hello"):
        detokenizer.add_token(token_id)
    assert detokenizer.take_delta(finished=False) == "hel"
    assert detokenizer.take_delta(finished=False) == ""
    for token_id in tokenizer.encode(" world"):
        detokenizer.add_token(token_id)
    assert detokenizer.take_delta(finished=False) == "lo wor"
    assert detokenizer.take_delta(finished=True) == "ld"
    assert detokenizer.take_delta(finished=True) == ""


@pytest.mark.parametrize(
    "text, new, stop, include, expected",
    [
        ("hello world", 3, ["wor"], False, ("wor", 6)),  # spans the old text and the new characters
        ("hello world", 3, ["wor"], True, ("wor", 9)),
        ("hello world", 2, ["hello"], False, None),  # entirely in text checked before
        ("hello world", 5, ["orl", "wo"], False, ("wo", 6)),  # the earliest one wins
        ("aaa", 1, ["aa"], False, ("aa", 1)),
        ("abc", 3, ["abcd"], False, None),
    ],
)
def test_find_stop_string(text, new, stop, include, expected):
    assert find_stop_string(text, new, stop, include) == expected

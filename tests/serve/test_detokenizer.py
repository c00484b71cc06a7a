"""Incremental detokenization and stop strings, token by token."""

import numpy as np
import pytest

from jaxmodels.serve.detokenizer import IncrementalDetokenizer
from jaxmodels.serve.stop_strings import StopStrings
from tests.serve.checkpoint import byte_level_tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def stream_text(tokenizer, ids) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([t]) for t in ids]
    return deltas + [detokenizer.flush()]


def test_a_character_split_over_tokens_comes_out_whole_once_complete(tokenizer):
    ids = tokenizer.encode("ok 🙂 fin").ids
    deltas = stream_text(tokenizer, ids)
    # The emoji's four bytes are not one token in this vocabulary, so some token is an unfinished character.
    assert any(REPLACEMENT in tokenizer.decode([t]) for t in ids)
    assert "🙂" in deltas
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) == "ok 🙂 fin"


def test_random_tokens_concatenate_to_the_full_decode(tokenizer):
    """Random ids make invalid and unfinished byte sequences and special tokens in any order."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, tokenizer.get_vocab_size(), size=40).tolist()
        assert "".join(stream_text(tokenizer, ids)) == tokenizer.decode(ids)


def test_tokens_added_in_groups_give_the_same_text(tokenizer):
    ids = tokenizer.encode("Un café crème 日本語 🚀!").ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.add(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detokenizer.flush()
    assert text == tokenizer.decode(ids)


def test_an_unfinished_character_at_the_end_is_flushed(tokenizer):
    a, *emoji_start = tokenizer.encode("a🙂").ids[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add([a]) == "a"
    assert detokenizer.add(emoji_start) == ""
    assert detokenizer.flush() == tokenizer.decode(emoji_start)


def test_leading_spaces_of_metaspace_tokens_survive():
    """SentencePiece-style decoders drop the space of the first token they decode: decoding a window that starts
    at an earlier token keeps the space of each new one."""
    from tokenizers import Tokenizer, decoders, models

    words = ["▁Hello", "▁world", ",", "▁how", "▁are", "▁you"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="▁Hello"))
    tokenizer.decoder = decoders.Metaspace()
    ids = list(range(len(words)))
    assert "".join(stream_text(tokenizer, ids)) == tokenizer.decode(ids) == "Hello world, how are you"


def feed(stops, pieces) -> tuple[list[str], StopStrings]:
    matcher = StopStrings(stops)
    out = []
    for piece in pieces:
        out.append(matcher.add(piece))
        if matcher.matched:
            return out, matcher
    out.append(matcher.flush())
    return out, matcher


def test_a_stop_string_across_pieces_ends_the_text_before_it():
    out, matcher = feed(["STOP"], ["abc ST", "O", "P and more"])
    assert matcher.matched
    assert "".join(out) == "abc "


def test_a_possible_stop_string_start_is_held_back_until_it_fails():
    out, matcher = feed(["STOP"], ["abc ST", "Ox"])
    assert out[0] == "abc "  # "ST" could begin the stop string
    assert out[1] == "STOx"
    assert not matcher.matched


def test_the_earliest_of_several_stop_strings_wins():
    out, _ = feed(["world", "lo w"], ["hello wor", "ld"])
    assert "".join(out) == "hel"


def test_held_back_text_is_released_when_the_output_ends():
    out, matcher = feed(["STOP"], ["the end ST"])
    assert not matcher.matched
    assert "".join(out) == "the end ST"

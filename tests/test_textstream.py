"""Streamed text: per-token pieces that add up to the decoded reply, whole characters only."""

import pytest

from bastion.textstream import TextStream

SAMPLES = ["plain ASCII text.", "café, naïve, Ærø", "emoji 🌳🚀 in a row", "日本語のテキスト", "mixed: π ≈ 3.14 ✓ 👍🏽 end"]


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer's decode: every token one byte, UTF-8 across tokens (U+FFFD where cut)."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", SAMPLES)
def test_pieces_are_whole_characters_and_add_up_to_the_decoded_text(text):
    ids = list(text.encode("utf-8"))
    pieces = TextStream(byte_decode, context=list(b"prompt: ")).pieces(ids)
    # a token inside a multi-byte character adds nothing; the one that completes it adds the character
    want = [piece for ch in text for piece in [""] * (len(ch.encode("utf-8")) - 1) + [ch]]
    assert pieces == want and "".join(pieces) == text


def test_tokens_pushed_one_round_at_a_time_give_the_same_pieces():
    ids = list("👍🏽 ok 日本".encode("utf-8"))
    whole = TextStream(byte_decode).pieces(ids)
    stream = TextStream(byte_decode)
    rounds = [stream.pieces(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert [p for r in rounds for p in r] == whole


def test_a_reply_cut_inside_a_character_flushes_what_is_left():
    ids = list("ok 🌳".encode("utf-8"))[:-1]  # max_new_tokens ends inside the emoji
    stream = TextStream(byte_decode)
    pieces = stream.pieces(ids[:3]) + stream.pieces(ids[3:], final=True)
    assert "".join(pieces) == byte_decode(ids) == "ok \ufffd"


def test_word_pieces_keep_their_leading_space_from_the_context():
    """SentencePiece-style: '▁' marks a space and a decode drops the space it would start with, so
    decoding one token at a time loses every space; the window's left context keeps them."""
    vocab = ["▁Hello", ",", "▁world", "▁again", "!"]

    def decode(ids):
        return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    pieces = TextStream(decode, context=[0]).pieces([1, 2, 3, 4])
    assert pieces == [",", " world", " again", "!"]
    assert [decode([i]) for i in [1, 2, 3, 4]] == [",", "world", "again", "!"]  # what one at a time gave


@pytest.mark.slow
def test_the_embedded_tokenizer_streams_emoji_and_cjk_whole():
    from transformers import AutoTokenizer

    from bastion.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = TextStream(tok.decode, tok.encode("Say it:", add_special_tokens=False)).pieces(ids, final=True)
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    assert "\ufffd" in "".join(tok.decode([i]) for i in tok.encode("🌳", add_special_tokens=False))

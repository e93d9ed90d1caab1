"""Streamed text: per-token pieces that add up to the decoded reply, whole characters only."""

import pytest

from bastion.textstream import TextStream, token_display

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
    tree = tok.encode("🌳", add_special_tokens=False)
    assert "\ufffd" in "".join(tok.decode([i]) for i in tree)
    # a label for each part: its bytes, which together are the character's UTF-8
    labels = [token_display(tok, i) for i in tree]
    assert all(x.startswith("⟨") and x.endswith("⟩") for x in labels)
    assert bytes.fromhex(" ".join(x[1:-1] for x in labels)) == "🌳".encode("utf-8")
    assert token_display(tok, tok.encode(" hello", add_special_tokens=False)[0]) == " hello"


class NamedTokens:
    """A tokenizer stand-in: decode as the byte-level one above, token names from a table."""

    def __init__(self, names: dict[int, str]):
        self.names = names

    def decode(self, ids):
        return byte_decode(ids) if ids[0] < 256 else "word"

    def convert_ids_to_tokens(self, i):
        return self.names[i]


def test_labels_of_partial_characters_show_their_bytes():
    tok = NamedTokens({0xF0: "ð", 0x41: "A", 300: "word", 0x9F: "<0x9F>"})
    assert token_display(tok, 0x41) == "A" and token_display(tok, 300) == "word"  # whole: the decoding
    assert token_display(tok, 0xF0) == "⟨f0⟩"  # GPT-2's byte alphabet: "ð" is byte 0xF0
    assert token_display(tok, 0x9F) == "<0x9F>"  # a name outside that alphabet (SentencePiece's) as it is

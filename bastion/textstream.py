"""Token ids → the text each one adds, for output that is shown while it is generated.

Decoding one token at a time is wrong wherever a character spans several tokens: a byte-level BPE
(SmolLM2, Llama 3, Qwen) writes an emoji or a CJK character as 2–4 byte tokens, each of which alone
decodes to U+FFFD ("🌳" as three "�"). SentencePiece tokenizers also drop a word's leading space
at the start of a decode. :class:`TextStream` decodes a short window that keeps already-read tokens
as left context and emits the difference between two decodes of it; a piece that ends inside a
character waits, so that token's text is "" and the token that completes the character carries it.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

CONTEXT = 4  # prompt tokens kept as left context of the first piece
INCOMPLETE = "\ufffd"  # what a decoder writes for the bytes of an unfinished character


class TextStream:
    """Per-token text pieces whose concatenation equals ``decode`` of all the tokens pushed.

    ``decode`` maps a list of ids to text (special tokens kept: a stop token shows as itself);
    ``context`` are ids before the first pushed one (the prompt's), read for spacing, never emitted.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Iterable[int] = ()):
        self._decode = decode
        self._ids = list(context)[-CONTEXT:]
        self._prefix = 0  # window start: ids[_prefix:_read] is emitted context
        self._read = len(self._ids)  # ids[_read:] are pushed but not yet emitted

    def push(self, token: int) -> str:
        """The text ``token`` adds ("" while it ends inside a character)."""
        self._ids.append(token)
        text = self._decode(self._ids[self._prefix:])
        if text.endswith(INCOMPLETE):
            return ""
        return self._emit(text)

    def pieces(self, tokens: list[int], final: bool = False) -> list[str]:
        """One piece per token; ``final`` (the request ends with them) flushes what still waits."""
        out = [self.push(t) for t in tokens]
        if final and out and self._read < len(self._ids):
            out[-1] += self._emit(self._decode(self._ids[self._prefix:]))
        return out

    def _emit(self, text: str) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        # byte-level and SentencePiece decodes of a window extend the decode of its first part; a
        # decoder that rewrites earlier text (space clean-up) loses at most those characters here
        piece = text[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[:self._prefix]  # only the window is ever decoded again
        self._read -= self._prefix
        self._prefix = 0
        return piece


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is a printable character, itself where it is
    printable Latin-1 and 256 + n for the n-th other byte, in byte order. Character → byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(others)}


_ALPHABET: dict[str, int] | None = None


def token_display(tokenizer, token: int) -> str:
    """One token's text for a label: its decoding, or — for a token that is only part of a character,
    which decodes to U+FFFD — its bytes, e.g. "⟨f0 9f⟩" (a byte-level token) or the tokenizer's own
    name for it (SentencePiece byte tokens are named "<0xF0>")."""
    global _ALPHABET
    text = tokenizer.decode([token])
    if INCOMPLETE not in text:
        return text
    name = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(name, str):
        return text
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", name):  # SentencePiece's byte tokens name their byte
        return name
    _ALPHABET = _ALPHABET or _byte_level_alphabet()
    if name and all(ch in _ALPHABET for ch in name):
        return "⟨" + " ".join(f"{_ALPHABET[ch]:02x}" for ch in name) + "⟩"
    return name

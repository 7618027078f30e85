"""Tokenizer access through the `tokenizers` package (no torch), plus streaming detokenization."""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


def _byte_level_bytes() -> dict[str, int]:
    """Inverse of GPT-2's bytes-to-unicode table (byte-level BPE vocabularies spell each byte as one printable
    character): printable bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


BYTE_LEVEL_BYTES = _byte_level_bytes()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte pieces


class Tokenizer:
    def __init__(self, inner: HFTokenizer):
        self.inner = inner

    @staticmethod
    def from_dir(path: str | Path) -> Tokenizer:
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: the checkpoint directory needs a tokenizer.json")
        return Tokenizer(HFTokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token spells on its own: its text's UTF-8 where that is whole characters, else (a piece of
        a multi-byte character, which decodes as U+FFFD) the raw bytes of its byte-level or byte-fallback entry."""
        text = self.decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        entry = self.inner.id_to_token(token_id) or ""
        if fallback := _BYTE_FALLBACK.fullmatch(entry):
            return bytes([int(fallback[1], 16)])
        if entry and all(ch in BYTE_LEVEL_BYTES for ch in entry):
            return bytes(BYTE_LEVEL_BYTES[ch] for ch in entry)
        return text.encode()

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (its vocabulary entry's own bytes: a
        byte-level entry spells each byte as one character, a sentencepiece one each space as three bytes)."""
        return max(len(token.encode()) for token in self.inner.get_vocab(with_added_tokens=True))


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences.

    Each push decodes only the tokens since the last complete delta plus a few before them (a token's text
    can depend on its neighbours, e.g. a leading space): the cost per push does not grow with the output."""

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] give context, already handed out
        self.read_offset = 0  # ids from here on are not handed out yet

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """The text the ids since the last delta add; `final` (no ids follow) hands out an incomplete character too,
        as `decode` spells it, so that the deltas add up to the whole text however the ids came."""
        self.ids.extend(new_ids)
        seen = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if not final and (len(text) <= len(seen) or text.endswith("\ufffd")):
            return ""  # a multi-byte character is still being completed
        self.prefix_offset = max(self.read_offset, len(self.ids) - self.CONTEXT_TOKENS)
        self.read_offset = len(self.ids)
        return text[len(seen):]

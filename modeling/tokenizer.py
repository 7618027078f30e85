"""Tokenizer access through the `tokenizers` package (no torch), plus streaming detokenization."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


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


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # text already handed out

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""  # a multi-byte character is still being completed
        delta, self.text = full[len(self.text):], full
        return delta

"""Tokenizer: an HF tokenizer.json through the `tokenizers` library."""
from __future__ import annotations

import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str):
        self._tok = _HFTokenizer.from_file(path)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer | None":
        path = os.path.join(model_dir, "tokenizer.json")
        return cls(path) if os.path.exists(path) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

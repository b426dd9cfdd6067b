"""Tokenizer: an HF tokenizer.json through the `tokenizers` library.

`encode` goes through `encode_batch`, which releases the GIL (plain `encode` holds it: a 4 MB
prompt would freeze every other Python thread, the server's event loop included, for seconds).
Text that is not valid Unicode (lone surrogates, which JSON's \\udXXX escapes can carry) is an
InvalidRequestError, as are token ids outside the vocabulary.
"""
from __future__ import annotations

import os

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import InvalidRequestError


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

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        check_unicode(text, param)
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_checked(self, ids, vocab_size: int, param: str = "tokens") -> str:
        """decode for untrusted ids: each must be an int in [0, vocab_size)."""
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}"[:200], param)
        return self._tok.decode_batch([list(ids)], skip_special_tokens=False)[0]


def check_unicode(text: str, param: str = "prompt") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                                  f"{e.start}", param) from None

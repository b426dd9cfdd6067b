"""Incremental detokenisation and stop-string matching, per request, on the host.

Decoding only the tokens since the last emitted boundary (vLLM's prefix/read offsets) keeps
each step O(new tokens); text is emitted only once it no longer ends in an incomplete UTF-8
sequence. Stop strings are searched in the newly appended text (plus the tail that could
complete a match), and streaming holds back the characters that might still start one.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._prefix = self._read = 0
        self.text = ""
        self.stop_reason: str | None = None      # the stop string matched, once one is

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def update(self, ids: list[int], match: bool = True) -> bool:
        """ids: all output tokens so far. Appends their new text; returns True when a stop
        string completed in it (text is then cut before it, or after it with include_stop).
        match=False: stop strings are not looked for in this text (before min_tokens)."""
        if self._tok is None or self.stop_reason is not None:
            return False
        prefix_text = self._decode(ids[self._prefix:self._read])
        new_text = self._decode(ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return False
        searched_from = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(ids)
        return match and self._match(searched_from)

    def flush(self, ids: list[int]) -> None:
        """At finish: append whatever is still pending (even an incomplete character)."""
        if self._tok is None or self.stop_reason is not None or self._read >= len(ids):
            return
        prefix_text = self._decode(ids[self._prefix:self._read])
        self.text += self._decode(ids[self._prefix:])[len(prefix_text):]
        self._read = len(ids)

    def _match(self, searched_from: int) -> bool:
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, searched_from)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[:i + len(s)] if self._include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def visible_text(self, finished: bool) -> str:
        """Text safe to stream: all of it when finished, else without a tail that could begin a stop string."""
        if finished or not self._holdback or self.stop_reason is not None:
            return self.text
        return self.text[:max(0, len(self.text) - self._holdback)]

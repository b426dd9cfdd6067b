"""SamplingParams (vLLM's names and defaults) with validation at construction.

Every field is type-checked and bounded here, so a value that reaches the device always fits its
column (int32 / uint32 / float32) and a bad one raises InvalidRequestError (a ValueError) naming
the field and its allowed range. What needs the model (token ids against the vocabulary,
max_tokens against max_model_len - prompt length) is checked by EngineCore.make_request.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from ..errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 128     # logit_bias entries per request
MAX_ALLOWED_TOKENS = 256  # allowed_token_ids per request
BIAS_COLUMNS = 512       # per-step logit adjustments per row (logit_bias, allowed ids, min_tokens / bad_words bans)
NO_BIAS = 2**31 - 1      # bias_ids padding: out of any vocabulary, dropped by the scatter

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
INT32_MAX = 2**31 - 1
MAX_N = 128                     # completions per prompt
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 64
SEED_RANGE = (-2**63, 2**63)    # int64, as vLLM; folded to the uint32 RNG seed


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1                          # completions per prompt, <= MAX_N
    max_tokens: int | None = 16         # None: up to max_model_len; prompt + max_tokens must fit max_model_len
    temperature: float = 1.0            # 0 = greedy
    top_k: int = 0                      # 0 (or -1) = off
    top_p: float = 1.0                  # (0, 1]
    min_p: float = 0.0                  # [0, 1]
    repetition_penalty: float = 1.0     # > 0; 1 = off
    presence_penalty: float = 0.0       # [-2, 2]
    frequency_penalty: float = 0.0      # [-2, 2]
    seed: int | None = None             # per-request RNG stream (int64); None = drawn by the engine
    stop: tuple[str, ...] = ()          # stop strings (not included in the text unless asked)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None         # None = off; n >= 0: the sampled token's logprob + top n
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]); a dict is accepted
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"     # what AsyncLLM streams: cumulative, delta, final_only
    min_tokens: int = 0                 # no EOS / stop token / stop string before this many tokens
    bad_words: tuple[str, ...] = ()     # never generated (each word's last token banned after its prefix)
    allowed_token_ids: tuple[int, ...] | None = None   # only these may be sampled
    truncate_prompt_tokens: int | None = None          # keep only the prompt's last k tokens
    prompt_logprobs: int | None = None  # per prompt token: its logprob + the top n (engine enable_prompt_logprobs)

    def __post_init__(self):
        """Validates and normalises every field (the first bad one raises InvalidRequestError naming it)."""
        self._check_sampling()
        self._check_flags()
        self._check_stops()
        self._check_logit_controls()

    def _bad(self, field, allowed):
        value = repr(getattr(self, field))
        raise InvalidRequestError(f"{field} must be {allowed}, got {value[:80]}", field)

    def _integer(self, field, lo, hi, allowed):
        v = getattr(self, field)
        if not (_is_int(v) and lo <= v <= hi):
            self._bad(field, allowed)
        object.__setattr__(self, field, int(v))

    def _check_sampling(self):
        """n, max_tokens, the sampling knobs, penalties, seed and logprobs."""
        self._integer("n", 1, MAX_N, f"an integer in [1, {MAX_N}]")
        if self.max_tokens is not None:
            self._integer("max_tokens", 1, INT32_MAX, "None or an integer >= 1")
        if not (_finite(self.temperature) and self.temperature >= 0.0):
            self._bad("temperature", "a finite number >= 0")
        if self.top_k == -1 and _is_int(self.top_k):
            object.__setattr__(self, "top_k", 0)
        self._integer("top_k", 0, INT32_MAX, "-1 or 0 (off), or an integer in [1, 2**31)")
        if not (_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            self._bad("top_p", "in (0, 1]")
        if not (_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            self._bad("min_p", "in [0, 1]")
        if not (_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 1e6):
            self._bad("repetition_penalty", "in (0, 1e6]")
        for f in ("presence_penalty", "frequency_penalty"):
            if not (_finite(getattr(self, f)) and -2.0 <= getattr(self, f) <= 2.0):
                self._bad(f, "in [-2, 2]")
        if self.seed is not None:
            self._integer("seed", SEED_RANGE[0], SEED_RANGE[1] - 1, "None or a 64-bit integer")
        if self.logprobs is not None:
            self._integer("logprobs", 0, MAX_LOGPROBS, f"None or an integer in [0, {MAX_LOGPROBS}]")

    def _check_flags(self):
        """The boolean switches and output_kind."""
        for f in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, f), bool):
                self._bad(f, "a boolean")
        if self.output_kind not in OUTPUT_KINDS:
            self._bad("output_kind", f"one of {OUTPUT_KINDS}")

    def _check_stops(self):
        """stop strings and stop token ids, normalised to tuples."""
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not (isinstance(stop, (tuple, list)) and len(stop) <= MAX_STOP_STRINGS
                and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop)):
            self._bad("stop", f"a non-empty string of <= {MAX_STOP_STRING_CHARS} characters or a list of up to "
                        f"{MAX_STOP_STRINGS} of them")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not (isinstance(ids, (tuple, list)) and len(ids) <= MAX_STOP_TOKEN_IDS
                and all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids)):
            self._bad("stop_token_ids", f"a list of up to {MAX_STOP_TOKEN_IDS} non-negative token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    def _check_logit_controls(self):
        """logit_bias, min_tokens, bad_words, allowed_token_ids, prompt_logprobs, truncate_prompt_tokens."""
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, v) for t, v in bias))
        except (TypeError, ValueError):
            self._bad("logit_bias", "a {token id: bias} mapping")
        if not (len(bias) <= MAX_LOGIT_BIAS and all(_is_int(t) and 0 <= t <= INT32_MAX and _finite(v)
                                                    and -100.0 <= v <= 100.0 for t, v in bias)):
            self._bad("logit_bias", f"up to {MAX_LOGIT_BIAS} entries {{token id: bias in [-100, 100]}}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in bias))
        self._integer("min_tokens", 0, self.max_tokens or INT32_MAX, "an integer in [0, max_tokens]")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not (isinstance(words, (tuple, list)) and len(words) <= MAX_BAD_WORDS
                and all(isinstance(w, str) and 0 < len(w.strip()) <= MAX_STOP_STRING_CHARS for w in words)):
            self._bad("bad_words", f"a list of up to {MAX_BAD_WORDS} non-blank strings of <= {MAX_STOP_STRING_CHARS} characters")
        object.__setattr__(self, "bad_words", tuple(words))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not (isinstance(ids, (tuple, list)) and 0 < len(ids) <= MAX_ALLOWED_TOKENS
                    and all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids)):
                self._bad("allowed_token_ids", f"None or a list of 1 to {MAX_ALLOWED_TOKENS} token ids")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in ids})))
        if self.prompt_logprobs is not None:
            self._integer("prompt_logprobs", 0, MAX_LOGPROBS, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.truncate_prompt_tokens is not None:
            self._integer("truncate_prompt_tokens", 1, INT32_MAX, "None or an integer >= 1")

    @property
    def adjusts_logits(self) -> bool:
        """Some step of this request adds to or bans logits (sampler's bias columns)."""
        return bool(self.logit_bias or self.bad_words or self.min_tokens or self.allowed_token_ids is not None)

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

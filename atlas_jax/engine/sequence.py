"""Sequence: one request's host-side life — tokens, cache progress, pages, slot, stop checks,
text, logprobs, metrics.

Cache progress is one number: `num_cached` tokens of `prompt_ids + output_ids` have their
KV / recurrent state in the cache. The next row feeds tokens [num_cached, num_cached + n); a
row whose chunk reaches the last known token samples the next one. So decode (one token
behind), chunked prefill and re-prefill after a recompute preemption (num_cached reset to 0,
outputs kept) are the same rule, and tokens already produced are never re-sampled.

Async scheduling (core.py): a step's sampled tokens reach the host one step late. Such a token is
`pending` — counted in num_tokens, its position fed by the next row as PENDING (the device reads
it from its slot's last sampled token) — until the step is resolved and `append` records it.
`output_ids` holds only tokens the host has read; stop checks run on them.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time

from ..frontend.detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams

PENDING = -1                 # a token id the host has not read yet (its slot's last sampled token on the device)
DRAFT = -2                   # an MTP draft the host never reads (its slot's next draft on the device)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, per second since the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.num_generated_tokens - 1) / max(self.finished_time - self.first_token_time, 1e-9)


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                                  # resolved RNG seed
    max_len: int                               # prompt + max_tokens (<= max_model_len): never exceeded
    order: int = 0                             # arrival order (scheduling priority)
    detok: IncrementalDetokenizer | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    num_cached: int = 0
    state_idx: int = 0                         # recurrent-state position holding the state after num_cached
    device_drafts: int = 0                     # MTP / device ngram: drafts its last step left on the device
    slack: int = 0                             # drafts of its verify row in flight (async): num_cached and
                                               # num_tokens may be up to this much behind until it resolves
    pending: int = 0                           # sampled tokens still on the device (async scheduling): <= 1 when
                                               # a step is scheduled, 2 between a dispatch and the previous resolve
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    dp_rank: int = 0                           # data-parallel rank holding its pages and slot (local ids there)
    swapped_state: object = None               # host copy while SWAPPED
    status: Status = Status.WAITING
    finish_reason: str | None = None           # stop | length | abort | timeout | error
    stop_reason: int | str | None = None       # the stop token id or stop string that ended it
    error: str | None = None
    metrics: RequestMetrics = None             # set in __post_init__
    request: object = None                     # the engine's Request this sequence belongs to
    eos_ids: tuple[int, ...] = ()              # the model's end tokens (finish; banned before min_tokens)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()   # bad_words tokenized (each with and without a leading space)
    lora_name: str | None = None               # the LoRA adapter it runs under (None = the base model)
    client: str | None = None                  # who sent it (fair admission between clients; None = one client)
    adapter_slot: int | None = None            # its adapter's device slot while it holds one (0 = base model)
    # prefix cache (state/prefix_cache.py)
    cache_key: int = 0                         # which cache tree: 0 = the base model, else its adapter's uid
    nodes: list = dataclasses.field(default_factory=list)    # cache nodes of its first full pages, in order
    snap_points: list[int] = dataclasses.field(default_factory=list)   # positions to snapshot at (ascending)
    last_snapshot: int = 0                     # position of its latest snapshot (interval snapshots)
    num_prefix_cached: int | None = None       # tokens its first admission took from the cache
    fork_leader: "Sequence | None" = None      # n > 1: waits until this sibling has prefilled the prompt
    fork_ready: bool = False                   # (leader) the prompt's state is cached for its siblings

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(self.prompt_ids))
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has (num_tokens less the pending ones)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.pending

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def decoding(self) -> bool:
        return self.num_uncached == 1 and self.num_generated > 0

    def next_tokens(self, n: int) -> list[int]:
        """The next n uncached tokens (prompt, or outputs being re-prefilled, or the last sampled)."""
        return self.tokens_between(self.num_cached, self.num_cached + n)

    def tokens_between(self, lo: int, hi: int) -> list[int]:
        """Tokens [lo, hi); PENDING where the host has not read them yet."""
        p = len(self.prompt_ids)
        known = self.prompt_ids[lo:min(hi, p)] + self.output_ids[max(lo - p, 0):max(hi - p, 0)]
        return known + [PENDING] * max(0, min(hi, self.num_tokens) - max(lo, self.num_known))

    def all_tokens(self) -> list[int]:
        """The tokens the host has read (pending ones excluded)."""
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_ids)
        if i >= self.num_known:
            return PENDING
        return self.prompt_ids[i] if i < p else self.output_ids[i - p]

    def append(self, token: int, logprobs: dict[int, float] | None = None) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.output_ids.append(token)
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.num_generated_tokens = len(self.output_ids)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token]
        p = self.params
        early = len(self.output_ids) < p.min_tokens                 # no stop of any kind before min_tokens
        stop_token = token in p.stop_token_ids and not early
        eos = not p.ignore_eos and token in self.eos_ids
        # A stop token's (or EOS's) own text stays out of the output unless include_stop_str_in_output.
        shown = self.output_ids[:-1] if (stop_token or eos) and not p.include_stop_str_in_output else self.output_ids
        if self.detok is not None and self.detok.update(shown, match=not early):
            self.finish("stop", self.detok.stop_reason)
        elif stop_token:
            self.finish("stop", token, text_ids=shown)
        elif eos:
            self.finish("stop", None, text_ids=shown)
        elif self.num_known >= self.max_len:           # max_tokens or max_model_len
            self.finish("length")

    def logit_adjustments(self) -> tuple[dict[int, float], bool]:
        """This step's {token id: added logit} (-inf bans) and whether only those ids may be sampled:
        logit_bias, allowed_token_ids, the stop tokens before min_tokens, bad_words completions."""
        p = self.params
        adjust = dict(p.logit_bias)
        for t in p.allowed_token_ids or ():
            adjust.setdefault(t, 0.0)
        if self.num_generated < p.min_tokens:
            for t in p.stop_token_ids + (() if p.ignore_eos else self.eos_ids):
                adjust[t] = -math.inf
        out = self.output_ids
        for word in self.bad_word_ids:
            if tuple(out[max(0, len(out) - len(word) + 1):]) == word[:-1]:     # the word's prefix just ended
                adjust[word[-1]] = -math.inf
        return adjust, p.allowed_token_ids is not None

    def finish(self, reason: str, stop_reason=None, error: str | None = None, text_ids=None) -> None:
        """text_ids: the tokens whose text the output shows (default: all outputs)."""
        if self.finished:
            return
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        self.pending = 0                            # tokens sampled after the end are dropped
        self.status = Status.FINISHED
        self.metrics.finished_time = time.monotonic()
        if self.detok is not None:
            self.detok.flush(self.output_ids if text_ids is None else text_ids)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

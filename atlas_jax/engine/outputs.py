"""Request outputs, shaped like vLLM's (`outs[0].outputs[0].text`)."""
from __future__ import annotations

import dataclasses

from .sequence import RequestMetrics


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None           # stop | length | abort | timeout | error; None while running
    stop_reason: int | str | None = None  # the stop token id / stop string that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None   # per token: {sampled id and top-n ids: logprob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None    # of the first completion
    error: str | None = None                 # set when the engine failed the request
    prompt_logprobs: list[dict[int, float] | None] | None = None   # None first, then {prompt token and top n: logprob}
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache (first admission)

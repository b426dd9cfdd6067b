"""Request outputs, shaped like vLLM's (`outs[0].outputs[0].text`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None      # "stop" (EOS / stop token), "length" (max_tokens / max_model_len)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

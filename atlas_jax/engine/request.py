"""Request: one client request's n sequences and what has been streamed of them (host only)."""
from __future__ import annotations

import dataclasses

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .sequence import Sequence


class Request:
    """One client request: its n sequences and what has been streamed of them."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], lora: tuple[str, int] | None = None):
        self.request_id, self.prompt, self.prompt_ids, self.params, self.seqs = request_id, prompt, prompt_ids, params, seqs
        self.lora = lora                       # (adapter name, registration uid) or None (the base model)
        self._sent = [(0, 0)] * len(seqs)      # (text chars, tokens) already streamed per sequence (delta kind)
        self.error: str | None = None
        self.prompt_logprobs: list | None = None
        self.lora_pin = None                   # weakref.finalize releasing its adapter's host-copy pin

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """Everything so far, as a snapshot: nothing in it is an object the engine goes on mutating."""
        return self._output([(0, 0)] * len(self.seqs))

    def take_delta(self) -> RequestOutput:
        """What is new since the last take_delta (streaming's `delta` output kind); marks it sent."""
        out = self._output(self._sent)
        self._sent = [(prev_chars + len(c.text), prev_ids + len(c.token_ids))
                      for (prev_chars, prev_ids), c in zip(self._sent, out.outputs)]
        return out

    def _output(self, sent) -> RequestOutput:
        outs = []
        for (sent_text, sent_ids), s in zip(sent, self.seqs):
            text = s.detok.visible_text(s.finished) if s.detok is not None else ""
            outs.append(CompletionOutput(
                index=len(outs), text=text[sent_text:], token_ids=s.output_ids[sent_ids:],
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                logprobs=None if s.logprobs is None else s.logprobs[sent_ids:],
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=list(self.prompt_ids),
                             outputs=outs, finished=self.finished, metrics=dataclasses.replace(self.seqs[0].metrics),
                             error=self.error, prompt_logprobs=self.prompt_logprobs,
                             num_cached_tokens=self.seqs[0].num_prefix_cached or 0)

"""InputProcessor: prompt + SamplingParams -> a validated Request, on any thread (host only).

Tokenises, bounds the request against the model (vocabulary, max_model_len, KV pages, bias
columns) and builds its sequences with their detokenisers and seeds. It touches no engine state
beyond its own counters, so AsyncLLM runs it off the engine thread; a request it returns can
always run (admission then only waits for room).
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np

from ..errors import InvalidRequestError
from ..frontend.detokenizer import IncrementalDetokenizer
from .client import LoRARequest
from .request import Request
from .sampling_params import BIAS_COLUMNS, SamplingParams, _is_int
from .sequence import Sequence


class InputProcessor:
    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids, max_model_len: int, page_size: int,
                 num_pages: int, prompt_logprobs: bool, lora=None, seed: int = 0):
        """lora: the engine's LoRAManager (None: no adapters); prompt_logprobs: the engine can score prompts."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self.max_model_len, self.page_size, self.num_pages = max_model_len, page_size, num_pages
        self.prompt_logprobs, self.lora = prompt_logprobs, lora
        self._seed_rng = np.random.default_rng(seed)
        self._order = itertools.count()
        self._ids = itertools.count()

    def encode(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer.json; pass token ids instead of text", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple, np.ndarray)) or not all(_is_int(t) for t in prompt):
            raise InvalidRequestError("a prompt is a string or a list of integer token ids", "prompt")
        ids = [int(t) for t in prompt]
        self.check_vocab(ids, "prompt")
        return None, ids

    def check_vocab(self, ids, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"{param} token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.vocab_size})", param)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     lora_request: LoRARequest | str | None = None, client: str | None = None) -> Request:
        """Validate and build a request without queueing it; raises ValueError when it can never run.
        lora_request: a LoRARequest (registered and read from disk here if new), a registered adapter's
        name, or None (the base model). client: who sent it (the scheduler admits clients fairly)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        lora = self._lookup_lora(lora_request, params)           # pins the adapter's host copy
        try:
            req = self._build(prompt, params, request_id, lora, client)
        except BaseException:
            if lora is not None:
                self.lora.unpin(*lora)
            raise
        if lora is not None:                                     # unpinned when it leaves the engine, or
            req.lora_pin = weakref.finalize(req, self.lora.unpin, *lora)   # when it is dropped unsubmitted
        return req

    def _build(self, prompt, params: SamplingParams, request_id, lora, client) -> Request:
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        text, ids = self._prompt_ids(prompt, params)
        room = self.max_model_len - len(ids)
        max_len = len(ids) + (room if params.max_tokens is None else params.max_tokens)
        bad_words = self._check_params(params, len(ids), room, max_len)
        seqs = []
        for i in range(params.n):
            seed = (params.seed + i) % 2**32 if params.seed is not None else int(self._seed_rng.integers(2**32))
            detok = (IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                            params.include_stop_str_in_output) if self.tokenizer is not None else None)
            seqs.append(Sequence(request_id=request_id, prompt=text, prompt_ids=ids, params=params, seed=seed,
                                 max_len=max_len, order=next(self._order), detok=detok,
                                 eos_ids=self.eos_token_ids, bad_word_ids=bad_words,
                                 lora_name=lora[0] if lora else None, cache_key=lora[1] if lora else 0,
                                 client=client))
        req = Request(request_id, text, ids, params, seqs, lora)
        for s in seqs:
            s.request = req
        return req

    def _prompt_ids(self, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        text, ids = self.encode(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[len(ids) - params.truncate_prompt_tokens:]
            text = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else None
        return text, ids

    def _check_params(self, params: SamplingParams, prompt_len: int, room: int, max_len: int) -> tuple:
        """Refuse what can never run; returns the bad words' token ids."""
        if room < 1:
            raise InvalidRequestError(f"prompt has {prompt_len} tokens; max_model_len is {self.max_model_len} "
                                      f"(the prompt must leave room for at least one new token)", "prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens is too large: this model's maximum context length is {self.max_model_len} tokens and "
                f"the prompt has {prompt_len}, so at most {room} new tokens fit; {params.max_tokens} were asked for",
                "max_tokens")
        self.check_vocab(params.stop_token_ids, "stop_token_ids")
        self.check_vocab([t for t, _ in params.logit_bias], "logit_bias")
        self.check_vocab(params.allowed_token_ids or (), "allowed_token_ids")
        if params.prompt_logprobs is not None and not self.prompt_logprobs:
            raise InvalidRequestError("prompt_logprobs needs an engine started with enable_prompt_logprobs=True "
                                      "(--enable-prompt-logprobs)", "prompt_logprobs")
        bad_words = self.bad_word_ids(params.bad_words)
        width = (len(params.logit_bias) + len(params.allowed_token_ids or ()) + len(bad_words)
                 + (len(params.stop_token_ids) + len(self.eos_token_ids) if params.min_tokens else 0))
        if width > BIAS_COLUMNS:
            raise InvalidRequestError(f"logit_bias, allowed_token_ids, bad_words and (with min_tokens) stop_token_ids "
                                      f"together adjust {width} tokens; at most {BIAS_COLUMNS}", "logit_bias")
        if self.pages_for(max_len) > self.num_pages:
            raise InvalidRequestError(f"request needs {self.pages_for(max_len)} KV pages of "
                                      f"{self.page_size} tokens; the cache has {self.num_pages}")
        return bad_words

    def _lookup_lora(self, lora_request, params: SamplingParams) -> tuple[str, int] | None:
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with enable_lora=True / "
                                      "--enable-lora)", "lora_request")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not served under a LoRA adapter", "prompt_logprobs")
        return self.lora.lookup(lora_request)

    def bad_word_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, alone and after a space (as vLLM: both spellings a model may use)."""
        if words and self.tokenizer is None:
            raise InvalidRequestError("bad_words needs a tokenizer", "bad_words")
        out = {tuple(self.tokenizer.encode(v)) for w in words for v in (w, " " + w.lstrip())}
        return tuple(sorted(t for t in out if t))

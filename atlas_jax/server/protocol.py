"""OpenAI request bodies (pydantic, strict types) and their mapping onto SamplingParams.

Types are strict, as OpenAI's API is: "0.5" is not a number, true is not an integer. Value ranges
have one source, SamplingParams (and EngineCore for what needs the model: max_tokens against the
context, ids against the vocabulary), so `LLM` users and HTTP clients get the same bounds and the
same errors; vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
min_tokens, bad_words, allowed_token_ids, ...) are accepted too. A violation is a 400 in
OpenAI's error format naming the field (app.py). Unknown fields are ignored, as OpenAI and vLLM
do; fields we accept but cannot honour are refused rather than silently dropped.
"""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import InvalidRequestError
from ..engine.sampling_params import SamplingParams

STRICT = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None      # {"token id": bias in [-100, 100]}
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False                 # completions: each choice's "token_ids" (vLLM)

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        extra = self.model_extra or {}
        if extra.get("best_of") not in (None, 1, self.n):
            raise ValueError("best_of is not supported by this server (use n)")
        if extra.get("response_format") not in (None, {"type": "text"}):
            raise ValueError("response_format other than {'type': 'text'} is not supported by this server")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """max_tokens None: as many as fit in max_model_len after the prompt."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(), output_kind="delta",
            min_tokens=self.min_tokens, bad_words=tuple(self.bad_words or ()),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.prompt_logprobs)

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise InvalidRequestError(f"logit_bias keys are token ids, got {key[:20]!r}", "logit_bias")
            out[int(key)] = bias
        return out


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        return self


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if not isinstance(self.content, list):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(f"content part type {part.type!r} is not supported (text parts only)",
                                          "messages")
        return "".join(part.text for part in self.content)


class _Chat(BaseModel):
    """What the chat template sees besides the messages (transformers' apply_chat_template arguments)."""
    model_config = STRICT
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None
    documents: list[dict] | None = None
    chat_template_kwargs: dict | None = None

    def template_inputs(self) -> dict:
        """ChatTemplate.render's arguments: messages as sent (text parts joined), tools, documents, kwargs."""
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                      "continue_final_message")
        messages = []
        for m in self.messages:
            d = m.model_dump(exclude_unset=True)
            if isinstance(m.content, list):
                d["content"] = m.text()
            if isinstance(d.get("tool_calls"), list):
                d["tool_calls"] = [_arguments_as_object(c) for c in d["tool_calls"]]
            messages.append(d)
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {sorted(reserved)}", "chat_template_kwargs")
        return dict(messages=messages, add_generation_prompt=self.add_generation_prompt and not self.continue_final_message,
                    tools=self.tools, documents=self.documents, continue_final_message=self.continue_final_message,
                    **(self.chat_template_kwargs or {}))


def _arguments_as_object(call):
    """OpenAI sends a tool call's arguments as a JSON string; templates iterate them as a mapping
    (`arguments|items`) or print them (`tojson` of a string keeps it a string): pass a dict when the
    string holds a JSON object, as vLLM does."""
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


class ChatCompletionRequest(_Chat, _Sampling):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice, info):
        tools = info.data.get("tools") or []
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
            if fn["name"] not in {(t.get("function") or {}).get("name") for t in tools}:
                raise ValueError(f"names {fn['name']!r}, which is not in tools")
        elif choice == "required" and not tools:
            raise ValueError('"required" needs tools')
        return choice


class TokenizeRequest(_Chat):
    """{"prompt": text} or the chat fields ({"messages": [...], "tools": ..., "chat_template_kwargs": ...})."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""
    model_config = STRICT
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1)

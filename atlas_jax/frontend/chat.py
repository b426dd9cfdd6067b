"""Chat templates, rendered as transformers' `apply_chat_template` renders them.

Source, first found: --chat-template (a file or the text), the checkpoint's `chat_template.jinja`,
tokenizer_config.json's `chat_template` (a string, or a list of {name, template}: "default", else the
first), else a ChatML default. The jinja environment is transformers': sandboxed, trim_blocks and
lstrip_blocks, loopcontrols, lenient undefined (a template may test `tools is defined`), `tojson`
without HTML escaping, `raise_exception`, `strftime_now`. The template sees messages, tools,
documents, add_generation_prompt, the tokenizer's special tokens and the request's
chat_template_kwargs; reasoning fields are aliased (reasoning / thinking / reasoning_content) and
continue_final_message cuts the render after the last message's content, as transformers does.
"""
from __future__ import annotations

import copy
import json
import os
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequestError

DEFAULT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self._template = env.from_string(source)
        self._special = dict(special_tokens or {})

    @classmethod
    def for_model(cls, model_dir: str, override: str | None = None) -> "ChatTemplate":
        cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        source = _named(cfg.get("chat_template"))
        jinja_file = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file) as f:
                source = f.read()
        if override:
            source = open(override).read() if os.path.exists(override) else override
        special = {k: _token_text(cfg[k]) for k in SPECIAL_TOKENS if cfg.get(k) is not None}
        if cfg.get("additional_special_tokens"):
            special["additional_special_tokens"] = [_token_text(t) for t in cfg["additional_special_tokens"]]
        return cls(source or DEFAULT_TEMPLATE, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, *, tools: list | None = None,
               documents: list | None = None, continue_final_message: bool = False, **kwargs) -> str:
        """messages as the client sent them (dicts); kwargs: chat_template_kwargs."""
        chat = [_alias_reasoning(m) for m in copy.deepcopy(messages)]
        final = None
        if continue_final_message:
            final = chat[-1].get("content") if chat else None
            if not isinstance(final, str):
                raise InvalidRequestError("continue_final_message needs a last message with text content", "messages")
            chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            text = self._template.render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **{**self._special, **kwargs})
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed on these messages: {e}", "messages") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidRequestError(f"chat template failed on these messages: {e!r}", "messages") from None
        if final is not None:
            tag = text.rfind(_CONTINUE_TAG.strip())
            if tag < 0:
                raise InvalidRequestError("continue_final_message: the template dropped the final message", "messages")
            text = text[:tag] if text[tag:tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:tag].rstrip()
        return text


def _alias_reasoning(message):
    """transformers' aliasing: a message's reasoning under any of its names is visible under all."""
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.TemplateError(message)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _named(template):
    """tokenizer_config's chat_template: a string, or [{name, template}] ("default", else the first)."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _token_text(token):
    return token.get("content", "") if isinstance(token, dict) else token

"""Chat templates: the checkpoint's tokenizer_config.json `chat_template` (jinja2, as HF renders
it), a --chat-template file, or a simple ChatML default when neither exists."""
from __future__ import annotations

import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def for_model(cls, model_dir: str, override: str | None = None) -> "ChatTemplate":
        cfg = {}
        path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(path):
            with open(path) as f:
                cfg = json.load(f)
        source = cfg.get("chat_template") or DEFAULT_TEMPLATE
        if override:
            with open(override) if os.path.exists(override) else _Literal(override) as f:
                source = f.read()
        tok = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")
        return cls(source, tok(cfg.get("bos_token")), tok(cfg.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._special)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from None


def _raise(message):
    raise jinja2.TemplateError(message)


class _Literal:
    """A template given inline on the command line, behaving like an open file."""

    def __init__(self, text):
        self.text = text

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self):
        return self.text

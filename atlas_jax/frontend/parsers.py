"""Model output -> OpenAI chat fields: reasoning (`<think>...</think>` -> reasoning_content) and tool
calls (`<tool_call>` blocks -> message.tool_calls), whole or streamed.

Streams take text deltas as the detokenizer yields them (any split, down to one character) and give
back only what can no longer change: text that might be the start of a tag is held until the next
delta decides it. A tool call is emitted when its block closes (or, at the end of the output, when an
unclosed block still parses); a block that never parses is returned as content.

Tool-call formats (`TOOL_PARSERS`):
- "qwen3_json" (Qwen3, Qwen3-Next; vLLM's "hermes"): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
- "qwen3_xml" (Qwen3.5, Qwen3-Coder; vLLM's "qwen3_coder"):
  `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`, values typed
  by the tool's JSON schema.
- "llama3_json" (Llama 3.1+): a reply that is a JSON object `{"name": ..., "parameters": {...}}` (several
  joined by ";"), optionally after `<|python_tag|>`; decided by the reply's first character, held whole.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_PARSERS = ("auto", "qwen3_json", "qwen3_xml", "llama3_json", "none")
PYTHON_TAG = "<|python_tag|>"
TOOL_PARSER_ALIASES = {"hermes": "qwen3_json", "qwen3_coder": "qwen3_xml"}
REASONING_PARSERS = ("auto", "qwen3", "none")


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str                                   # a JSON object, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (text that must wait)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- tool-call block bodies ------------------------------------------------------------------

def _parse_json_call(body: str, tools) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _typed(value: str, schema: dict | None):
    """A parameter's text as the value its JSON schema type asks for (text when it does not parse)."""
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if value.strip() == "null" and "string" not in kinds:
        return None
    if kinds == ["string"] or kind is None and not value.strip()[:1] in ("{", "[") and not _is_number(value):
        return value
    try:
        return json.loads(value)
    except ValueError:
        if "boolean" in kinds and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _parse_xml_call(body: str, tools) -> ToolCall | None:
    m = _FUNCTION.search(body)
    if not m:
        return None
    name = m.group(1).strip()
    props = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
    args = {}
    for key, raw in _PARAMETER.findall(m.group(2)):
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        args[key.strip()] = _typed(value, props.get(key.strip()))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


_BODY_PARSERS = {"qwen3_json": _parse_json_call, "qwen3_xml": _parse_xml_call}


def resolve_tool_parser(name: str, template_source: str) -> str:
    """`auto`: the format the chat template renders tool calls in (none when it renders none)."""
    name = TOOL_PARSER_ALIASES.get(name, name)
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool-call parser must be one of {TOOL_PARSERS + tuple(TOOL_PARSER_ALIASES)}, got {name!r}")
    if name != "auto":
        return name
    if "<function=" in template_source and "<parameter=" in template_source:
        return "qwen3_xml"
    if TOOL_START in template_source:
        return "qwen3_json"
    if "<|start_header_id|>" in template_source and '"parameters"' in template_source:
        return "llama3_json"
    return "none"


def resolve_reasoning_parser(name: str, template_source: str) -> str:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {name!r}")
    if name != "auto":
        return name
    return "qwen3" if THINK_END in template_source else "none"


def forced_opening(fmt: str, tool_choice) -> str:
    """The reply's head the server writes for tool_choice "required" (a tool-call block) or a named
    function (the block up to the arguments), so the model continues a call instead of choosing."""
    if fmt == "llama3_json":
        if isinstance(tool_choice, dict):
            return f'{{"name": {json.dumps(tool_choice["function"]["name"], ensure_ascii=False)}, "parameters": '
        return '{"name": "' if tool_choice == "required" else ""
    if tool_choice == "required":
        return TOOL_START + "\n"
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if fmt == "qwen3_xml":
            return f"{TOOL_START}\n<function={name}>\n"
        return f'{TOOL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    return ""


# ---- streams -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list = dataclasses.field(default_factory=list)      # [ToolCall]

    def __bool__(self):
        return bool(self.content or self.reasoning or self.tool_calls)


class ToolStream:
    """Content text in, (content, finished tool calls) out. Whitespace next to a tool call is dropped
    (held until the next text decides whether a call follows)."""

    def __init__(self, fmt: str, tools=None):
        self.parse = _BODY_PARSERS[fmt]
        self.tools = tools
        self.buf = ""
        self.in_block = False
        self.after_call = False          # the current content segment follows a tool call
        self.ws = ""                     # whitespace before the open block (content again if it is no call)

    def _text(self, text: str, out: Delta):
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        out.content += text

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while True:
            if self.in_block:
                end = self.buf.find(TOOL_END)
                if end < 0:
                    return out
                self._close(self.buf[:end], out, closed=True)
                self.buf = self.buf[end + len(TOOL_END):]
                continue
            start = self.buf.find(TOOL_START)
            if start >= 0:
                before = self.buf[:start]
                self._text(before.rstrip(), out)
                self.ws = before[len(before.rstrip()):]
                self.buf, self.in_block = self.buf[start + len(TOOL_START):], True
                continue
            ready = self.buf[:len(self.buf) - _held(self.buf, TOOL_START)]
            ready = ready.rstrip()
            self._text(ready, out)
            self.buf = self.buf[len(ready):]
            return out

    def _close(self, body: str, out: Delta, closed: bool):
        call = self.parse(body, self.tools)
        self.in_block = False
        if call is None:                                    # not a call after all: the text stays content
            self._text(self.ws + TOOL_START + body + (TOOL_END if closed else ""), out)
        else:
            out.tool_calls.append(call)
            self.after_call = True

    def finish(self) -> Delta:
        out = Delta()
        if self.in_block:                                   # cut off inside a block (max_tokens, stop)
            self._close(self.buf, out, closed=False)
        elif not self.after_call:
            out.content = self.buf
        self.buf = ""
        return out


class JsonReplyStream:
    """llama3_json: a reply whose first non-blank character is "{" (or that starts with <|python_tag|>)
    is a tool call, held until the end and parsed whole; any other reply is content as it comes."""

    def __init__(self, tools=None):
        self.tools = tools
        self.buf = ""
        self.mode = "start"                                  # start -> call | content

    def feed(self, text: str) -> Delta:
        if self.mode == "content":
            return Delta(content=text)
        self.buf += text
        head = self.buf.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG)):
            return Delta()
        if head.startswith("{") or head.startswith(PYTHON_TAG):
            self.mode = "call"
            return Delta()
        self.mode, out, self.buf = "content", self.buf, ""
        return Delta(content=out)

    def finish(self) -> Delta:
        text, self.buf = self.buf, ""
        if self.mode != "call":
            return Delta(content=text)
        body = text.strip().removeprefix(PYTHON_TAG)
        whole = _parse_json_call(body, self.tools)
        if whole is not None:
            return Delta(tool_calls=[whole])
        calls = []
        for part in (p for p in body.split(";") if p.strip()):
            call = _parse_json_call(part, self.tools)
            if call is None:
                return Delta(content=text)
            calls.append(call)
        return Delta(tool_calls=calls)


class ReasoningStream:
    """Text in, (reasoning, content) out. `opened`: the prompt already opened the reasoning block
    (a template that ends the generation prompt with `<think>`), so output starts inside it."""

    def __init__(self, opened: bool = False):
        self.mode = "reasoning" if opened else "start"     # start -> reasoning -> content
        self.buf = ""
        self.lead = True                                    # content not yet begun: strip its leading newlines

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        if self.mode == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_START):
                self.mode, self.buf = "reasoning", head[len(THINK_START):]
            elif THINK_START.startswith(head):
                return out                                  # might still become <think>
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            end = self.buf.find(THINK_END)
            if end < 0:
                keep = _held(self.buf, THINK_END)
                out.reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out.reasoning, self.buf, self.mode = self.buf[:end], self.buf[end + len(THINK_END):], "content"
        if self.lead:
            self.buf = self.buf.lstrip("\n")
            self.lead = not self.buf
        out.content, self.buf = self.buf, ""
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self.mode == "reasoning":
            out.reasoning = self.buf
        else:
            out.content = self.buf.lstrip("\n") if self.lead else self.buf
        self.buf = ""
        return out


class OutputParser:
    """Reasoning split, then tool calls in the content: one per completion choice."""

    def __init__(self, tool_format: str = "none", tools=None, reasoning: str = "none", opened: bool = False,
                 prefix: str = ""):
        self.reasoning = ReasoningStream(opened) if reasoning != "none" else None
        self.tools = (JsonReplyStream(tools) if tool_format == "llama3_json" else ToolStream(tool_format, tools)) \
            if tool_format != "none" else None
        self.prefix = prefix                                # text the server put at the head of the reply

    def feed(self, text: str) -> Delta:
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        return self._chain(self.reasoning.feed(text) if self.reasoning else Delta(content=text))

    def finish(self) -> Delta:
        first = self.reasoning.finish() if self.reasoning else Delta()
        out = self._chain(first)
        if self.tools:
            tail = self.tools.finish()
            out.content += tail.content
            out.tool_calls += tail.tool_calls
        return out

    def _chain(self, d: Delta) -> Delta:
        if self.tools is None or not d.content:
            return d
        t = self.tools.feed(d.content)
        return Delta(content=t.content, reasoning=d.reasoning, tool_calls=t.tool_calls)

    def parse(self, text: str) -> Delta:
        """A whole output at once."""
        a, b = self.feed(text), self.finish()
        return Delta(a.content + b.content, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls)

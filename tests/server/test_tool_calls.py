"""Tool calls and reasoning through the HTTP server with the official `openai` client, streamed and
not, for the Qwen3 JSON and the Qwen3.5 / Qwen3-Coder XML formats (auto-detected from the
checkpoint's chat_template.jinja), tool_choice none / auto / required / a named function.

A random-weight model cannot be made to call a tool, so the server here runs over `ScriptedEngine`:
AsyncLLM's serving interface whose replies are scripted text, delivered a few characters per
delta (as the detokenizer would). Everything from the HTTP body to the SSE chunks is the real server."""
import asyncio
import json
import os
import shutil

import pytest
from conftest import serving

from atlas_jax.default_model import default_model_path
from atlas_jax.engine.client import FINISHED
from atlas_jax.engine.outputs import CompletionOutput, RequestOutput
from atlas_jax.frontend.tokenizer import Tokenizer

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
JSON_REPLY = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Oslo"}}\n</tool_call>')
XML_REPLY = ('The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n'
             '</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>')


class ScriptedEngine:
    """An EngineClient (engine/client.py) whose replies are scripted: each request's is the next text."""

    def __init__(self, model_path):
        self.model_path, self.tokenizer = model_path, Tokenizer.from_pretrained(model_path)
        self.max_model_len, self.vocab_size, self.num_pages, self.num_slots, self.loras = \
            4096, self.tokenizer.vocab_size, 1, 1, None
        self._stats = {"running": 0, "waiting": 0, "swapped": 0, "free_pages": 1, "free_slots": 1,
                       "num_failed_requests": 0, "num_compiles": 0, "warmup_pending": 0, "num_aborted": {}, "prefix_cache": None,
                       "spec": None}
        self.is_draining, self.is_running, self.is_ready, self.errored, self.num_in_flight = False, True, True, None, 0
        self.replies, self.prompts = [], []

    def stats(self):
        return self._stats

    async def offload(self, fn, *args):
        return fn(*args)

    def abort_nowait(self, request_id, reason="abort"):
        pass

    async def add_request_async(self, prompt, params, request_id=None, lora_request=None, client=None):
        self.prompts.append(prompt)
        text, queue = self.replies.pop(0), asyncio.Queue()
        prompt_ids = self.tokenizer.encode(prompt)
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            outs = [CompletionOutput(k, piece, [1], "stop" if last else None) for k in range(params.n)]
            scored = None if params.prompt_logprobs is None else [None] + [{t: -1.5} for t in prompt_ids[1:]]
            queue.put_nowait(RequestOutput(request_id, prompt, prompt_ids, outs, last, prompt_logprobs=scored))
        queue.put_nowait(FINISHED)
        return None, queue


def _checkpoint(tmp_path, template):
    shutil.copy(os.path.join(default_model_path(), "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    shutil.copy(os.path.join(TEMPLATES, template), tmp_path / "chat_template.jinja")
    return str(tmp_path)


@pytest.fixture(params=["qwen3.jinja", "qwen3_xml.jinja"])
def served(request, tmp_path):
    from openai import OpenAI

    from atlas_jax.server.app import build_app
    engine = ScriptedEngine(_checkpoint(tmp_path, request.param))
    app = build_app(engine, served_model_name="m")
    reply = JSON_REPLY if request.param == "qwen3.jinja" else XML_REPLY
    with serving(app) as port:
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x"), engine, app, reply


def _ask(client, stream, **kw):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=TOOLS, stream=stream, **kw)


def test_formats_detected_from_the_template(served):
    _, _, app, reply = served
    assert app.state.tool_format == ("qwen3_json" if reply is JSON_REPLY else "qwen3_xml")
    assert app.state.reasoning == "qwen3"


def test_tool_calls_whole(served):
    client, engine, _, reply = served
    engine.replies.append(reply)
    r = _ask(client, False)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert calls[0] == ("get_weather", {"city": "Paris", "days": 2})
    assert len(calls) == (2 if reply is JSON_REPLY else 1)
    assert msg.model_extra["reasoning_content"].strip() == "The user wants the weather."
    assert msg.content == ("Let me check." if reply is JSON_REPLY else None)
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)


def test_tool_calls_streamed(served):
    client, engine, _, reply = served
    engine.replies.append(reply)
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in _ask(client, True):
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert reasoning.strip() == "The user wants the weather."
    assert content == ("Let me check." if reply is JSON_REPLY else "")
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == ("get_weather", {"city": "Paris", "days": 2})
    assert sorted(calls) == list(range(2 if reply is JSON_REPLY else 1))


def test_tool_choice_none_parses_nothing_and_parallel_false_keeps_one(served):
    client, engine, _, reply = served
    engine.replies += [reply, reply]
    r = _ask(client, False, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    r = _ask(client, False, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def test_forced_tool_choice_writes_the_call_opening(served):
    """tool_choice "required" / a named function: the server writes the start of the call after the
    generation prompt (closing an opened <think> first); the model's text continues it."""
    client, engine, _, reply = served
    xml = reply is XML_REPLY
    engine.replies.append("<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
                          if xml else '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    r = _ask(client, False, tool_choice="required")
    assert engine.prompts[-1].endswith("</think>\n\n<tool_call>\n" if xml else "<tool_call>\n")
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}
    engine.replies.append("<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>" if xml
                          else '{"city": "Lima"}}\n</tool_call>')
    r = _ask(client, False, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.prompts[-1].endswith("<function=get_weather>\n" if xml else '"arguments": ')
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Lima"}


def test_bad_tool_choice_is_a_400_naming_the_field(served):
    import openai
    client, _, _, _ = served
    for choice in ({"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(openai.BadRequestError) as e:
            _ask(client, False, tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_usage_details_and_stop_reason(served):
    client, engine, _, reply = served
    engine.replies.append("Just text.")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "stop_reason" in r.choices[0].model_extra and r.choices[0].finish_reason == "stop"


def test_prompt_logprobs_in_both_apis(served):
    """vLLM's JSON form: null for the first prompt token, then {"token id": {logprob, decoded_token}}."""
    client, engine, _, _ = served
    engine.replies += ["x", "y"]
    r = client.completions.create(model="m", prompt="a b c", max_tokens=2, extra_body={"prompt_logprobs": 1})
    lp = r.choices[0].model_extra["prompt_logprobs"]
    ids = engine.tokenizer.encode("a b c")
    assert lp[0] is None and len(lp) == len(ids)
    assert lp[1] == {str(ids[1]): {"logprob": -1.5, "decoded_token": engine.tokenizer.decode([ids[1]])}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_logprobs": 0})
    assert r.model_extra["prompt_logprobs"][0] is None


def test_llama3_style_template_tool_calls(tmp_path):
    """A Llama-3-style checkpoint: the reply is a bare JSON call (llama3_json, detected from the template);
    streamed and whole through the openai client; a text reply stays content."""
    from openai import OpenAI

    from atlas_jax.server.app import build_app
    engine = ScriptedEngine(_checkpoint(tmp_path, "llama3.jinja"))
    app = build_app(engine, served_model_name="m")
    assert app.state.tool_format == "llama3_json" and app.state.reasoning == "none"
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    engine.replies += [call, call, "Sunny."]
    with serving(app) as port:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = _ask(client, False)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
        chunks = list(_ask(client, True))
        streamed = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [tc.function.name for tc in streamed] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        r = _ask(client, False)
        assert r.choices[0].message.content == "Sunny." and r.choices[0].message.tool_calls is None

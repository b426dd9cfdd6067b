"""Chat templates render as transformers' apply_chat_template renders them: the checkpoint's
chat_template.jinja, tokenizer_config's chat_template (string or named list), tools, tool-call round
trips, multi-turn reasoning, chat_template_kwargs (thinking off), continue_final_message — on
Qwen3-, Qwen3.5 / Qwen3-Coder XML-, Llama-3- and Gemma-style templates (tests/templates/). Same
text, same token ids."""
import json
import os
import shutil

import pytest

from atlas_jax.default_model import default_model_path
from atlas_jax.errors import InvalidRequestError
from atlas_jax.frontend.chat import ChatTemplate
from atlas_jax.frontend.tokenizer import Tokenizer

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHATS = {
    "simple": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    "multi_turn_reasoning": [{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                             {"role": "user", "content": "and 3+3?"}],
    "tool_round_trip": [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": None, "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
}
# The same round trip as vLLM hands it to templates: arguments parsed into a mapping (XML templates
# iterate them with `|items`).
CALL_OBJ = {**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris", "days": [1, 2]}}}
CHATS["tool_round_trip_object"] = [CHATS["tool_round_trip"][0], {"role": "assistant", "content": "Checking.",
                                                                 "tool_calls": [CALL_OBJ, CALL_OBJ]},
                                   CHATS["tool_round_trip"][2], CHATS["tool_round_trip"][2]]


def checkpoint(tmp_path, template_name, where, tokenizer_from=None):
    """A tokenizer directory as HF checkpoints have them (tokenizer.json of `tokenizer_from`, default the
    shipped model's); the template in chat_template.jinja, tokenizer_config's string, or its named list."""
    src = open(os.path.join(TEMPLATES, template_name)).read()
    shutil.copy(os.path.join(tokenizer_from or default_model_path(), "tokenizer.json"), tmp_path / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    if where == "jinja":
        (tmp_path / "chat_template.jinja").write_text(src)
    elif where == "string":
        cfg["chat_template"] = src
    else:
        cfg["chat_template"] = [{"name": "rag", "template": "{{ 'wrong' }}"}, {"name": "default", "template": src}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


CASES = [("qwen3.jinja", "jinja", chat, kw) for chat in CHATS for kw in ({}, {"enable_thinking": False})]
CASES += [("qwen3.jinja", "string", "tool_round_trip", {}), ("qwen3.jinja", "named", "simple", {}),
          ("llama3.jinja", "jinja", "simple", {}), ("llama3.jinja", "jinja", "tool_round_trip", {}),
          ("gemma.jinja", "jinja", "multi_turn_reasoning", {}), ("gemma.jinja", "named", "simple", {})]
CASES += [("qwen3_xml.jinja", "jinja", chat, kw) for chat in ("simple", "multi_turn_reasoning", "tool_round_trip_object")
          for kw in ({}, {"enable_thinking": False})]


@pytest.mark.parametrize("template,where,chat,kwargs", CASES)
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_equals_transformers(tmp_path, template, where, chat, kwargs, with_tools):
    from transformers import AutoTokenizer
    path = checkpoint(tmp_path, template, where)
    hf = AutoTokenizer.from_pretrained(path)
    tools = TOOLS if with_tools else None
    ref = hf.apply_chat_template(CHATS[chat], tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    ours = ChatTemplate.for_model(path).render(CHATS[chat], True, tools=tools, **kwargs)
    assert ours == ref
    assert Tokenizer.from_pretrained(path).encode(ours) == hf(ref, add_special_tokens=False)["input_ids"]


def test_continue_final_message_equals_transformers(tmp_path):
    from transformers import AutoTokenizer
    path = checkpoint(tmp_path, "qwen3.jinja", "jinja")
    chat = CHATS["simple"] + [{"role": "assistant", "content": "Hi! I am"}]
    ref = AutoTokenizer.from_pretrained(path).apply_chat_template(chat, continue_final_message=True, tokenize=False)
    assert ChatTemplate.for_model(path).render(chat, False, continue_final_message=True) == ref
    assert ref.endswith("Hi! I am")


def test_template_errors_are_client_errors(tmp_path):
    path = checkpoint(tmp_path, "gemma.jinja", "jinja")
    with pytest.raises(InvalidRequestError, match="alternate"):
        ChatTemplate.for_model(path).render([{"role": "assistant", "content": "x"}])


def test_chat_request_fields_reach_the_template(tmp_path, default_llm):
    """Over HTTP (in-process, on the shared engine): tools, chat_template_kwargs and the assistant's
    tool_calls / reasoning_content reach the template; the prompt equals transformers' token ids."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from atlas_jax.engine.async_llm import AsyncLLM
    from atlas_jax.server.app import build_app
    path = checkpoint(tmp_path, "qwen3.jinja", "jinja", tokenizer_from=default_llm.model_path)
    hf = AutoTokenizer.from_pretrained(path)
    engine = AsyncLLM.from_llm(default_llm)
    try:
        with TestClient(build_app(engine, served_model_name="tiny",
                                  chat_template=os.path.join(TEMPLATES, "qwen3.jinja"))) as c:
            for chat in CHATS.values():
                body = {"messages": chat, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
                ref = hf.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
                ids = hf(ref, add_special_tokens=False)["input_ids"]
                assert c.post("/tokenize", json=body).json()["tokens"] == ids
            chat = CHATS["multi_turn_reasoning"]        # short enough for the engine's max_model_len of 128
            ref = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, enable_thinking=False)
            body = {"messages": chat, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(hf(ref, add_special_tokens=False)["input_ids"])
            bad = c.post("/v1/chat/completions", json={"messages": CHATS["simple"], "chat_template_kwargs": {"tools": 1}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        engine.shutdown()


def test_xml_template_tool_round_trip_over_http(tmp_path, default_llm):
    """OpenAI clients send a tool call's arguments as a JSON string; the server hands the template a
    mapping (as vLLM does), so an XML template that iterates them renders what transformers renders
    from the parsed arguments."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from atlas_jax.engine.async_llm import AsyncLLM
    from atlas_jax.server.app import build_app
    path = checkpoint(tmp_path, "qwen3_xml.jinja", "jinja", tokenizer_from=default_llm.model_path)
    hf = AutoTokenizer.from_pretrained(path)
    sent = [CHATS["tool_round_trip"][0], {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": json.dumps(CALL_OBJ["function"]["arguments"])}}]},
        CHATS["tool_round_trip"][2]]
    parsed = [sent[0], {**sent[1], "tool_calls": [CALL_OBJ]}, sent[2]]
    ref = hf.apply_chat_template(parsed, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<parameter=days>\n[1, 2]\n</parameter>" in ref
    engine = AsyncLLM.from_llm(default_llm)
    try:
        with TestClient(build_app(engine, served_model_name="tiny",
                                  chat_template=os.path.join(TEMPLATES, "qwen3_xml.jinja"))) as c:
            r = c.post("/tokenize", json={"messages": sent, "tools": TOOLS})
            assert r.json()["tokens"] == hf(ref, add_special_tokens=False)["input_ids"]
    finally:
        engine.shutdown()


def test_llm_chat_renders_then_generates(default_llm):
    """LLM.chat (vLLM's offline chat): the checkpoint's template, one conversation or several; the same
    tokens as generate() on the rendered prompt."""
    from atlas_jax import SamplingParams
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    chats = [CHATS["simple"], CHATS["multi_turn_reasoning"]]
    rendered = [ChatTemplate.for_model(default_llm.model_path).render(c) for c in chats]
    one = default_llm.chat(chats[0], params)
    both = default_llm.chat(chats, params)
    ref = default_llm.generate(rendered, params)
    assert one[0].prompt == rendered[0] and len(both) == 2
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in ref]
    assert one[0].outputs[0].token_ids == ref[0].outputs[0].token_ids

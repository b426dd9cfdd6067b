"""Reasoning and tool-call parsers on scripted model outputs: whole, and streamed in every split of
the text into two deltas and character by character; a streamed result must equal the whole one and
never emit text it later takes back (a tag's first characters are held until decided)."""
import json
import os

import pytest

from atlas_jax.frontend.parsers import (OutputParser, resolve_reasoning_parser, resolve_tool_parser)

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "templates")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "zip": {"type": "string"}}}}}

# (tool format, reasoning, prompt opened <think>, output, expected content, reasoning, [(name, args)])
CASES = [
    ("qwen3_json", "none", False, "Hello there.", "Hello there.", "", []),
    ("qwen3_json", "none", False,
     'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "Let me check.", "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_json", "none", False,
     '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}'
     '\n</tool_call>', "", "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("qwen3_json", "none", False, '<tool_call>\n{"name": "a", "arguments": {"q": "<b>"}}',     # cut off: still parses
     "", "", [("a", {"q": "<b>"})]),
    ("qwen3_json", "none", False, "x <tool_call> not json </tool_call> y", "x <tool_call> not json </tool_call> y", "", []),
    ("qwen3_json", "none", False, "a < b and <tool", "a < b and <tool", "", []),
    ("qwen3_json", "qwen3", False,
     '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}\n</tool_call>', "", "\nThe user wants weather.\n", [("get_weather", {"city": "Oslo"})]),
    ("qwen3_json", "qwen3", True, "Plan: answer.\n</think>\n\nThe answer is 4.", "The answer is 4.", "Plan: answer.\n", []),
    ("qwen3_json", "qwen3", True, "still thinking when cut", "", "still thinking when cut", []),
    ("none", "qwen3", False, "<think></think>\n\nNo thoughts.", "No thoughts.", "", []),
    ("none", "qwen3", False, "Plain answer <think> inside", "Plain answer <think> inside", "", []),
    ("qwen3_xml", "none", False,
     "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n"
     "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=zip>\n"
     "01234\n</parameter>\n</function>\n</tool_call>", "Checking.", "",
     [("get_weather", {"city": "New York", "days": 5, "metric": True, "hours": [1, 2], "zip": "01234"})]),
    ("qwen3_xml", "qwen3", True,
     "ok\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nA\nB\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=other>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
     "", "ok\n", [("get_weather", {"city": "A\nB"}), ("other", {"n": 2})]),
    ("llama3_json", "none", False, '{"name": "get_weather", "parameters": {"city": "Paris; France"}}', "", "",
     [("get_weather", {"city": "Paris; France"})]),
    ("llama3_json", "none", False, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     "", "", [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "none", False, "Hello {not a call}", "Hello {not a call}", "", []),
    ("llama3_json", "none", False, "  {broken", "  {broken", "", []),
]


def _parser(fmt, reasoning, opened):
    return OutputParser(fmt, [WEATHER], reasoning, opened)


def _collect(parser, pieces):
    content, reasoning, calls = "", "", []
    for piece in list(pieces) + [None]:
        d = parser.finish() if piece is None else parser.feed(piece)
        content, reasoning, calls = content + d.content, reasoning + d.reasoning, calls + d.tool_calls
    return content, reasoning, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_whole_output(case):
    fmt, reasoning, opened, text, content, thought, calls = CASES[case]
    d = _parser(fmt, reasoning, opened).parse(text)
    assert (d.content, d.reasoning, [(c.name, json.loads(c.arguments)) for c in d.tool_calls]) == \
        (content, thought, calls)
    assert all(c.id.startswith("call_") for c in d.tool_calls)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_at_every_split_point(case):
    fmt, reasoning, opened, text, content, thought, calls = CASES[case]
    expected = (content, thought, calls)
    assert _collect(_parser(fmt, reasoning, opened), text) == expected              # one character at a time
    for cut in range(1, len(text)):
        assert _collect(_parser(fmt, reasoning, opened), [text[:cut], text[cut:]]) == expected, cut


def test_auto_detection_from_template():
    qwen3 = open(os.path.join(TEMPLATES, "qwen3.jinja")).read()
    assert resolve_tool_parser("auto", qwen3) == "qwen3_json"
    assert resolve_reasoning_parser("auto", qwen3) == "qwen3"
    xml = "{{ '<tool_call>\\n<function=' ~ name ~ '>\\n<parameter=' }}"
    assert resolve_tool_parser("auto", xml) == "qwen3_xml"
    assert resolve_tool_parser("auto", "{{ messages }}") == "none"
    llama3 = open(os.path.join(TEMPLATES, "llama3.jinja")).read()
    assert resolve_tool_parser("auto", llama3) == "llama3_json" and resolve_reasoning_parser("auto", llama3) == "none"
    assert resolve_tool_parser("hermes", "") == "qwen3_json" and resolve_tool_parser("qwen3_coder", "") == "qwen3_xml"
    with pytest.raises(ValueError, match="tool-call parser"):
        resolve_tool_parser("mistral", "")

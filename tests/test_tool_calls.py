"""Tool calls and the OpenAI mapping of structured outputs (structured/tool_calls.py, openai.py):
Hermes / Qwen `<tool_call>` blocks -> OpenAI tool_calls (whole text and streamed), the
"required" / named-function JSON that structured outputs enforce, response_format and vLLM's
extra fields -> StructuredOutputsParams, bad input -> ValueError naming the field; and, end to
end on the tiny model, tool_choice "required" and a named function always give calls whose
arguments parse against the function's parameters."""
import json
import random
import re

import pytest

from nanoinfer import SamplingParams, StructuredOutputsParams
from nanoinfer.structured.openai import (from_extra_fields, from_response_format, from_tools,
                                         structured_outputs_for_request, tools_schema)
from nanoinfer.structured.tool_calls import (HermesToolCallStream, parse_constrained_tool_calls,
                                             parse_hermes_tool_calls, parse_llama3_json_tool_calls)

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NO_PARAMS]


def check_call(call, names=("get_weather", "get_time", "ping")):
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    assert name in names and isinstance(args, dict)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and re.fullmatch(r"[A-Z][a-z]{1,8}", args["city"])
        assert args["unit"] in ("celsius", "fahrenheit")
    elif name == "get_time":
        assert args == {"zone": "UTC"} or args == {"zone": "CET"}
    return name, args


# ---- the Hermes / Qwen parser -------------------------------------------------------------------
def test_hermes_blocks_become_calls_and_the_rest_stays_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    parsed = parse_hermes_tool_calls(text)
    assert parsed.content == "Let me check."
    assert [check_call(c) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    only = parse_hermes_tool_calls('<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert only.content is None and only.tool_calls[0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("text", [
    "no calls here",
    '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',      # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',                                 # no name
    '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>',                # arguments not an object
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',             # never closed
])
def test_malformed_blocks_stay_content(text):
    parsed = parse_hermes_tool_calls(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_malformed_block_beside_a_good_one_and_unknown_names():
    bad = '<tool_call>{oops}</tool_call>'
    good = '<tool_call>{"name": "ping", "arguments": "{}"}</tool_call>'  # arguments as a JSON string
    parsed = parse_hermes_tool_calls(f"a {bad} b {good}")
    assert parsed.content == f"a {bad} b" and [c["function"]["name"] for c in parsed.tool_calls] == ["ping"]
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_hermes_tool_calls(unknown, tool_names={"ping"}).tool_calls == []


def test_streamed_parse_equals_the_whole_text():
    """Any split of the text into deltas: the content sent plus the calls equal the whole-text
    parse; no call's text leaks into the content (a malformed block goes out whole)."""
    text = ('Sure <b>bold</b> < tool <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
            ' then <tool_call>{bad}</tool_call> and <tool_call>{"name": "ping", "arguments": {}}</tool_call>'
            ' end <tool_')
    whole = parse_hermes_tool_calls(text)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 25)))
        stream, content, calls = HermesToolCallStream(), [], []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            sent, done = stream.feed(text[a:b])
            assert "<tool_call>" not in sent.replace("<tool_call>{bad}</tool_call>", "")  # (malformed: content)
            content.append(sent)
            calls += done
        content.append(stream.finish())
        assert [c["function"] for c in calls] == [c["function"] for c in whole.tool_calls]
        joined = "".join(content)
        assert re.sub(r"\s+", " ", joined).strip() == re.sub(r"\s+", " ", whole.content).strip()
        assert joined.endswith(" end <tool_")  # a partial tag at the end is content after all


def test_llama3_json_calls():
    text = ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
            '{"name": "ping", "arguments": {}}')
    parsed = parse_llama3_json_tool_calls(text)
    assert parsed.content is None
    assert [check_call(c) for c in parsed.tool_calls] == [("get_time", {"zone": "UTC"}), ("ping", {})]
    for content in ("It is sunny.", '{"name": "ping", "parameters": {}} and then', '{"no": "name"}', "{broken"):
        assert parse_llama3_json_tool_calls(content) == type(parsed)(content, [])


# ---- constrained tool calls (tool_choice "required" / named) --------------------------------------
def test_constrained_outputs_parse_into_calls():
    calls = parse_constrained_tool_calls(
        '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "ping", "parameters": {}}]', "required")
    assert [check_call(c) for c in calls] == [("get_time", {"zone": "UTC"}), ("ping", {})]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_call(parse_constrained_tool_calls('{"zone": "CET"}', named)[0]) == ("get_time", {"zone": "CET"})
    for text, choice in (('[{"name": "get_ti', "required"), ("[]", "required"), ("[1]", "required"),
                         ('"x"', named)):
        with pytest.raises(ValueError):
            parse_constrained_tool_calls(text, choice)


def test_tool_choice_schemas():
    assert tools_schema(TOOLS, "auto") is None and tools_schema(TOOLS, "none") is None
    assert tools_schema(TOOLS, None) is None and tools_schema(None, None) is None
    required = tools_schema(TOOLS, "required")
    assert required["type"] == "array" and required["minItems"] == 1
    assert [alt["properties"]["name"]["enum"] for alt in required["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"], ["ping"]]
    assert tools_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}}) == \
        WEATHER["function"]["parameters"]
    assert tools_schema([NO_PARAMS], {"type": "function", "function": {"name": "ping"}})["type"] == "object"
    assert isinstance(from_tools(TOOLS, "required"), StructuredOutputsParams)


@pytest.mark.parametrize("tools, choice, match", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS, {"type": "function"}, "tool_choice must be"),
    (None, "required", "needs a non-empty tools list"),
    ("get_weather", "auto", "tools must be a list"),
    ([{"type": "function", "function": {"description": "x"}}], "auto", r"tools\[0\].function.name"),
    ([{"type": "retrieval"}], "auto", r"tools\[0\]"),
    ([WEATHER, WEATHER], "auto", "defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", r"tools\[0\].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}], "required", "tools"),
])
def test_bad_tools_are_value_errors(tools, choice, match):
    with pytest.raises(ValueError, match=match):
        from_tools(tools, choice)


# ---- response_format and vLLM's extra fields ------------------------------------------------------
def test_response_format():
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert so.json == schema
    for bad, match in (({"type": "xml"}, "response_format.type"), ("json", "response_format must be"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
                        "response_format.json_schema.schema"),
                       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}},
                        "response_format.json_schema.schema")):
        with pytest.raises(ValueError, match=re.escape(match)):
            from_response_format(bad)


def test_extra_fields():
    assert from_extra_fields({}) is None
    assert from_extra_fields({"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}}) == \
        StructuredOutputsParams(regex="[a-z]+")
    assert from_extra_fields({"guided_choice": ["a", "b"]}) == StructuredOutputsParams(choice=["a", "b"])
    assert from_extra_fields({"guided_json": '{"type": "object"}'}).json == '{"type": "object"}'
    assert from_extra_fields({"guided_grammar": 'root ::= "x"'}).grammar == 'root ::= "x"'
    assert from_extra_fields({"guided_regex": "a+"}).regex == "a+"
    for body, match in (({"structured_outputs": {"regex": "a", "colour": 1}}, "unknown field"),
                        ({"structured_outputs": "a"}, "structured_outputs must be an object"),
                        ({"guided_regex": "a(", }, "guided_regex"),
                        ({"guided_regex": "a", "guided_choice": ["a"]}, "only one of"),
                        ({"structured_outputs": {}}, "exactly one")):
        with pytest.raises(ValueError, match=match):
            from_extra_fields(body)


def test_one_source_per_request():
    assert structured_outputs_for_request({"messages": []}) is None
    assert structured_outputs_for_request({"tools": TOOLS, "tool_choice": "auto"}) is None
    assert structured_outputs_for_request({"tools": TOOLS, "tool_choice": "required"}).json["type"] == "array"
    assert structured_outputs_for_request({"response_format": {"type": "json_object"}}).json_object
    with pytest.raises(ValueError, match="cannot both"):
        structured_outputs_for_request({"response_format": {"type": "json_object"}, "guided_regex": "a"})


# ---- end to end: the model's calls always parse ------------------------------------------------
def test_required_and_named_tool_choice_always_give_valid_calls(tiny_qwen3, make_llm):
    llm = make_llm(tiny_qwen3, kvcache_block_size=16, max_model_len=512)
    try:
        named = {"type": "function", "function": {"name": "get_weather"}}
        params = []
        for seed in range(6):
            for choice in ("required", named):
                schema = dict(from_tools(TOOLS, choice).json)
                if choice == "required":
                    schema["maxItems"] = 2  # a random model would otherwise go on calling up to max_tokens
                so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
                sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=150, structured_outputs=so)
                params.append((choice, sp))
        outs = llm.generate(["What is the weather in Paris?"] * len(params), [p for _, p in params], use_tqdm=False)
        for (choice, _), out in zip(params, outs):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            calls = parse_constrained_tool_calls(c.text, choice)
            names = [check_call(call)[0] for call in calls]
            if choice != "required":
                assert names == ["get_weather"]
    finally:
        llm.exit()

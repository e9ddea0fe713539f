"""Structured outputs and tool calls over HTTP (issue 25, parts 1-2), with the official openai client
against a real server process on the tiny random model: the mask makes even random weights write
valid output, for every response_format kind, vLLM's structured_outputs / guided_* fields, and
tool_choice "required" / a named function (whole and streamed); "auto" parses the model's own
<tool_call> blocks; bad schemas and tool definitions are 400s."""
import json
import re

import pytest

from test_server import NAME, Server

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Tell me about someone."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    srv = Server(tiny_qwen3, tmp_path_factory.mktemp("structured") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def check_person(text: str):
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "pet"} and re.fullmatch("[A-Z][a-z]{1,6}", obj["name"])
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and obj["pet"] in ("cat", "dog", "none")


def check_weather_args(arguments: str):
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and re.fullmatch("[A-Z][a-z]{1,8}", args["city"])
    assert args["unit"] in ("celsius", "fahrenheit")


def test_response_format_json_schema_and_json_object(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=400, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        check_person(out.choices[0].message.content)
    out = client.completions.create(model=NAME, prompt="A person:", max_tokens=400, temperature=1.0, seed=5,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "p", "schema": PERSON}}})
    assert out.choices[0].finish_reason == "stop"  # (random weights write a lot of whitespace)
    check_person(out.choices[0].text)
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=400, temperature=0.8, seed=1, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    check_person("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":  # (an unbounded object may run to max_tokens)
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_vllm_structured_outputs_fields(client):
    out = client.completions.create(model=NAME, prompt="Pick:", max_tokens=20, temperature=1.0, n=3, seed=2,
                                    extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert {c.text for c in out.choices} <= {"alpha", "beta", "gamma"}
    out = client.completions.create(model=NAME, prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.choices[0].text)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0,
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")


def test_bad_schemas_and_tools_are_400(client):
    bad = [dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
           dict(response_format={"type": "xml"}),
           dict(extra_body={"guided_regex": "(unclosed"}),
           dict(extra_body={"structured_outputs": {"json": {}, "regex": "a"}}),
           dict(tools=[{"type": "function", "function": {"parameters": {}}}], tool_choice="required"),
           dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tool_choice="required")]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, **kwargs)


def test_tool_choice_required_and_named(client):
    for seed in range(3):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=150, temperature=1.0,
                                             seed=seed, tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather",
                                                                                                   "get_time")
        if call.function.name == "get_weather":
            check_weather_args(call.function.arguments)
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=150, temperature=1.0,
                                             seed=seed, tools=[WEATHER, TIME],
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        check_weather_args(call.function.arguments)


def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=150, temperature=0.7, seed=4,
                                            tools=[WEATHER], stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    check_weather_args(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_auto_and_none(client):
    """"auto" leaves a reply with no <tool_call> block as content (a random model writes none);
    "none" keeps even a block as content. (The block parser itself: tests/test_tool_calls.py.)"""
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                             tools=[WEATHER], tool_choice=choice)
        msg = out.choices[0].message
        assert not msg.tool_calls and msg.content and out.choices[0].finish_reason in ("stop", "length")


def test_deep_or_huge_schema_is_a_400_and_the_server_keeps_serving(server, client):
    """Issue 50: a 1.4 KB request with an unknown key nested 600 levels deep in its schema once
    killed the pipe to the engine (pickling raised RecursionError). Every schema-bearing field is
    measured first: a 400 naming it and the flag, /health answers within a second throughout, and
    the server then returns the same greedy text as before."""
    import threading

    import httpx
    deep = []
    for _ in range(600):
        deep = [deep]
    junk = {"type": "object", "x-junk": deep}
    tool = {"type": "function", "function": {"name": "f", "parameters": junk}}
    attacks = [("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": junk}}}),
               ("/v1/completions", {"structured_outputs": {"json": junk}}),
               ("/v1/completions", {"guided_json": "[" * 5000 + "]" * 5000}),
               ("/v1/completions", {"guided_choice": [f"choice{i}" for i in range(60_000)]}),
               ("/v1/chat/completions", {"tools": [tool], "tool_choice": "required"}),
               ("/v1/chat/completions", {"tools": [tool]})]  # (auto: the template would render them)

    def greedy() -> str:
        return client.completions.create(model=NAME, prompt="A person:", max_tokens=8, temperature=0).choices[0].text

    before = greedy()
    replies, done = [], threading.Event()

    def attack():
        try:
            for path, fields in attacks * 2:
                body = {"model": NAME, "max_tokens": 4, **fields,
                        **({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})}
                replies.append(httpx.post(server.url + path, json=body, timeout=60))
        finally:
            done.set()

    thread = threading.Thread(target=attack)
    thread.start()
    while not done.is_set():
        assert httpx.get(server.url + "/health", timeout=1.0).status_code == 200
    thread.join()
    assert len(replies) == 2 * len(attacks)
    for reply in replies:
        assert reply.status_code == 400, reply.text
        message = reply.json()["error"]["message"]
        assert "nested more than 64 levels" in message or "larger than 131072 bytes" in message, message
    assert greedy() == before

"""Heavy intake work off the engine loop (issue 50, "Critical" and "High 2"), offline with the tiny
model: a schema nested too deep or too large is a ValueError before anything recurses into it (no
RecursionError, however deep); a grammar that compiles slowly leaves the other requests stepping
(the request waits in `preparing`, as vLLM's WAITING_FOR_FSM) and then matches; a compile that
fails finishes that request alone with finish_reason "error"; the compiled-grammar cache is bounded
in bytes; truncate_prompt_tokens=-1 keeps what can be admitted."""
import json
import threading
import time
import uuid
from types import SimpleNamespace

import pytest

from nanoinfer.structured.feature import StructuredFeature
from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.serve.limits import ServerLimits
from nanoinfer.structured import schema_limits
from nanoinfer.structured.compiler import ENTRY_OVERHEAD_BYTES, GrammarCache, StructuredCompiler
from nanoinfer.structured.openai import from_response_format, structured_outputs_for_request

pytest.importorskip("xgrammar")

PROMPT = "The quick brown fox"
PLAIN = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def nested(depth: int):
    x = []
    for _ in range(depth):
        x = [x]
    return x


def junk_schema(depth: int = 600) -> dict:
    """The issue's request: an unknown key nested deep inside a valid schema."""
    return {"type": "object", "x-junk": nested(depth)}


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128)
    yield engine
    engine.exit()


def unique_choices() -> list[str]:
    """A spec no earlier request compiled (the cache would serve it at once)."""
    tag = uuid.uuid4().hex[:6]
    return [f"alpha{tag}", f"beta{tag}"]


def run_until(llm, done):
    while not done():
        llm.step()


# ---- caps on a spec's depth and size ---------------------------------------------------------------
def test_deep_schema_is_refused_before_anything_recurses():
    for make in (lambda: StructuredOutputsParams(json=junk_schema()),
                 lambda: StructuredOutputsParams(json=json.dumps(junk_schema())),
                 lambda: StructuredOutputsParams(json='{"a":' + "[" * 50_000 + "]" * 50_000 + "}"),
                 lambda: StructuredOutputsParams(structural_tag={"type": "x", "f": nested(200)})):
        with pytest.raises(ValueError, match="nested more than 64 levels"):
            make()
    with pytest.raises(ValueError, match=r"response_format.json_schema.schema: .*nested more than 64"):
        from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": junk_schema()}})
    deep_array = {"type": "string"}
    for _ in range(500):
        deep_array = {"type": "array", "items": deep_array}
    with pytest.raises(ValueError, match="nested more than"):
        structured_outputs_for_request({"structured_outputs": {"json": deep_array}})
    tool = {"type": "function", "function": {"name": "f", "parameters": junk_schema(100)}}
    with pytest.raises(ValueError, match="tools: .*nested more than"):
        structured_outputs_for_request({"tools": [tool], "tool_choice": "required"})
    cyclic = {"type": "object"}
    cyclic["properties"] = {"self": cyclic}
    with pytest.raises(ValueError, match="nested more than"):
        StructuredOutputsParams(json=cyclic)
    StructuredOutputsParams(json=junk_schema(40))  # within the cap


def test_large_spec_is_refused_and_the_walk_stops_at_the_cap():
    with pytest.raises(ValueError, match=r"choice is larger than 131072 bytes"):
        StructuredOutputsParams(choice=[f"choice{i}" for i in range(60_000)])
    with pytest.raises(ValueError, match="regex is larger than"):
        StructuredOutputsParams(regex="a" * (200 << 10))
    limits = schema_limits.SchemaLimits(max_depth=8, max_bytes=1000)
    huge = list(range(5_000_000))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="larger than 1000 bytes"):
        limits.check_value("x", huge)
    early = time.perf_counter() - t0
    t0 = time.perf_counter()
    schema_limits.SchemaLimits(max_bytes=1 << 30).check_value("x", huge)  # the whole walk
    assert early * 20 < time.perf_counter() - t0  # stopped at the cap, not after the whole list
    with pytest.raises(ValueError, match="larger than"):
        limits.check_value("x", [10 ** 5000])  # (a huge int is not turned into text)


def test_caps_are_configurable_and_server_limits_check_every_schema_field():
    try:
        schema_limits.configure(max_depth=4, max_bytes=1 << 20)
        with pytest.raises(ValueError, match="nested more than 4"):
            StructuredOutputsParams(json={"a": {"b": {"c": {"d": {}}}}})
        schema_limits.configure(max_depth=1000)
        StructuredOutputsParams(json={"type": "object", "x": nested(300)})  # allowed when configured so
    finally:
        schema_limits.configure()
    limits = ServerLimits()
    body = SimpleNamespace(n=1, stop=None, stop_token_ids=None, logprobs=None,
                           response_format={"type": "json_schema", "json_schema": {"schema": junk_schema()}})
    with pytest.raises(ValueError, match=r"^response_format is nested more than 64"):
        limits.check(body)
    body.response_format, body.tools = None, [{"type": "function", "function": {"name": "f", "parameters": junk_schema()}}]
    with pytest.raises(ValueError, match="^tools is nested"):  # even with tool_choice auto: the template renders them
        limits.check(body)
    with pytest.raises(ValueError, match="max_schema_depth must be an int >= 1"):
        ServerLimits(max_schema_depth=0)


# ---- compiling off the engine loop -----------------------------------------------------------------
def test_slow_compile_leaves_the_batch_stepping(llm, monkeypatch):
    """The compile is held until the plain request has finished: the plain request ran all its steps
    meanwhile (nothing waited for the grammar), and its tokens equal the same request run alone."""
    alone = llm.generate(PROMPT, PLAIN, use_tqdm=False)[0].outputs[0].token_ids
    compiler = llm.feature(StructuredFeature)._grammar_intake().compiler
    gate, started, real = threading.Event(), threading.Event(), compiler.compile

    def slow_compile(params):
        started.set()
        assert gate.wait(120)
        return real(params)

    monkeypatch.setattr(compiler, "compile", slow_compile)
    choices = unique_choices()
    sp = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices))
    plain = llm.add_request(PROMPT, PLAIN, keep_output=True)
    held = llm.add_request(PROMPT, sp, keep_output=True)
    assert started.wait(60)
    run_until(llm, lambda: llm.get_output(plain).finished)
    assert llm.get_output(held).outputs[0].token_ids == [] and not llm.get_output(held).finished
    assert llm.pop_output(plain).outputs[0].token_ids == alone
    gate.set()
    run_until(llm, llm.is_finished)
    out = llm.pop_output(held).outputs[0]
    assert out.text in choices and out.finish_reason == "stop"
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_failed_compile_fails_that_request_only(llm, monkeypatch):
    compiler = llm.feature(StructuredFeature)._grammar_intake().compiler

    def failing_compile(params):
        raise ValueError("structured_outputs.choice could not be compiled: out of luck")

    monkeypatch.setattr(compiler, "compile", failing_compile)
    sp = SamplingParams(temperature=0, max_tokens=8, n=2,
                        structured_outputs=StructuredOutputsParams(choice=unique_choices()))
    outs = llm.generate([PROMPT, PROMPT], [PLAIN, sp], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == PLAIN.max_tokens
    assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
    assert "out of luck" in outs[1].outputs[0].stop_reason and outs[1].outputs[0].token_ids == []
    assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.scheduler.block_manager.num_blocks


def test_abort_while_compiling(llm, monkeypatch):
    compiler = llm.feature(StructuredFeature)._grammar_intake().compiler
    gate, real = threading.Event(), compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda params: gate.wait(120) and real(params))
    rid = llm.add_request(PROMPT, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=unique_choices())), keep_output=True)
    llm.abort_request(rid)
    assert llm.is_finished() and llm.pop_output(rid).outputs[0].finish_reason == "abort"
    gate.set()


def test_bad_spec_is_still_a_value_error_before_queueing(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        llm.generate([PROMPT, PROMPT], [PLAIN, SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))],
                     use_tqdm=False)
    assert llm.is_finished() and not llm.requests


# ---- the compiled-grammar cache, bounded in bytes --------------------------------------------------
def test_grammar_cache_is_bounded_in_bytes():
    cache = GrammarCache(max_bytes=3 * (1000 + ENTRY_OVERHEAD_BYTES))
    for key in "abc":
        cache.put(key, key.upper(), 1000)
    assert len(cache) == 3 and cache.get("a") == "A"  # (a is now the most recently used)
    cache.put("d", "D", 1000)
    assert cache.get("b") is None and cache.get("a") == "A" and len(cache) == 3
    cache.put("huge", "H", 10_000)  # larger than the whole cache: not kept, nothing dropped for it
    assert cache.get("huge") is None and len(cache) == 3 and cache.num_bytes <= cache.max_bytes


def test_compiler_cache_holds_at_most_its_bytes(llm):
    from nanoinfer.utils.hf_files import load_eos_token_ids
    one = llm.feature(StructuredFeature)._grammar_intake().compiler.compile(StructuredOutputsParams(choice=unique_choices()))
    budget = 3 * (one.memory_size_bytes + ENTRY_OVERHEAD_BYTES)
    compiler = StructuredCompiler(llm.tokenizer, llm.vocab_size, load_eos_token_ids(llm.config.model, llm.tokenizer),
                                  cache_bytes=budget)
    for _ in range(8):
        compiler.compile(StructuredOutputsParams(choice=unique_choices()))
        assert compiler.cache.num_bytes <= budget
    assert 1 <= len(compiler.cache) <= 4
    key = StructuredOutputsParams(json={"type": "object"}).cache_key()
    assert len(key[1]) == 32  # a digest, not the spec's text


# ---- truncate_prompt_tokens=-1 ---------------------------------------------------------------------
def test_truncate_minus_one_keeps_what_can_be_admitted(llm):
    long_prompt = [10 + i % 300 for i in range(400)]  # longer than max_model_len=128
    out = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-127:] and len(out.outputs[0].token_ids) == 1  # (max_model_len)
    prepared = llm.input_processor.process(long_prompt, SamplingParams(max_tokens=10, truncate_prompt_tokens=-1),
                                           max_tokens_must_fit=True)  # the server's rule: prompt + max_tokens fit
    assert prepared.seqs[0].token_ids == long_prompt[-118:]
    with pytest.raises(ValueError, match="max_tokens 200"):
        llm.input_processor.process(long_prompt, SamplingParams(max_tokens=200, truncate_prompt_tokens=-1),
                                    max_tokens_must_fit=True)

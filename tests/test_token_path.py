"""The path of an arriving token (LLMEngine._process): the scheduler appends it and decides EOS, stop
ids and length; the output processor detokenizes it and returns stop-string hits; the engine
finishes those. A scripted runner samples known tokens, so each rule is pinned exactly: a stop
string wins over a length limit reached by the same token, a stop token id wins over a stop
string, min_tokens gates stop strings, and finishes are reported in row order."""
import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.detokenizer import completion_text
from nanoinfer.step.step_message import StepResult
from nanoinfer.utils.hf_files import load_tokenizer

BS = 16
PROMPT = "Hello, my name is"
COMPLETION = " nano and I like to infer. The quick brown fox jumps over the lazy dog."


class ScriptedRunner:
    """Every sequence of prompt length `prompt_len` samples script[i] as its i-th completion token."""

    def __init__(self, num_blocks: int, prompt_len: int, script: list[int]):
        self.num_blocks, self.prompt_len, self.script = num_blocks, prompt_len, script

    def launch(self, step, sample, prev):
        # a row computes positions [start, start + q) and samples the token at start + q
        return StepResult([self.script[(start + q - self.prompt_len) % len(self.script)]
                           for start, q in zip(step.starts, step.query_lens)])

    def collect(self, handle):
        return handle

    def exit(self):
        pass


def scripted_llm(path, **options):
    llm = LLM(path, kvcache_block_size=BS, num_kvcache_blocks=32, **options)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    script = llm.tokenizer.encode(COMPLETION)
    llm.model_runner.exit()
    llm.model_runner = ScriptedRunner(llm.model_runner.num_blocks, len(prompt_ids), script)
    return llm, prompt_ids, script


@pytest.fixture(scope="module")
def scripted(tiny_qwen3):
    llm, prompt_ids, script = scripted_llm(tiny_qwen3, max_model_len=128)
    yield llm, prompt_ids, script
    llm.exit()


def texts(llm, prompt_ids, script):
    """The completion's text after each number of tokens: texts[k] after the first k."""
    return [completion_text(llm.tokenizer, prompt_ids, script[:k]) for k in range(len(script) + 1)]


def stop_completed_at(text_before: str, text_after: str) -> str:
    """A stop string that the text after a token contains and the text before it does not."""
    stop = text_after[-4:]
    assert stop and stop not in text_before
    return stop


def run(llm, params):
    return llm.generate([PROMPT] * len(params), params, use_tqdm=False)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_wins_over_max_tokens_reached_by_the_same_token(scripted, include):
    llm, prompt_ids, script = scripted
    t = texts(llm, prompt_ids, script)
    k = 5
    stop = stop_completed_at(t[k - 1], t[k])
    cut = t[k].index(stop) + (len(stop) if include else 0)
    at_limit, past_limit = run(llm, [SamplingParams(temperature=0, max_tokens=k, stop=[stop],
                                                    include_stop_str_in_output=include),
                                     SamplingParams(temperature=0, max_tokens=k - 1, stop=[stop])])
    c = at_limit.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("stop", stop, script[:k], t[k][:cut])
    c = past_limit.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("length", None, script[:k - 1], t[k - 1])
    assert llm.is_finished() and not llm.requests


def test_a_stop_string_wins_over_max_model_len_reached_by_the_same_token(tiny_qwen3):
    prompt_len = len(load_tokenizer(tiny_qwen3).encode(PROMPT))
    llm, prompt_ids, script = scripted_llm(tiny_qwen3, max_model_len=prompt_len + 6)
    try:
        t = texts(llm, prompt_ids, script)
        stop = stop_completed_at(t[5], t[6])
        c = run(llm, [SamplingParams(temperature=0, max_tokens=None, stop=[stop])])[0].outputs[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", stop, script[:6])
        c = run(llm, [SamplingParams(temperature=0, max_tokens=None, stop=["never there"])])[0].outputs[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("length", None, script[:6], t[6])
    finally:
        llm.exit()


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_wins_over_a_stop_string_it_completes(scripted, include):
    """The token both is a stop id and completes a stop string: the stop id is the reason. The text
    is cut at the stop string only when the token's text is kept (include_stop_str_in_output)."""
    llm, prompt_ids, script = scripted
    t = texts(llm, prompt_ids, script)
    k = 5
    assert script[k - 1] not in script[:k - 1]
    stop = stop_completed_at(t[k - 1], t[k])
    c = run(llm, [SamplingParams(temperature=0, max_tokens=20, stop=[stop], stop_token_ids=[script[k - 1]],
                                 include_stop_str_in_output=include)])[0].outputs[0]
    text = t[k][:t[k].index(stop) + len(stop)] if include else t[k - 1]
    assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("stop", script[k - 1], script[:k], text)


def test_min_tokens_gates_stop_strings(scripted):
    llm, prompt_ids, script = scripted
    t = texts(llm, prompt_ids, script)
    stop = stop_completed_at(t[2], t[3])
    assert t[8].find(stop, t[3].index(stop) + 1) == -1  # it does not come again
    gated, free = run(llm, [SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop=[stop]),
                            SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop=[stop])])
    assert (gated.outputs[0].finish_reason, gated.outputs[0].token_ids, gated.outputs[0].text) == \
        ("length", script[:8], t[8])
    assert (free.outputs[0].finish_reason, free.outputs[0].stop_reason, free.outputs[0].token_ids) == \
        ("stop", stop, script[:3])


def test_streamed_deltas_end_at_the_stop_string(scripted):
    llm, prompt_ids, script = scripted
    t = texts(llm, prompt_ids, script)
    stop = stop_completed_at(t[6], t[7])
    deltas = list(llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop])))
    assert "".join(d.text for d in deltas) == t[7][:t[7].index(stop)] == deltas[-1].output.outputs[0].text
    assert [token for d in deltas for token in d.token_ids] == script[:7]
    assert (deltas[-1].finished, deltas[-1].finish_reason, deltas[-1].stop_reason) == (True, "stop", stop)
    assert not any(d.finished for d in deltas[:-1])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_finishes_of_one_step_are_reported_in_row_order(tiny_qwen3, async_scheduling):
    """A stop-string finish (row 0) and a length finish (row 1) in the same step: step() reports
    them in row order, as the scheduler met them."""
    llm, prompt_ids, script = scripted_llm(tiny_qwen3, max_model_len=128, async_scheduling=async_scheduling)
    try:
        t = texts(llm, prompt_ids, script)
        stop = stop_completed_at(t[3], t[4])
        by_stop = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
        by_length = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4))
        reported = []
        while not llm.is_finished():
            reported += llm.step()[0]
        assert reported == [(by_stop, script[:4]), (by_length, script[:4])]
    finally:
        llm.exit()

"""LLM(model, data_parallel_size=2) (data_parallel/llm.py): generate and chat over two engine
processes equal one engine's results, in prompt order; bad input queues nothing anywhere; exit
ends every process."""
import pytest

from nanoinfer import LLM, SamplingParams

OPTIONS = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8)
PROMPTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache stores", "Once upon a time",
           [5, 6, 7, 8, 9], {"prompt": "Data parallel"}, "x", "The capital of France is"]


@pytest.fixture(scope="module")
def dp_llm(tiny_qwen3):
    llm = LLM(tiny_qwen3, data_parallel_size=2, **OPTIONS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def one(tiny_qwen3):
    llm = LLM(tiny_qwen3, data_parallel_size=1, **OPTIONS)
    yield llm
    llm.exit()


def results(outputs):
    return [(o.prompt, o.prompt_token_ids, [(c.text, c.token_ids, c.finish_reason) for c in o.outputs])
            for o in outputs]


def test_generate_equals_one_engine_in_prompt_order(dp_llm, one):
    # one class: an LLM whose generate() runs on two engine processes
    assert type(dp_llm) is LLM and dp_llm.data_parallel_size == 2 and one.data_parallel_size == 1
    greedy = SamplingParams(temperature=0, max_tokens=12)
    got = dp_llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert results(got) == results(one.generate(PROMPTS, greedy, use_tqdm=False))
    assert [o.request_id for o in got] == list(range(len(PROMPTS)))  # numbered across the engines
    # one SamplingParams per prompt (seeded samples, n > 1), and a length cut by max_model_len
    params = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=6 + i) for i in range(len(PROMPTS))]
    params[3] = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    got = dp_llm.generate(PROMPTS, params, use_tqdm=False)
    assert results(got) == results(one.generate(PROMPTS, params, use_tqdm=False))
    assert got[3].outputs[0].finish_reason == "length"
    assert dp_llm.generate([], greedy) == []
    with pytest.raises(NotImplementedError, match="one engine"):
        dp_llm.stream(PROMPTS)
    with pytest.raises(NotImplementedError, match="data_parallel_size=1"):
        dp_llm.add_request(PROMPTS[0])


def test_chat_and_progress(dp_llm, one):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert results(dp_llm.chat(conversations, greedy, use_tqdm=False)) == \
        results(one.chat(conversations, greedy, use_tqdm=False))
    updates = []

    class Bar:  # a tqdm-like factory, as LLM.generate takes
        def __init__(self, total, **_):
            assert total == len(PROMPTS)

        def update(self, n):
            updates.append(n)

        def close(self):
            pass

    dp_llm.generate(PROMPTS, greedy, use_tqdm=Bar)
    assert sum(updates) == len(PROMPTS)


def test_bad_input_queues_nothing_and_the_engines_go_on(dp_llm, one):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        dp_llm.generate(PROMPTS[:3], SamplingParams(temperature=-1))
    with pytest.raises(ValueError):  # the second engine's part is refused: the first one's is aborted
        dp_llm.generate(PROMPTS[:4] + [list(range(300))], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM("unused", data_parallel_size=0)
    assert results(dp_llm.generate(PROMPTS, greedy, use_tqdm=False)) == \
        results(one.generate(PROMPTS, greedy, use_tqdm=False))
    assert all(c.num_requests == 0 and not c._subs for c in dp_llm._replicas._clients)


def test_exit_ends_every_engine_process(tiny_qwen3):
    llm = LLM(tiny_qwen3, data_parallel_size=2, **OPTIONS)
    processes = [c.process for c in llm._replicas._clients]
    assert all(p.is_alive() for p in processes)
    llm.exit()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="exited"):
        llm.generate(PROMPTS[:1])
    llm.exit()  # twice: a no-op


def test_adapters_and_priorities_reach_each_engine(tiny_qwen3, tmp_path):
    """lora_request (one per prompt) and priority travel with each engine's share of the prompts:
    the results equal one engine's with the same arguments."""
    from lora_reference import make_adapter

    from nanoinfer import LoRARequest
    adapter = LoRARequest("a", 1, make_adapter(tiny_qwen3, str(tmp_path / "a")))
    options = dict(OPTIONS, enable_lora=True, scheduling_policy="priority")
    prompts = PROMPTS[:4]
    loras, priorities = [adapter, None, adapter, None], [3, 1, 0, 2]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    single = LLM(tiny_qwen3, **options)
    try:
        want = results(single.generate(prompts, greedy, use_tqdm=False, lora_request=loras, priority=priorities))
        assert want != results(single.generate(prompts, greedy, use_tqdm=False))  # the adapter changes tokens
    finally:
        single.exit()
    dp = LLM(tiny_qwen3, data_parallel_size=2, **options)
    try:
        assert results(dp.generate(prompts, greedy, use_tqdm=False, lora_request=loras, priority=priorities)) == want
        with pytest.raises(ValueError, match="priority"):
            dp.generate(prompts, greedy, use_tqdm=False, priority=[1, 2])
    finally:
        dp.exit()

"""Multi-LoRA through the engine (nanoinfer/lora), against HF + PEFT teacher-forced in float32:
one batch mixing the base model and several adapters (overlap on and off), more adapters than
device slots (slots and the host cache reused, never more adapters in a step than slots), the
prefix cache keyed by adapter, preemption, tensor parallelism on CPU, add_request / chat / stream."""
import pytest

from nanoinfer.lora.feature import LoRARankFeature
from nanoinfer.lora.feature import LoRAFeature
from nanoinfer import LLM, LoRARequest, SamplingParams

from lora_reference import ALL_TARGETS, assert_greedy_matches, differs_from, make_adapter

BS = 16
OPTIONS = dict(kvcache_block_size=BS, max_model_len=128, num_kvcache_blocks=64)
PROMPTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache stores", "Once upon a time",
           "Tensor parallelism splits", "what is the capital of France?"]
# (target modules, rank, alpha, rsLoRA): every projection, subsets, another rank, rsLoRA
SPECS = [(ALL_TARGETS, 8, 16, False), (["q_proj", "v_proj", "down_proj"], 4, 8, True),
         (["k_proj", "o_proj", "gate_proj", "up_proj"], 8, 4, False), (["up_proj", "q_proj"], 2, 6, False)]


def greedy(max_tokens=10):
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def base(make_checkpoint):
    return make_checkpoint()


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """LoRARequests of four adapters of the tiny base, ids 1..4."""
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(f"ad{i + 1}", i + 1, make_adapter(base, str(root / f"ad{i + 1}"), targets, r, alpha,
                                                           seed=i + 1, use_rslora=rs))
            for i, (targets, r, alpha, rs) in enumerate(SPECS)]


def check_outputs(base, outs, loras):
    for out, lora in zip(outs, loras):
        path = None if lora is None else lora.lora_path
        completion = out.outputs[0].token_ids
        assert_greedy_matches(base, path, out.prompt_token_ids, completion)


def record_steps(llm) -> list[set]:
    """Each launched step's set of adapter ids (0: the base model), recorded from now on."""
    steps, assign = [], llm.feature(LoRAFeature).slots.assign

    def spy(seqs):
        steps.append({s.lora_int_id for s in seqs})
        return assign(seqs)
    llm.feature(LoRAFeature).slots.assign = spy
    return steps


def assert_clean(llm):
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == bm.num_blocks and not llm.requests


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_one_batch_mixes_the_base_and_adapters(base, adapters, overlap):
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, async_scheduling=overlap, **OPTIONS)
    try:
        steps = record_steps(llm)
        loras = [None, adapters[0], adapters[1], adapters[2], adapters[0], None]
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=loras)
        check_outputs(base, outs, loras)
        assert {0, 1, 2, 3} in steps, "the base and three adapters ran in one step"
        for out, lora in zip(outs, loras):  # matching PEFT proves each adapter applied only where it changes tokens
            if lora is not None:
                assert differs_from(base, lora.lora_path, out.prompt_token_ids, out.outputs[0].token_ids)
        assert_clean(llm)
    finally:
        llm.exit()


def test_more_adapters_than_slots_reuses_slots_exactly(base, adapters):
    llm = LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8, max_num_seqs=4, **OPTIONS)
    try:
        steps = record_steps(llm)
        loras = [adapters[i % 4] for i in range(6)] + [None, adapters[3], adapters[0]]
        prompts = PROMPTS + PROMPTS[:3]
        outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
        check_outputs(base, outs, loras)
        assert max(len(s - {0}) for s in steps) == 2, "never more adapters in a step than slots"
        assert llm.model_runner.feature(LoRARankFeature).adapters.num_loads > 4, "slots were reused by other adapters"
        assert len(llm.model_runner.feature(LoRARankFeature).adapters.host) == 2, "the host cache holds max_cpu_loras adapters"
        assert_clean(llm)
    finally:
        llm.exit()


def test_prefix_cache_is_keyed_by_adapter(base, adapters):
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **OPTIONS)
    try:
        prompt = " ".join(PROMPTS)  # several full blocks
        runs = [adapters[0], adapters[1], adapters[0], None, None]
        cached = []
        for lora in runs:
            out = llm.generate(prompt, greedy(4), use_tqdm=False, lora_request=lora)[0]
            check_outputs(base, [out], [lora])
            cached.append(out.num_cached_tokens)
        assert cached[0] == cached[1] == cached[3] == 0, cached
        assert cached[2] > 0 and cached[4] > 0, cached
        assert_clean(llm)
    finally:
        llm.exit()


def test_preemption_keeps_adapter_results_exact(base, adapters):
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, kvcache_block_size=BS, max_model_len=128,
              num_kvcache_blocks=8)
    try:
        loras = [adapters[0], None, adapters[1], adapters[0]]
        outs = llm.generate(PROMPTS[:4], greedy(40), use_tqdm=False, lora_request=loras)
        assert llm.scheduler.num_preemptions > 0
        check_outputs(base, outs, loras)
        assert_clean(llm)
    finally:
        llm.exit()


def test_add_request_chat_and_stream_take_an_adapter(base, adapters):
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **OPTIONS)
    try:
        rid = llm.add_request(PROMPTS[0], greedy(), keep_output=True, lora_request=adapters[1])
        while not llm.is_finished():
            llm.step()
        by_hand = llm.pop_output(rid)
        check_outputs(base, [by_hand], [adapters[1]])
        streamed = [d.token_ids for d in llm.stream(PROMPTS[0], greedy(), lora_request=adapters[1])]
        assert sum(streamed, []) == by_hand.outputs[0].token_ids
        two = llm.generate(" ".join(PROMPTS), SamplingParams(n=2, temperature=0, ignore_eos=True, max_tokens=6),
                           use_tqdm=False, lora_request=adapters[2])[0]  # the samples share the prompt's blocks
        for completion in two.outputs:
            assert_greedy_matches(base, adapters[2].lora_path, two.prompt_token_ids, completion.token_ids)
        conversation = [{"role": "user", "content": "Hello"}]
        chat = llm.chat(conversation, greedy(), use_tqdm=False, lora_request=adapters[0])[0]
        check_outputs(base, [chat], [adapters[0]])
        assert_clean(llm)
    finally:
        llm.exit()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_other_architectures(make_checkpoint, tmp_path, arch):
    """Qwen2 (q/k/v biases: the adapter adds to the biased product) and Llama."""
    path = make_checkpoint(arch=arch)
    loras = [LoRARequest("a", 1, make_adapter(path, str(tmp_path / "a"), r=4, seed=7)), None,
             LoRARequest("b", 2, make_adapter(path, str(tmp_path / "b"), ["v_proj", "up_proj"], r=8, seed=8))]
    llm = LLM(path, enable_lora=True, max_loras=2, max_lora_rank=8, **OPTIONS)
    try:
        check_outputs(path, llm.generate(PROMPTS[:3], greedy(), use_tqdm=False, lora_request=loras), loras)
    finally:
        llm.exit()


def test_tensor_parallel_adapters_match_peft(base, adapters):
    """A cut like the input features, B like the output features, on each of two ranks."""
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2, **OPTIONS)
    try:
        loras = [adapters[0], None, adapters[1], adapters[2], adapters[0]]
        outs = llm.generate(PROMPTS[:5], greedy(), use_tqdm=False, lora_request=loras)
        check_outputs(base, outs, loras)
        assert_clean(llm)
    finally:
        llm.exit()


def test_tensor_parallel_with_replicated_kv_heads(make_checkpoint, tmp_path):
    """One KV head, two ranks: each rank keeps the whole k/v projection, and its adapter's B."""
    path = make_checkpoint(num_kv_heads=1)
    loras = [LoRARequest("kv", 1, make_adapter(path, str(tmp_path / "kv"), ["k_proj", "v_proj", "o_proj"], r=8)),
             None]
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, tensor_parallel_size=2, **OPTIONS)
    try:
        outs = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False, lora_request=loras)
        check_outputs(path, outs, loras)
        assert_clean(llm)
    finally:
        llm.exit()


# ---- on a CUDA GPU: the adapters' slots in the graphs' static buffers ---------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("max_loras", [4, 2], ids=["all-in-slots", "slots-reused"])
def test_cuda_graphs_mix_adapters_like_peft(base, adapters, max_loras):
    llm = LLM(base, enable_lora=True, max_loras=max_loras, max_lora_rank=8, dtype="float32",
              kvcache_block_size=BS, max_model_len=256, num_kvcache_blocks=256, max_num_seqs=16)
    try:
        info = llm.model_runner.info()
        assert info["cuda_graphs"], "decode steps replay CUDA graphs"
        loras = [None, *adapters, adapters[0], None, adapters[2]]
        prompts = (PROMPTS * 2)[:len(loras)]
        outs = llm.generate(prompts, greedy(24), use_tqdm=False, lora_request=loras)
        for out, lora in zip(outs, loras):
            assert_greedy_matches(base, None if lora is None else lora.lora_path, out.prompt_token_ids,
                                  out.outputs[0].token_ids, tol=1e-3)  # fp32 on the GPU: its reduction order
        assert_clean(llm)
    finally:
        llm.exit()


def test_adapter_files_gone_or_broken_since_first_use_are_refused_at_intake(base, adapters, tmp_path):
    """The ranks re-read an adapter evicted from their host cache inside a step, where a failed read
    fails the engine (the server's engine process: every client). Intake notices the files changed
    since it read them and checks them again: a 400-style ValueError, nothing queued."""
    import shutil
    path = str(tmp_path / "copy")
    shutil.copytree(adapters[0].lora_path, path)
    mine, other = LoRARequest("mine", 11, path), adapters[1]
    llm = LLM(base, device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8, **OPTIONS)
    try:
        for lora in (mine, other):  # `other` evicts `mine` from the slot and the host cache
            llm.generate(PROMPTS[:1], greedy(3), lora_request=lora, use_tqdm=False)
        with open(f"{path}/adapter_model.safetensors", "wb") as f:
            f.write(b"not safetensors")
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            llm.add_request(PROMPTS[0], greedy(3), lora_request=mine)
        shutil.rmtree(path)
        with pytest.raises(ValueError, match="not a directory"):
            llm.add_request(PROMPTS[0], greedy(3), lora_request=mine)
        assert_clean(llm)
        out = llm.generate(PROMPTS[:1], greedy(3), lora_request=other, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.exit()

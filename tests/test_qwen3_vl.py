"""Qwen3-VL through the engine (CPU, float32): interleaved M-RoPE, the learned position embedding
resampled to each image's grid, DeepStack features added to the first layers; greedy tokens are
HF's teacher-forced argmax, with chunked prefill through images, mixed batches and tp=2."""
import pytest

from nanoinfer import LLM, SamplingParams
from vl_reference import assert_vl_greedy_matches_hf, random_image

P = "<|vision_start|><|image_pad|><|vision_end|>"
CASES = [
    (f"Describe {P} please.", [(100, 70)]),
    ("Hello, my name is", []),
    (f"A {P} and {P} compared.", [(60, 130), (96, 96)]),
    (f"Big {P}.", [(300, 200)]),
]


@pytest.fixture(scope="module")
def q3vl(make_vl_checkpoint):
    return make_vl_checkpoint(arch="qwen3_vl")


def requests():
    return [{"prompt": p, "multi_modal_data": {"image": images(i, s)}} if s else p for i, (p, s) in enumerate(CASES)]


def images(i, sizes):
    return [random_image(w, h, seed=30 + 10 * i + j) for j, (w, h) in enumerate(sizes)]


@pytest.mark.parametrize("budget", [16384, 16])  # 16: chunked prefill through the images
def test_matches_hf(q3vl, budget):
    llm = LLM(q3vl, device="cpu", kvcache_block_size=16, max_model_len=512, max_num_batched_tokens=budget)
    try:
        outs = llm.generate(requests(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for i, ((prompt, sizes), out) in enumerate(zip(CASES, outs)):
            assert_vl_greedy_matches_hf(q3vl, prompt, images(i, sizes), out.prompt_token_ids,
                                        out.outputs[0].token_ids)
    finally:
        llm.exit()


@pytest.mark.timeout(300)
def test_tp2_matches_tp1(q3vl):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(q3vl, device="cpu", kvcache_block_size=16, max_model_len=512)
    expected = [o.outputs[0].token_ids for o in llm.generate(requests(), sp, use_tqdm=False)]
    llm.exit()
    llm = LLM(q3vl, device="cpu", kvcache_block_size=16, max_model_len=512, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(requests(), sp, use_tqdm=False)] == expected
    finally:
        llm.exit()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_profile_encoder_covers_a_step(make_vl_checkpoint, arch):
    """The memory-profiling pass (CUDA) runs the tower on images making a step's tokens."""
    llm = LLM(make_vl_checkpoint(**({"arch": arch} if arch == "qwen3_vl" else {})), device="cpu",
              kvcache_block_size=16, max_model_len=512)
    try:
        model, seen = llm.model_runner.model, []
        real = model.encode_images
        model.encode_images = lambda pixels, grids: seen.append(grids) or real(pixels, grids)
        model.profile_encoder(600)
        (grids,) = seen
        assert sum(t * h * w for t, h, w in grids) // 4 == 600 and max(h for _, h, _ in grids) <= 32
    finally:
        llm.exit()

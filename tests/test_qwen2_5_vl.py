"""Qwen2.5-VL through the engine (CPU, float32): greedy tokens are HF's teacher-forced argmax with
pixel_values and image_grid_thw, for images of several sizes and aspect ratios, two images in a
prompt, batches mixing image and text-only requests, chunked prefill through an image, preemption,
the image-keyed prefix cache, and tensor parallelism."""
import pytest

from nanoinfer.multimodal.feature import ImageRankFeature
from nanoinfer.multimodal.feature import ImageFeature
from nanoinfer.multimodal.step_planner import IMAGES
from nanoinfer import LLM, SamplingParams
from vl_reference import assert_vl_greedy_matches_hf, random_image

P = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vl(make_vl_checkpoint):
    return make_vl_checkpoint()


def engine(path, **options):
    return LLM(path, **{"device": "cpu", "kvcache_block_size": 16, "max_model_len": 512, **options})


def run(llm, requests, sp=GREEDY):
    return llm.generate(requests, sp, use_tqdm=False)


def request(prompt, images):
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt


CASES = [  # (prompt, image sizes (width, height)) ; several sizes and aspect ratios, text-only mixed in
    (f"Describe {P} please.", [(70, 120)]),
    (f"{P} what is it?", [(200, 56)]),
    ("Hello, my name is", []),
    (f"Look: {P}", [(30, 30)]),          # below min_pixels: scaled up
    (f"A {P} and {P} compared.", [(90, 60), (56, 140)]),  # two images in one prompt
    ("The quick brown fox", []),
    (f"Big {P}.", [(300, 260)]),         # above max_pixels: scaled down
]


def case_images(i, sizes):
    return [random_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)]


def test_batch_matches_hf(vl):
    llm = engine(vl)
    try:
        requests = [request(p, case_images(i, s)) for i, (p, s) in enumerate(CASES)]
        outs = run(llm, requests)
        for i, ((prompt, sizes), out) in enumerate(zip(CASES, outs)):
            assert_vl_greedy_matches_hf(vl, prompt, case_images(i, sizes), out.prompt_token_ids,
                                        out.outputs[0].token_ids)
        assert not llm.feature(ImageFeature).planner.resident  # every image's embeddings were dropped
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)  # a step after: the runner's too
        assert not llm.model_runner.feature(ImageRankFeature).cache.embeddings
    finally:
        llm.exit()


def test_chunked_prefill_through_image(vl):
    """A 16-token budget splits the prompt inside its image (several chunks cover it); the image is
    encoded once."""
    llm = engine(vl, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        prompt, image = f"Describe {P} please.", random_image(280, 224, seed=3)
        encoded = []
        real = llm.model_runner.feature(ImageRankFeature).cache.model.encode_images

        def counting(pixels, grids):
            encoded.append(len(grids))
            return real(pixels, grids)
        llm.model_runner.feature(ImageRankFeature).cache.model.encode_images = counting
        out = run(llm, request(prompt, [image]))[0]
        assert out.prompt_token_ids.count(llm.config.hf_config.image_token_id) > 32
        assert encoded == [1]
        assert_vl_greedy_matches_hf(vl, prompt, [image], out.prompt_token_ids, out.outputs[0].token_ids)
    finally:
        llm.exit()


def test_different_images_never_share_cache(vl):
    """The same prompt with two different images: each output (tokens and logprobs) equals its solo
    run, though their token ids are equal; the same image again is served by the prefix cache."""
    prompt = f"{P} tell me about this picture in detail."
    a, b = random_image(112, 112, seed=1), random_image(112, 112, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)

    def result(out):
        c = out.outputs[0]
        return c.token_ids, [round(lp[t].logprob, 4) for t, lp in zip(c.token_ids, c.logprobs)]

    solo = {}
    for name, image in (("a", a), ("b", b)):
        llm = engine(vl)
        solo[name] = result(run(llm, request(prompt, [image]), sp)[0])
        llm.exit()
    assert solo["a"] != solo["b"]  # else the test could not tell shared blocks apart
    llm = engine(vl)
    try:
        first = run(llm, request(prompt, [a]), sp)[0]
        second = run(llm, request(prompt, [b]), sp)[0]
        assert first.prompt_token_ids == second.prompt_token_ids
        assert second.num_cached_tokens == 0
        assert (result(first), result(second)) == (solo["a"], solo["b"])
        again = run(llm, request(prompt, [a]), sp)[0]
        assert again.num_cached_tokens > 0 and result(again) == solo["a"]
        both = run(llm, [request(prompt, [b]), request(prompt, [a])], sp)
        assert [result(o) for o in both] == [solo["b"], solo["a"]]
    finally:
        llm.exit()


def test_preemption_recomputes_images(vl):
    """A pool too small for every request at once: sequences are preempted and recompute their
    images; every output equals its solo run."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [(f"{P} number {i}", random_image(84 + 14 * i, 84, seed=20 + i)) for i in range(4)]
    solo_llm = engine(vl)
    solo = [run(solo_llm, request(p, [im]), sp)[0].outputs[0].token_ids for p, im in prompts]
    solo_llm.exit()
    llm = engine(vl, num_kvcache_blocks=12, max_model_len=128)
    try:
        outs = run(llm, [request(p, [im]) for p, im in prompts], sp)
        assert llm.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == solo
    finally:
        llm.exit()


def test_mm_processor_kwargs_reach_the_processor(vl):
    llm = engine(vl)
    try:
        prompt, image = f"{P} what?", random_image(140, 140, seed=5)
        kwargs = {"max_pixels": 16 * 28 * 28}
        out = run(llm, {"prompt": prompt, "multi_modal_data": {"image": image}, "mm_processor_kwargs": kwargs})[0]
        default = run(llm, request(prompt, [image]))[0]
        pad = llm.config.hf_config.image_token_id
        assert out.prompt_token_ids.count(pad) < default.prompt_token_ids.count(pad)
        assert_vl_greedy_matches_hf(vl, prompt, [image], out.prompt_token_ids, out.outputs[0].token_ids,
                                    processor_kwargs={"size": {"shortest_edge": 4 * 28 * 28,
                                                               "longest_edge": 16 * 28 * 28}})
    finally:
        llm.exit()


@pytest.mark.timeout(300)
def test_tp2_matches_tp1(vl):
    """The vision tower replicated on both ranks, the language model sharded."""
    requests = [request(p, case_images(i, s)) for i, (p, s) in enumerate(CASES[:5])]
    llm = engine(vl)
    expected = [o.outputs[0].token_ids for o in run(llm, requests)]
    llm.exit()
    llm = engine(vl, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in run(llm, requests)] == expected
    finally:
        llm.exit()


def intake_done(llm, rid):
    """Wait for the request's images to be preprocessed (in an intake thread): its first step is then
    the next one."""
    intake = llm.requests[rid].seqs[0].intake
    if intake is not None:
        intake.result()


def test_abort_mid_image_drops_its_embeddings(vl):
    """An aborted request whose prefill stopped inside its image: the runner drops the embeddings at
    the next step, and every block is free."""
    llm = engine(vl, max_num_batched_tokens=16)
    try:
        rid = llm.add_request(request(f"Describe {P}.", [random_image(280, 224, seed=6)]), GREEDY)
        intake_done(llm, rid)
        llm.step()  # the first chunk reaches into the image: it is encoded
        assert len(llm.model_runner.feature(ImageRankFeature).cache.embeddings) == 1
        llm.abort_request(rid)
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.model_runner.feature(ImageRankFeature).cache.embeddings and not llm.feature(ImageFeature).planner.resident
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.exit()


@pytest.mark.cuda
def test_cuda_float32_graphs_match_hf(vl, make_llm):
    """On the GPU: the Triton (or flash-attn) backend, decode CUDA graphs, mixed-step graphs for text
    chunks, eager steps with image tokens (their [3, N] positions through the fused qkv epilogue),
    chunked prefill through images; float32, against HF on the CPU."""
    llm = make_llm(vl, dtype="float32", kvcache_block_size=16, max_model_len=512, max_num_batched_tokens=64,
                   max_num_seqs=8)
    try:
        assert llm.model_runner.info()["cuda_graphs"]
        requests = [request(p, case_images(i, s)) for i, (p, s) in enumerate(CASES)]
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i, ((prompt, sizes), out) in enumerate(zip(CASES, run(llm, requests, sp))):
            assert_vl_greedy_matches_hf(vl, prompt, case_images(i, sizes), out.prompt_token_ids,
                                        out.outputs[0].token_ids, tol=1e-3)
    finally:
        llm.exit()


@pytest.mark.cuda
def test_cuda_bfloat16_runs(vl, make_llm):
    """bf16 (the model's dtype on GPUs): the vision tower and the language model run, and the image's
    tokens change the output."""
    llm = make_llm(vl, dtype="bfloat16", kvcache_block_size=16, max_model_len=512)
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
        a, b = (run(llm, request(f"{P} what?", [random_image(112, 112, seed=s)]), sp)[0] for s in (1, 2))
        assert len(a.outputs[0].token_ids) == 8
        assert a.outputs[0].cumulative_logprob != b.outputs[0].cumulative_logprob
    finally:
        llm.exit()


def test_failed_launch_forgets_its_images(vl):
    """A step that asked the runner to encode an image fails to launch (its prefill chunk ends
    inside the image, so the image stays needed): the image is sent again with the retried step,
    and the output equals a clean run's."""
    req = request(f"Describe {P} please.", [random_image(280, 224, seed=11)])
    clean = engine(vl)
    want = run(clean, req)[0].outputs[0].token_ids
    clean.exit()
    llm = engine(vl, max_num_batched_tokens=16)
    try:
        real, failed = llm.model_runner.launch, []

        def failing_once(step, sample, prev):
            if step.part(IMAGES) is not None and step.part(IMAGES).encode and not failed:
                failed.append(True)
                raise RuntimeError("injected launch failure")
            return real(step, sample, prev)
        llm.model_runner.launch = failing_once
        intake_done(llm, llm.add_request(req, GREEDY))
        with pytest.raises(RuntimeError, match="injected"):
            llm.step()
        pairs = []
        while not llm.is_finished():
            pairs += llm.step()[0]
        assert [tokens for _, tokens in pairs] == [want]
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.model_runner.feature(ImageRankFeature).cache.embeddings and not llm.feature(ImageFeature).planner.resident
    finally:
        llm.exit()


def test_prompt_logprobs_and_samples(vl):
    """prompt_logprobs at every prompt position (image tokens included) equal HF's; n = 2 greedy
    samples equal the solo greedy output."""
    from vl_reference import hf_prompt_logprobs
    prompt, image = f"See {P} and say.", random_image(112, 84, seed=13)
    llm = engine(vl)
    try:
        out = run(llm, request(prompt, [image]), SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0))[0]
        ours = [lp[t].logprob for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
        theirs = hf_prompt_logprobs(vl, prompt, [image], out.prompt_token_ids)
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
        solo = out.outputs[0].token_ids
        two = run(llm, request(prompt, [image]), SamplingParams(temperature=0, max_tokens=3, n=2))[0]
        assert [c.token_ids for c in two.outputs] == [solo, solo]
    finally:
        llm.exit()

"""Batch-invariant mode (nanoinfer/batch_invariant) on CPU (device="cpu" on any machine, float32) and
on CUDA (bfloat16, CUDA graphs on): a request's tokens and logprobs are bitwise the same alone, in a
batch of mixed lengths, after a prefix-cache hit and with its prompt chunked; sampled with a seed
and greedy. The same runs with the mode off must differ somewhere, or the comparison proves
nothing."""
import random

import pytest
import torch
import torch.nn.functional as F

from nanoinfer import LLM, SamplingParams
from nanoinfer.batch_invariant.attention import MAX_TILES, paged_attention_fixed_blocks
from nanoinfer.batch_invariant.linear import fixed_rows
from nanoinfer.config import Config
from nanoinfer.layers import fused_moe as layer
from nanoinfer.layers.model_build import ModelBuild
from nanoinfer.utils.tiny_moe import build_tiny_moe_checkpoint

BS = 16
_rng = random.Random(55)
# Prompts one and two tokens past a block boundary: after a prefix hit, or as the last chunk of a
# chunked prefill, they compute one or two rows alone, where a CPU GEMM takes another path.
TARGETS = [[_rng.randrange(10, 300) for _ in range(n)] for n in (33, 34, 50)]
PARAMS = [SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logprobs=5),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
          SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=6, ignore_eos=True, logprobs=5)]
OTHERS = [[_rng.randrange(10, 300) for _ in range(_rng.randrange(3, 70))] for _ in range(12)]
OTHER_PARAMS = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)


def _result(output):
    """A request's token ids and its logprobs, as exact floats."""
    out = output.outputs[0]
    return out.token_ids, [sorted((k, v.logprob) for k, v in step.items()) for step in out.logprobs or ()]


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [_result(o) for o in outs]


def _engine(path, invariant, device, **options):
    dtype = "bfloat16" if device == "cuda" else "auto"
    return LLM(path, batch_invariant=invariant, device=device, dtype=dtype, kvcache_block_size=BS, max_model_len=256,
               num_kvcache_blocks=96, **{"max_num_seqs": 16, **options})


def _alone_and_in_a_batch(llm) -> dict:
    """Each target's result alone, and in a batch of mixed lengths."""
    alone = [_generate(llm, [t], p)[0] for t, p in zip(TARGETS, PARAMS)]
    batch = [TARGETS[0], *OTHERS[:6], TARGETS[1], *OTHERS[6:], TARGETS[2]]
    params = [PARAMS[0], *[OTHER_PARAMS] * 6, PARAMS[1], *[OTHER_PARAMS] * 6, PARAMS[2]]
    results = _generate(llm, batch, params)
    return {"alone": alone, "batch": [results[0], results[7], results[-1]]}


def _runs(path, invariant: bool, device: str = "cpu", **options) -> dict:
    """Each target's result per case: alone, in a batch, after a prefix hit, chunked."""
    llm = _engine(path, invariant, device, enable_prefix_caching=False, **options)
    try:
        runs = _alone_and_in_a_batch(llm)
    finally:
        llm.exit()
    llm = _engine(path, invariant, device, **options)
    try:  # other prompts sharing the targets' first two blocks go first
        _generate(llm, [t[:2 * BS] + [5, 6, 7] for t in TARGETS], OTHER_PARAMS)
        hits = llm.scheduler.block_manager.num_hits
        runs["prefix hit"] = [_generate(llm, [t], p)[0] for t, p in zip(TARGETS, PARAMS)]
        assert llm.scheduler.block_manager.num_hits - hits == 2 * len(TARGETS)  # (their first two blocks)
    finally:
        llm.exit()
    llm = _engine(path, invariant, device, enable_prefix_caching=False, max_num_batched_tokens=BS, max_num_seqs=4,
                  **options)
    try:
        runs["chunked"] = [_generate(llm, [t], p)[0] for t, p in zip(TARGETS, PARAMS)]
    finally:
        llm.exit()
    return runs


def _differences(runs: dict) -> dict:
    """case -> indices of the targets whose result differs from their result alone."""
    return {case: [i for i, (a, b) in enumerate(zip(runs["alone"], got)) if a != b]
            for case, got in runs.items() if case != "alone"}


@pytest.fixture(scope="module")
def runs_on(tiny_qwen3):
    return _runs(tiny_qwen3, True)


@pytest.fixture(scope="module")
def runs_off(tiny_qwen3):
    return _runs(tiny_qwen3, False)


def test_invariant_mode_is_bitwise_equal_in_every_case(runs_on):
    print("batch_invariant=True, differing targets per case:", _differences(runs_on))
    assert all(len(tokens) == 6 for tokens, _ in runs_on["alone"])
    for case, got in runs_on.items():
        assert got == runs_on["alone"], case


def test_default_mode_differs_somewhere(runs_off):
    """The comparison can fail: without the mode the same runs differ (logprobs' bits at least)."""
    differences = _differences(runs_off)
    print("batch_invariant=False, differing targets per case:", differences)
    assert any(differences.values())


@pytest.fixture(scope="module")
def cuda_model(make_checkpoint):
    """Wide enough that cuBLAS splits K for a few rows, as it does for real models."""
    return make_checkpoint(hidden_size=1024, intermediate_size=3072, num_heads=8, num_kv_heads=4, head_dim=128)


@pytest.mark.cuda
def test_cuda_invariant_mode_is_bitwise_equal_in_every_case(cuda_model):
    runs = _runs(cuda_model, True, "cuda")
    print("CUDA bf16, batch_invariant=True, differing targets per case:", _differences(runs))
    assert all(len(tokens) == 6 for tokens, _ in runs["alone"])
    for case, got in runs.items():
        assert got == runs["alone"], case


@pytest.mark.cuda
def test_cuda_default_mode_differs_somewhere(cuda_model):
    differences = _differences(_runs(cuda_model, False, "cuda"))
    print("CUDA bf16, batch_invariant=False, differing targets per case:", differences)
    assert any(differences.values())


def test_option_from_env_and_bad_values(tiny_qwen3, monkeypatch):
    assert Config(tiny_qwen3, device="cpu").batch_invariant is False
    monkeypatch.setenv("NANOINFER_BATCH_INVARIANT", "1")
    assert Config(tiny_qwen3, device="cpu").batch_invariant is True
    monkeypatch.setenv("NANOINFER_BATCH_INVARIANT", "yes please")
    with pytest.raises(ValueError, match="NANOINFER_BATCH_INVARIANT"):
        Config(tiny_qwen3, device="cpu")
    monkeypatch.delenv("NANOINFER_BATCH_INVARIANT")
    with pytest.raises(TypeError, match="batch_invariant"):
        Config(tiny_qwen3, device="cpu", batch_invariant="yes")





@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_is_bitwise_equal_in_every_case(tiny_qwen3, method):
    """Speculative rows verify several positions a step; with the mode on a position's logits are
    its own whatever the step, so the tokens (and their logprobs) match plain decoding's in every
    case; drafts are made and accepted on these prompts. With the mode off the runs differ."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        spec["model"] = tiny_qwen3  # (the target as its own draft: drafts accepted)
    on, off = _runs(tiny_qwen3, True, speculative_config=spec), _runs(tiny_qwen3, False, speculative_config=spec)
    print(f"{method}: batch_invariant=True / False, differing targets per case:", _differences(on), _differences(off))
    for case, got in on.items():
        assert got == on["alone"], case
    assert any(_differences(off).values())
    plain = _engine(tiny_qwen3, True, "cpu", enable_prefix_caching=False)
    llm = _engine(tiny_qwen3, True, "cpu", enable_prefix_caching=False, speculative_config=spec)
    try:
        assert _generate(plain, TARGETS, PARAMS[1]) == _generate(llm, TARGETS, PARAMS[1])  # greedy
        assert llm.spec_stats.num_accepted_tokens > 0
    finally:
        plain.exit()
        llm.exit()


def test_lora_on_cpu_is_bitwise_equal_alone_and_beside_other_adapters(tiny_qwen3, tmp_path):
    """Adapters (and the base) side by side: the shrink and the expand in fixed row chunks, added to
    the base product apart (LoRALinearMethod's rows_product); with the mode off the runs differ. The
    adapters do change the tokens, and match HF + PEFT."""
    from lora_reference import ALL_TARGETS, assert_greedy_matches, make_adapter
    from nanoinfer import LoRARequest
    loras = [LoRARequest(f"ad{i}", i, make_adapter(tiny_qwen3, str(tmp_path / f"ad{i}"), targets, r, alpha, seed=i))
             for i, (targets, r, alpha) in enumerate([(ALL_TARGETS, 8, 16), (["q_proj", "down_proj"], 4, 8)], 1)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    targets = list(zip(TARGETS, [loras[0], None, loras[1]], [PARAMS[0], greedy, greedy]))

    def results(invariant: bool):
        llm = _engine(tiny_qwen3, invariant, "cpu", enable_prefix_caching=False, enable_lora=True, max_loras=2,
                      max_lora_rank=8)
        try:
            alone = [_result(llm.generate([{"prompt_token_ids": t}], p, lora_request=lora, use_tqdm=False)[0])
                     for t, lora, p in targets]
            batch = [t for t, _, _ in targets] + OTHERS[:6]
            adapters = [lora for _, lora, _ in targets] + [loras[i % 2] if i % 3 else None for i in range(6)]
            params = [p for _, _, p in targets] + [OTHER_PARAMS] * 6
            outs = llm.generate([{"prompt_token_ids": t} for t in batch], params, lora_request=adapters,
                                use_tqdm=False)
            return alone, [_result(o) for o in outs[:3]]
        finally:
            llm.exit()

    alone, beside = results(True)
    assert alone == beside
    assert_greedy_matches(tiny_qwen3, loras[1].lora_path, TARGETS[2], alone[2][0])
    plain = _engine(tiny_qwen3, True, "cpu", enable_prefix_caching=False)
    try:
        assert _generate(plain, [TARGETS[2]], greedy)[0] != alone[2]  # (the adapter is applied)
    finally:
        plain.exit()
    alone, beside = results(False)
    assert alone != beside


def test_vision_language_on_cpu_is_bitwise_equal_alone_beside_other_images_and_chunked(make_vl_checkpoint):
    """A request with an image: its tokens the same alone, in a batch with other images (two of the
    same size among them), after a prefix hit and with its prompt chunked through the image. With
    the mode off the runs differ."""
    from vl_reference import random_image
    from nanoinfer.multimodal.tiny_model import PLACEHOLDER
    path = make_vl_checkpoint(vision_hidden=64, vision_heads=2)
    image = {"image": [random_image(112, 84, seed=1)]}
    first = f"Describe {PLACEHOLDER} in a few"
    target = {"prompt": f"{first} words please, and then some more.", "multi_modal_data": image}
    others = [{"prompt": f"A {PLACEHOLDER} and {PLACEHOLDER}.",
               "multi_modal_data": {"image": [random_image(112, 84, seed=2), random_image(56, 140, seed=3)]}},
              "Hello, my name is", {"prompt": f"Big {PLACEHOLDER}.", "multi_modal_data": {"image": [
                  random_image(300, 260, seed=4)]}}]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=5)

    def results(invariant: bool) -> dict:
        runs = {}
        options = dict(device="cpu", kvcache_block_size=BS, max_model_len=512, batch_invariant=invariant)
        llm = LLM(path, enable_prefix_caching=False, **options)
        try:
            runs["alone"] = _result(llm.generate([target], params, use_tqdm=False)[0])
            runs["batch"] = _result(llm.generate([*others[:2], target, others[2]], params, use_tqdm=False)[2])
        finally:
            llm.exit()
        llm = LLM(path, **options)
        try:  # the same image and first words, then the target: its image's blocks come from the cache
            llm.generate([{"prompt": first, "multi_modal_data": image}], params, use_tqdm=False)
            runs["prefix hit"] = _result(llm.generate([target], params, use_tqdm=False)[0])
            assert llm.scheduler.block_manager.num_hits > 0
        finally:
            llm.exit()
        llm = LLM(path, enable_prefix_caching=False, max_num_batched_tokens=BS, max_num_seqs=4, **options)
        try:
            runs["chunked"] = _result(llm.generate([target], params, use_tqdm=False)[0])
        finally:
            llm.exit()
        return runs

    on, off = results(True), results(False)
    print("VL, batch_invariant=True / False, differing cases:", [c for c in on if on[c] != on["alone"]],
          [c for c in off if off[c] != off["alone"]])
    for case, got in on.items():
        assert got == on["alone"], case
    assert any(got != off["alone"] for got in off.values())


def test_vision_tower_encodes_an_image_alike_alone_and_beside_others(make_vl_checkpoint):
    """One tower call encodes a step's images together: with the mode's build (ModelBuild.unsharded
    of it: invariant products, patch embedding included) an image's embeddings are bitwise those it
    gets alone; with the default build they differ (a CPU GEMM of a few rows takes another path)."""
    from transformers import AutoConfig
    from nanoinfer.batch_invariant import InvariantLinearMethod, fixed_rows
    from nanoinfer.layers.linear_method import DenseLinearMethod
    from nanoinfer.models.qwen2_5_vision import Qwen2_5_VisionTransformer
    vision = AutoConfig.from_pretrained(make_vl_checkpoint(vision_hidden=64)).vision_config
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    grids = [(1, 4, 4), (1, 8, 6), (1, 4, 4), (1, 10, 10)]
    pixels = [torch.randn(t * h * w, features, generator=torch.Generator().manual_seed(i)) for i, (t, h, w)
              in enumerate(grids)]

    def alone_and_together(build):
        torch.manual_seed(0)
        tower = Qwen2_5_VisionTransformer(vision, build)
        for param in tower.parameters():
            param.data.normal_(0, 0.05)
        with torch.inference_mode():
            alone = tower(pixels[0], grids[:1])
            return alone, tower(torch.cat(pixels), grids)[:alone.shape[0]]

    invariant = ModelBuild(lm_head_method=InvariantLinearMethod(DenseLinearMethod()), rows_product=fixed_rows)
    alone, together = alone_and_together(invariant.unsharded())
    assert torch.equal(alone, together)
    alone, together = alone_and_together(ModelBuild().unsharded())
    assert not torch.equal(alone, together)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return build_tiny_moe_checkpoint(str(tmp_path_factory.mktemp("moe")))


def test_moe_on_cpu_is_bitwise_equal_in_every_case(tiny_moe):
    """The experts' products over their tokens (a set that follows the batch) in fixed row chunks
    (ModelBuild.rows_product); with the mode off the same runs differ."""
    on, off = _runs(tiny_moe, True), _runs(tiny_moe, False)
    print("MoE, batch_invariant=True / False, differing targets per case:", _differences(on), _differences(off))
    for case, got in on.items():
        assert got == on["alone"], case
    assert any(_differences(off).values())


def test_moe_layer_runs_one_fixed_kernel_path_when_invariant(tiny_moe, monkeypatch):
    """On CUDA (here Triton's interpreter) the invariant MoE layer runs the grouped kernel with one
    tile set at every row count (never the few-token kernels) and sums the slots in order."""
    calls = []
    monkeypatch.setattr(layer, "runs_kernels", lambda x: True)
    monkeypatch.setattr(layer, "moe_gemv", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(layer, "fused_moe", lambda *a, **k: calls.append(k) or torch.zeros_like(a[0]))
    for fixed in (True, False):
        moe = layer.FusedMoE(8, 2, 16, 8, True, build=ModelBuild(fixed_kernels=fixed), prefix="mlp")
        for rows in (1, 3, 40):
            moe(torch.randn(rows, 16))
    fixed_calls, default_calls = calls[:3], calls[3:]
    assert all(c == {"config": layer.FIXED_TILES, "skipped_pairs": False, "ordered_sum": True} for c in fixed_calls)
    assert default_calls[:2] == ["gemv", "gemv"] and "ordered_sum" not in default_calls[2]


@pytest.fixture(scope="module")
def cuda_moe(tmp_path_factory):
    """Wide enough that the default path's kernels change with the number of rows."""
    return build_tiny_moe_checkpoint(str(tmp_path_factory.mktemp("cuda-moe")), hidden_size=1024, num_heads=8,
                                     num_kv_heads=4, head_dim=128, intermediate_size=2048,
                                     moe_intermediate_size=512, num_experts=16, top_k=4)


@pytest.mark.cuda
@pytest.mark.parametrize("invariant", [True, False])
def test_cuda_moe_is_bitwise_equal_in_every_case_only_when_invariant(cuda_moe, invariant):
    differences = _differences(_runs(cuda_moe, invariant, "cuda"))
    print(f"CUDA bf16 MoE, batch_invariant={invariant}, differing targets per case:", differences)
    assert any(differences.values()) != invariant


def test_tensor_parallel_on_cpu_sums_in_rank_order(make_checkpoint):
    """tp=3 (gloo): every all-reduce gathers the ranks' parts and adds them in rank order. (gloo's
    ring adds each chunk of a tensor from another rank first, and its chunks follow the tensor's
    size: with three ranks or more a row's sum then depends on the rows beside it; this fails with
    in_rank_order off. With two, a + b == b + a.)"""
    path = make_checkpoint(hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=16, intermediate_size=192)
    llm = _engine(path, True, "cpu", enable_prefix_caching=False, tensor_parallel_size=3)
    try:
        runs = _alone_and_in_a_batch(llm)
    finally:
        llm.exit()
    assert runs["batch"] == runs["alone"]


def test_refused_for_quantized_weights_and_tensor_parallel_on_cuda(tiny_qwen3, monkeypatch):
    """The FP8 GEMMs split K by the number of rows; the CUDA all-reduces are not checked yet:
    refused on CUDA, never silently non-invariant."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="batch_invariant.*quantized weights on CUDA"):
        Config(tiny_qwen3, batch_invariant=True, device="cuda", quantization="fp8")
    with pytest.raises(ValueError, match="batch_invariant.*tensor_parallel_size=2 on CUDA"):
        Config(tiny_qwen3, batch_invariant=True, device="cuda", tensor_parallel_size=2)
    assert Config(tiny_qwen3, batch_invariant=True, device="cuda").batch_invariant


@pytest.mark.parametrize("options, named", [
    (dict(enable_lora=True), "enable_lora on CUDA"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config on CUDA"),
])
def test_refused_on_cuda_where_not_verified_there(tiny_qwen3, monkeypatch, options, named):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=f"batch_invariant.*{named}"):
        Config(tiny_qwen3, batch_invariant=True, device="cuda", **options)
    assert Config(tiny_qwen3, batch_invariant=True, device="cpu", **options).batch_invariant


def test_row_chunks_and_row_reductions_do_not_depend_on_the_rows_beside():
    """What the mode relies on: fixed row chunks of a product, and torch's row-wise reductions
    (RMSNorm's mean, log-softmax) give a row the same bits whatever rows are beside it."""
    torch.manual_seed(0)
    x, w = torch.randn(40, 64), torch.randn(96, 64)
    whole = fixed_rows(lambda c: F.linear(c, w), x)
    for start, rows in ((0, 1), (5, 2), (17, 9), (3, 37)):
        assert torch.equal(fixed_rows(lambda c: F.linear(c, w), x[start:start + rows]), whole[start:start + rows])
        assert torch.equal(x[start:start + rows].pow(2).mean(-1), x.pow(2).mean(-1)[start:start + rows])
        assert torch.equal(torch.log_softmax(w[start:start + rows], -1), torch.log_softmax(w, -1)[start:start + rows])


def test_fixed_block_attention_matches_reference_and_masks_past_the_context():
    """Against plain causal attention per sequence; slots past a context hold NaN and are ignored."""
    torch.manual_seed(0)
    heads, kv_heads, dim, blocks = 4, 2, 8, 12
    k_cache = torch.full((blocks, BS, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    context_lens, query_lens = [20, 37, 5], [20, 1, 3]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, -1, -1]])
    keys = [torch.randn(n, kv_heads, dim) for n in context_lens]
    values = [torch.randn(n, kv_heads, dim) for n in context_lens]
    for table, k, v in zip(tables, keys, values):
        for pos in range(k.shape[0]):
            k_cache[table[pos // BS], pos % BS], v_cache[table[pos // BS], pos % BS] = k[pos], v[pos]
    q = torch.randn(sum(query_lens), heads, dim)
    out = paged_attention_fixed_blocks(q, k_cache, v_cache, query_lens, context_lens, tables, dim ** -0.5)
    start = 0
    for n, c, k, v in zip(query_lens, context_lens, keys, values):
        qs = q[start:start + n].transpose(0, 1)
        kk = k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        vv = v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        ref = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=dim ** -0.5).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-5)
        start += n


def test_fixed_block_attention_rows_do_not_depend_on_the_step():
    """A sequence's rows, bitwise: alone, as the last rows of a chunked prompt, and beside more
    sequences than one pass of tiles holds (MAX_TILES), decode rows and prompt chunks mixed."""
    torch.manual_seed(1)
    heads, kv_heads, dim, width = 4, 2, 8, 4
    n_seqs = MAX_TILES + 20
    k_cache = torch.randn(n_seqs * width, BS, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(n_seqs * width).view(n_seqs, width)
    context_lens = [_rng.randrange(1, width * BS) for _ in range(n_seqs - 1)] + [50]
    query_lens = [min(c, _rng.choice([1, 1, 3, 17])) for c in context_lens[:-1]] + [20]
    q = torch.randn(sum(query_lens), heads, dim)
    crowd = paged_attention_fixed_blocks(q, k_cache, v_cache, query_lens, context_lens, tables, 0.3)[-20:]
    alone = paged_attention_fixed_blocks(q[-20:], k_cache, v_cache, [20], [50], tables[-1:], 0.3)
    last_chunk = paged_attention_fixed_blocks(q[-3:], k_cache, v_cache, [3], [50], tables[-1:], 0.3)
    assert torch.equal(crowd, alone) and torch.equal(last_chunk, alone[-3:])


def test_embeddings_are_batch_invariant(tiny_qwen3):
    """runner="pooling": a prompt's embedding alone and beside others, bitwise, with the mode on
    (and off, which differs here, so the comparison can fail)."""
    def embeddings(invariant: bool):
        llm = LLM(tiny_qwen3, runner="pooling", batch_invariant=invariant, device="cpu", kvcache_block_size=BS,
                  max_model_len=256)
        try:
            alone = llm.embed([{"prompt_token_ids": TARGETS[0]}], use_tqdm=False)[0].outputs.embedding
            batch = [{"prompt_token_ids": p} for p in (TARGETS[0], *OTHERS[:4])]
            return alone, llm.embed(batch, use_tqdm=False)[0].outputs.embedding
        finally:
            llm.exit()

    alone, beside = embeddings(True)
    assert alone == beside
    alone, beside = embeddings(False)
    assert alone != beside

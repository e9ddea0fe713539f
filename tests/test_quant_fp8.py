"""FP8 weights: tiny random checkpoints quantized here into block FP8 (Qwen3-FP8's format, with a
block size small enough that partial edge blocks occur in both dimensions) and compressed-tensors
FP8 (per channel, per tensor with static activation scales). On CPU the engine dequantizes at load,
so its greedy tokens must be HF's argmax on the same dequantized float32 weights (saved as a plain
checkpoint), token for token; online quantization="fp8" must equal HF on the round-tripped weights.
Also: bad or missing scales and unknown formats are refused, ignore lists are honoured, TP=2 works
and a cut through a scale block is refused, FP8 MoE experts, dummy weights, the memory estimate,
and the new Triton kernels in the interpreter against torch. CUDA-marked: the _scaled_mm / Triton
W8A8 paths against the dequantized bf16 model, with CUDA graphs."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import assert_greedy_matches_hf
from nanoinfer import LLM, SamplingParams
from nanoinfer.utils.tiny_moe import build_tiny_moe_checkpoint

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(kvcache_block_size=16, max_model_len=128)


# ------------------------------------------------------------------ quantizing a checkpoint (reference)
def _quantize_blocks(w: torch.Tensor, bn: int, bk: int):
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb, kb]
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, full


def _quantize(w: torch.Tensor, strategy: str, block=None):
    """(fp8 weight, checkpoint scale tensor, the scale of every element)."""
    if strategy == "block":
        return _quantize_blocks(w, *block)
    if strategy == "channel":
        scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
        full = scale.expand_as(w)
    else:
        scale = (w.float().abs().amax() / FP8_MAX).reshape(1)
        full = scale.expand_as(w)
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, full


def _is_quantized(name: str, ignored) -> bool:
    module = name[: -len(".weight")]
    return name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS and not ignored(module)


def quantize_checkpoint(src: str, dst: str, ref: str, qc: dict, strategy: str, block=None, ignored=lambda m: False,
                        extra=None, drop=(), reshape=None):
    """Write the FP8 checkpoint `dst` (config.json with `qc`) and `ref`, the same model with the
    dequantized float32 weights and no quantization_config (what HF runs). extra: tensors added to
    dst; drop: tensor names left out of dst; reshape: {name: tensor} replacing one in dst."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, dense = {}, {}
    scale_name = "weight_scale_inv" if qc["quant_method"] == "fp8" else "weight_scale"
    for name, w in tensors.items():
        if _is_quantized(name, ignored):
            q, scale, full = _quantize(w, strategy, block)
            quant[name], quant[name[: -len("weight")] + scale_name] = q, scale
            if qc.get("static"):
                quant[name[: -len("weight")] + "input_scale"] = torch.tensor([0.05])
            dense[name] = q.float() * full
        else:
            quant[name] = dense[name] = w
    qc = {k: v for k, v in qc.items() if k != "static"}
    quant.update(extra or {})
    quant.update(reshape or {})
    for name in drop:
        del quant[name]
    for path, ts, with_qc in ((dst, quant, True), (ref, dense, False)):
        shutil.copytree(src, path, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in ts.items()}, os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.pop("quantization_config", None)
        if with_qc:
            config["quantization_config"] = qc
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return dst, ref


def block_qc(block, ignore=None):
    qc = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=list(block))
    if ignore is not None:
        qc["modules_to_not_convert"] = ignore
    return qc


def compressed_qc(strategy, static=False, ignore=("lm_head",)):
    acts = (dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True) if static
            else dict(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True))
    return dict(quant_method="compressed-tensors", format="float-quantized", ignore=list(ignore), static=static,
                config_groups=dict(group_0=dict(targets=["Linear"], input_activations=acts,
                                                weights=dict(num_bits=8, type="float", strategy=strategy,
                                                             symmetric=True, dynamic=False))))


@pytest.fixture(scope="module")
def base(make_checkpoint):
    # hidden 64 with block_k 48 and q/k/v/gate rows with block_n 24: partial blocks in both dimensions
    return make_checkpoint(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2)


def greedy(path, prompts=None, **options):
    llm = LLM(path, **SMALL, **options)
    try:
        prompts = prompts or [[(i * 37) % llm.vocab_size for i in range(1, 30)], [5, 9, 200, 31, 7]]
        return prompts, [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm
    finally:
        llm.exit()


def assert_matches(path, ref, **options):
    prompts, outs, _ = greedy(path, **options)
    for p, o in zip(prompts, outs):
        assert len(o) == GREEDY.max_tokens
        assert_greedy_matches_hf(ref, p, o)


# ------------------------------------------------------------------ checkpoints equal HF, dequantized
def test_block_fp8_equals_hf_on_dequantized_weights(base, tmp_path):
    dst, ref = quantize_checkpoint(base, str(tmp_path / "q"), str(tmp_path / "ref"), block_qc([24, 48]), "block",
                                   block=(24, 48))
    scales = load_file(os.path.join(dst, "model.safetensors"))["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert scales.shape == (3, 2)  # 64 rows / 24, 64 columns / 48: partial blocks both ways
    assert_matches(dst, ref)


@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True), ("tensor", False)])
def test_compressed_tensors_fp8_equals_hf_on_dequantized_weights(base, tmp_path, strategy, static):
    extra = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.0),
             "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(1.0)}  # skipped with kv_cache_dtype="auto"
    dst, ref = quantize_checkpoint(base, str(tmp_path / "q"), str(tmp_path / "ref"), compressed_qc(strategy, static),
                                   strategy, extra=extra)
    assert_matches(dst, ref)


def round_tripped(src: str, ref: str) -> str:
    """`src` with every linear (and expert) weight quantized per output channel and dequantized."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name, w in tensors.items():
        if _is_quantized(name, lambda m: False):
            q, _, full = _quantize(w, "channel")
            tensors[name] = q.float() * full
    shutil.copytree(src, ref)
    save_file(tensors, os.path.join(ref, "model.safetensors"))
    return ref


@pytest.mark.parametrize("kind", ["block", "channel", "tensor-static", "online"])
def test_the_loader_writes_every_fp8_parameter(monkeypatch, base, tmp_path, kind):
    """Every parameter is written while the checkpoint loads (torch.empty's leftovers are garbage on
    CUDA, often finite on CPU): each one is poisoned with NaN before loading, and the loader's NaN
    check must pass. A static input_scale of a fused layer (q/k/v, gate/up) is the max of its shards'."""
    from nanoinfer.utils import loader
    load_model = loader.load_model

    def poisoned_load(model, *args, **kwargs):
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype.is_floating_point and not getattr(p, "optional_in_checkpoint", False):
                    p.fill_(float("nan"))
        return load_model(model, *args, **kwargs)

    monkeypatch.setattr(loader, "load_model", poisoned_load)
    if kind == "online":
        dst, options = base, dict(quantization="fp8")
    else:
        qc = {"block": block_qc([24, 48]), "channel": compressed_qc("channel"),
              "tensor-static": compressed_qc("tensor", static=True)}[kind]
        scales = {f"model.layers.1.mlp.{name}.input_scale": torch.tensor([s])
                  for name, s in (("gate_proj", 0.03), ("up_proj", 0.07))}
        dst, _ = quantize_checkpoint(base, str(tmp_path / "q"), str(tmp_path / "ref"), qc, kind.split("-")[0],
                                     block=(24, 48), reshape=scales if kind == "tensor-static" else None)
        options = {}
    seen = {}
    if kind == "tensor-static":  # the scale the layer holds once loaded (CPU then drops it, dequantized)
        from nanoinfer.quant import fp8_linear
        after = fp8_linear.Fp8LinearMethod.process_weights_after_loading

        def record(self, layer):
            seen[layer] = layer.input_scale.item()
            return after(self, layer)

        monkeypatch.setattr(fp8_linear.Fp8LinearMethod, "process_weights_after_loading", record)
    llm = LLM(dst, **SMALL, **options)
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]) == GREEDY.max_tokens
        if kind == "tensor-static":
            gate_up = llm.model_runner.model.model.layers[1].mlp.gate_up_proj
            assert seen[gate_up] == pytest.approx(0.07)
            assert all(v == pytest.approx(0.05) for layer, v in seen.items() if layer is not gate_up)
    finally:
        llm.exit()


def test_online_fp8_equals_hf_on_round_tripped_weights(base, tmp_path):
    assert_matches(base, round_tripped(base, str(tmp_path / "ref")), quantization="fp8")
    with pytest.raises(AssertionError):  # the round trip matters: plain HF differs somewhere
        prompts, outs, _ = greedy(base, quantization="fp8")
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(base, p, o, tol=0.0)


def test_ignore_lists_stay_dense(base, tmp_path):
    from nanoinfer.layers.linear_method import DenseLinearMethod
    from nanoinfer.quant.fp8_linear import Fp8LinearMethod
    layer0_mlp = lambda m: ".layers.0.mlp." in m + "."  # noqa: E731
    cases = [
        (block_qc([32, 32], ignore=["layers.0.mlp"]), "block", (32, 32)),
        (compressed_qc("channel", ignore=["lm_head", "re:.*layers\\.0\\.mlp\\..*"]), "channel", None),
    ]
    for i, (qc, strategy, block) in enumerate(cases):
        dst, ref = quantize_checkpoint(base, str(tmp_path / f"q{i}"), str(tmp_path / f"r{i}"), qc, strategy,
                                       block=block, ignored=layer0_mlp)
        prompts, outs, llm = greedy(dst)
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(ref, p, o)
        from nanoinfer.config import Config
        from nanoinfer.quant import fp8_scheme, linear_method_chooser
        from nanoinfer.models.qwen3 import Qwen3ForCausalLM
        choose = linear_method_chooser(fp8_scheme(None, Config(dst).hf_config), Qwen3ForCausalLM.packed_modules_mapping)
        assert isinstance(choose("model.layers.0.mlp.gate_up_proj"), DenseLinearMethod)
        assert isinstance(choose("model.layers.0.mlp.down_proj"), DenseLinearMethod)
        assert isinstance(choose("model.layers.1.mlp.gate_up_proj"), Fp8LinearMethod)
        assert isinstance(choose("model.layers.0.self_attn.qkv_proj"), Fp8LinearMethod)


def test_a_fused_layer_half_ignored_is_refused(base):
    from nanoinfer.models.qwen3 import Qwen3ForCausalLM
    from nanoinfer.quant import Fp8Scheme, linear_method_chooser
    choose = linear_method_chooser(Fp8Scheme("channel", ignore=("model.layers.0.self_attn.q_proj",),
                                             ignore_is_exact=True), Qwen3ForCausalLM.packed_modules_mapping)
    with pytest.raises(ValueError, match="must be one format"):
        choose("model.layers.0.self_attn.qkv_proj")


# ------------------------------------------------------------------ bad checkpoints
def test_missing_or_misshapen_scales_are_refused(base, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    qc = block_qc([24, 48])
    dst, _ = quantize_checkpoint(base, str(tmp_path / "a"), str(tmp_path / "ra"), qc, "block", block=(24, 48),
                                 drop=[name])
    with pytest.raises(ValueError, match=name):
        LLM(dst, **SMALL)
    dst, _ = quantize_checkpoint(base, str(tmp_path / "b"), str(tmp_path / "rb"), qc, "block", block=(24, 48),
                                 reshape={name: torch.ones(3, 2)})  # k_proj: 32 rows -> 2 blocks, not 3
    with pytest.raises(ValueError, match=f"{name}.*size mismatch"):
        LLM(dst, **SMALL)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    dst, _ = quantize_checkpoint(base, str(tmp_path / "c"), str(tmp_path / "rc"), compressed_qc("channel"), "channel",
                                 reshape={name: torch.ones(64, 2)})
    with pytest.raises(ValueError, match=f"{name}.*size mismatch"):
        LLM(dst, **SMALL)
    # an FP8 tensor where the config says dense, and a dense tensor where it says FP8
    dst, _ = quantize_checkpoint(base, str(tmp_path / "d"), str(tmp_path / "rd"), compressed_qc("channel"), "channel",
                                 reshape={"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight.*float8_e4m3fn weight is expected"):
        LLM(dst, **SMALL)


@pytest.mark.parametrize("qc,match", [
    (dict(quant_method="awq"), "quant_method 'awq' is not supported"),
    (dict(quant_method="fp8", fmt="e5m2"), "fmt must be 'e4m3'"),
    (dict(quant_method="fp8", weight_block_size=[128]), "weight_block_size"),
    (dict(quant_method="fp8", weight_block_size=[128, 128], activation_scheme="static"), "activation_scheme"),
    (dict(quant_method="compressed-tensors", config_groups={"g": dict(targets=["Linear"], weights=dict(
        num_bits=4, type="int", strategy="group"))}), "weights must be static symmetric 8-bit float"),
])
def test_unsupported_quantization_configs_are_refused(qc, match):
    from types import SimpleNamespace
    from nanoinfer.quant import fp8_scheme
    with pytest.raises(ValueError, match=match):
        fp8_scheme(None, SimpleNamespace(quantization_config=qc))


# ------------------------------------------------------------------ tensor parallel
def test_tp2_block_fp8_equals_hf_and_a_split_block_is_refused(make_checkpoint, tmp_path, base):
    path = make_checkpoint(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
    dst, ref = quantize_checkpoint(path, str(tmp_path / "q"), str(tmp_path / "ref"), block_qc([16, 32]), "block",
                                   block=(16, 32))
    assert_matches(dst, ref, tensor_parallel_size=2)
    # block_n 24: rank 1's q rows start at 32, inside a block
    from nanoinfer.config import Config
    from nanoinfer.models.build import build_model
    from nanoinfer.layers.attention_backend import TorchAttentionBackend
    bad, _ = quantize_checkpoint(base, str(tmp_path / "b"), str(tmp_path / "rb"), block_qc([24, 48]), "block",
                                 block=(24, 48))
    with pytest.raises(ValueError, match="splits a 24x48 FP8 scale block"):
        build_model(Config(bad, device="cpu", tensor_parallel_size=2), 1, 2, torch.device("cpu"),
                    TorchAttentionBackend())


# ------------------------------------------------------------------ MoE experts
def test_fp8_moe_experts_equal_hf_on_dequantized_weights(tmp_path):
    src = build_tiny_moe_checkpoint(str(tmp_path / "moe"), moe_intermediate_size=40)
    names = load_file(os.path.join(src, "model.safetensors")).keys()
    assert any(".experts.3.down_proj.weight" in n for n in names)
    dst, ref = quantize_checkpoint(src, str(tmp_path / "q"), str(tmp_path / "ref"), block_qc([16, 32]), "block",
                                   block=(16, 32))
    assert_matches(dst, ref)
    # online FP8 quantizes the experts too (per row): HF on the round-tripped weights
    assert_matches(src, round_tripped(src, str(tmp_path / "online-ref")), quantization="fp8")


# ------------------------------------------------------------------ dummy weights, memory estimate
def test_dummy_fp8_weights_run_and_the_memory_estimate_counts_fp8(base):
    llm = LLM(base, load_format="dummy", quantization="fp8", **SMALL)
    try:
        layer = llm.model_runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == torch.float32  # CPU: dequantized, from valid FP8 codes and scales
        assert torch.isfinite(layer.weight).all() and 0.005 < layer.weight.std() < 0.05
        out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]
        assert len(out) == GREEDY.max_tokens
    finally:
        llm.exit()
    from transformers import Qwen3Config
    from nanoinfer.models.config_limits import weight_bytes, weight_elements
    c = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    arch = "Qwen3ForCausalLM"
    embed = 2 * 151936 * 4096
    assert weight_bytes(c, arch, torch.bfloat16) == 2 * weight_elements(c, arch)
    assert weight_bytes(c, arch, torch.bfloat16, fp8=True) == 2 * embed + (weight_elements(c, arch) - embed)


# ------------------------------------------------------------------ kernels (Triton interpreter on CPU)
def _fp8_weight(n, k, strategy, gk, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    kb = 1 if strategy != "block" else -(-k // gk)
    scale = torch.rand(n, kb, generator=g) * 0.02 + 0.01
    return w, scale


@pytest.mark.parametrize("n,k,gk,kb_many", [(40, 96, 96, False), (24, 80, 32, True), (8, 256, 128, True),
                                            (16, 64, 16, True)])
@pytest.mark.parametrize("prologue", ["none", "norm", "silu"])
def test_fp8_gemv_matches_torch(n, k, gk, kb_many, prologue):
    from nanoinfer.kernels.fp8_gemv import fp8_gemv
    from nanoinfer.quant.fp8_math import dequantize
    w, scale = _fp8_weight(n, k, "block" if kb_many else "channel", gk)
    gk = gk if kb_many else k
    dense = dequantize(w, scale, gk, torch.float32)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    if prologue == "silu":
        x = torch.randn(1, 2 * k, generator=g)
        y = fp8_gemv(x, w, scale, gk, bias, silu_mul=True)
        inp = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    elif prologue == "norm":
        x, res, nw = torch.randn(1, k, generator=g), torch.randn(1, k, generator=g), torch.rand(k, generator=g) + 0.5
        res_out = torch.empty(1, k)
        y = fp8_gemv(x, w, scale, gk, bias, norm_weight=nw, eps=1e-6, residual=res, residual_out=res_out)
        h = x + res
        inp = nw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        torch.testing.assert_close(res_out, h)
    else:
        x = torch.randn(1, k, generator=g)
        y = fp8_gemv(x, w, scale, gk, bias)
        inp = x
    torch.testing.assert_close(y, inp @ dense.t() + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n,k,gk,kb_many", [(5, 40, 96, 96, False), (33, 48, 80, 32, True),
                                              (17, 24, 256, 128, True), (3, 16, 64, 48, True),
                                              (70, 136, 256, 128, True), (70, 40, 96, 96, False)])
def test_fp8_gemm_matches_torch(m, n, k, gk, kb_many):
    from nanoinfer.kernels.fp8_gemm import fp8_gemm
    from nanoinfer.quant.fp8_math import dequantize, quantize_activations
    w, scale = _fp8_weight(n, k, "block" if kb_many else "channel", gk)
    gk = gk if kb_many else k
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    xq, xs = quantize_activations(x, gk if kb_many else None)
    assert xs.shape == (m, -(-k // gk) if kb_many else 1)
    ref = dequantize(xq, xs, gk, torch.float32) @ dequantize(w, scale, gk, torch.float32).t()
    y = fp8_gemm(xq, xs, w, scale, gk, torch.float32)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    # the activations' round trip stays close to x (per-token or per-group scales)
    assert (dequantize(xq, xs, gk, torch.float32) - x).abs().max() <= x.abs().max() / 8


def test_fp8_gemm_static_activation_scale_with_block_weights():
    from nanoinfer.kernels.fp8_gemm import fp8_gemm
    from nanoinfer.quant.fp8_math import dequantize, quantize_static
    w, scale = _fp8_weight(32, 64, "block", 32)
    x = torch.randn(4, 64)
    s = torch.tensor([0.01])
    xq = quantize_static(x, s)
    y = fp8_gemm(xq, s.expand(4, 1).contiguous(), w, scale, 32, torch.float32)
    ref = (xq.float() * s) @ dequantize(w, scale, 32, torch.float32).t()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ CUDA
# W8A8 against the same model dequantized to bf16: greedy agreement over 64 prompts and the mean and
# max |delta logprob| of the chosen tokens, printed; no exactness on the GPU. A plain tiny random model
# has near-flat logits (top-1/top-2 gaps of a few hundredths of a nat), so FP8 activation rounding
# flips its argmax at many prompts; the model of these tests is made confident (`confident`). The
# bounds come from emulating the CUDA path on CPU (test_w8a8_bounds_on_the_emulated_cuda_path): the
# correct W8A8 path passes them with margin, wrong weight or activation scales fail them. (The max is
# one token of about a thousand: a loose guard; the mean and the agreement are the tests.)
EMBED_SCALE = 16.0
W8A8_PROMPTS = [[(i * 37 + j * 13) % 380 + 3 for i in range(1, 2 + (j * 7) % 50)] for j in range(64)]
W8A8_TOKENS = 16
MIN_FIRST_AGREE = 58  # of the 64 prompts' first tokens (90 %)
MAX_MEAN_DELTA, MAX_DELTA = 0.12, 2.0  # |delta logprob| of the chosen tokens, up to each first disagreement
MOE_EMBED_SCALE = 8.0  # the MoE model's layers add less to its residual stream: less makes it as confident


def confident(src: str, dst: str, embed_scale: float = EMBED_SCALE) -> str:
    """`src` made confident: token embeddings times `embed_scale`, and an LM head whose row j is the
    (unscaled) embedding of token j - 1. The current token then leads the residual stream and favours
    its successor id by a wide margin (top-1/top-2 gaps well above what W8A8 rounding moves), while
    the layers, of the same size in the residual, still move the logprobs (a wrong scale shows)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.roll(1, 0).contiguous()
    tensors["model.embed_tokens.weight"] = embed * embed_scale
    shutil.copytree(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = False
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def w8a8_base(make_checkpoint, tmp_path) -> str:
    base = make_checkpoint(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    return confident(base, str(tmp_path / "confident"))


def agreement(ours: list[list[int]], theirs: list[list[int]], ours_lp: list[list[float]],
              theirs_lp: list[list[float]]) -> tuple[int, int, list[float]]:
    """(prompts whose first token agrees, whose every token agrees, |delta logprob| of our chosen
    tokens up to each prompt's first disagreement); *_lp[i][t]: the logprob of ours[i][t]."""
    first = sum(a[0] == b[0] for a, b in zip(ours, theirs))
    same = sum(a == b for a, b in zip(ours, theirs))
    deltas = []
    for a, b, la, lb in zip(ours, theirs, ours_lp, theirs_lp):
        for tok, ref_tok, x, y in zip(a, b, la, lb):
            if tok != ref_tok:
                break
            deltas.append(abs(x - y))
    return first, same, deltas


def within_w8a8_bounds(first: int, deltas: list[float]) -> bool:
    return first >= MIN_FIRST_AGREE and sum(deltas) / len(deltas) < MAX_MEAN_DELTA and max(deltas) < MAX_DELTA


@torch.no_grad()
def test_w8a8_bounds_on_the_emulated_cuda_path(make_checkpoint, tmp_path):
    """The CUDA W8A8 path emulated in float32 on CPU on the CUDA tests' model: activations rounded
    to e4m3 per token (or with a static per-tensor scale) as kernels/fp8_quant.py does, times the
    dequantized weights, against the dequantized model. It must pass the CUDA tests' bounds, and
    planted bugs (weight scales on the wrong rows, one layer's scales doubled, every token
    dequantized with the first token's activation scale) must fail them."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from nanoinfer.quant.fp8_math import quantize_activations
    ref = round_tripped(w8a8_base(make_checkpoint, tmp_path), str(tmp_path / "ref"))  # per-channel dequantized
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    mode = {"w8a8": False}

    def emulated(linear, name):
        codes_scale = linear.weight.abs().amax(1, keepdim=True) / FP8_MAX  # its per-channel FP8 scales

        def forward(x):
            if not mode["w8a8"]:
                return F.linear(x, linear.weight)
            bug, rows = mode.get("bug"), x.reshape(-1, x.shape[-1])
            if mode.get("static"):
                xq = (rows / mode["static"]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * mode["static"]
            else:
                q, xs = quantize_activations(rows, None)
                xq = q.float() * (xs[:1].expand_as(xs) if bug == "first token's activation scale" else xs)
            w = linear.weight
            if bug == "weight scales on the wrong rows":
                w = w / codes_scale * codes_scale.flip(0)
            if bug == "one layer's weight scales doubled" and name == "model.layers.1.mlp.down_proj":
                w = w * 2
            return F.linear(xq, w).reshape(*x.shape[:-1], -1)
        return forward

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            module.forward = emulated(module, name)
    runs = []
    for prompt in W8A8_PROMPTS:  # the reference's greedy tokens; ours teacher-forced on them, which
        # equals our greedy run up to its first disagreement (all that `agreement` reads)
        ids = torch.tensor([prompt])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=W8A8_TOKENS, do_sample=False,
                             pad_token_id=0)
        runs.append((seq, len(prompt)))

    def greedy_and_logprobs():
        toks, lps = [], []
        for seq, n in runs:
            lp = model(seq).logits[0, n - 1:-1].float().log_softmax(-1)
            chosen = lp.argmax(-1)
            toks.append(chosen.tolist())
            lps.append(lp.gather(1, chosen[:, None])[:, 0].tolist())
        return toks, lps

    theirs, theirs_lp = greedy_and_logprobs()
    assert theirs == [seq[0, n:].tolist() for seq, n in runs]
    for setting in ({}, {"static": 0.05}, {"bug": "weight scales on the wrong rows"},
                    {"bug": "one layer's weight scales doubled"}, {"bug": "first token's activation scale"}):
        mode.update({"w8a8": True, "static": None, "bug": None, **setting})
        ours, ours_lp = greedy_and_logprobs()
        first, _, deltas = agreement(ours, theirs, ours_lp, theirs_lp)
        print(f"emulated W8A8 {setting}: first tokens agree {first}/{len(W8A8_PROMPTS)}; |delta logprob| mean "
              f"{sum(deltas) / len(deltas):.4f}, max {max(deltas):.4f} over {len(deltas)} tokens")
        assert within_w8a8_bounds(first, deltas) == ("bug" not in setting), setting


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["block", "channel", "tensor-static", "online"])
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_fp8_close_to_the_dequantized_bf16_model(make_checkpoint, tmp_path, kind, eager):
    """W8A8 (_scaled_mm or the Triton block GEMM, FP8 GEMV at one row, CUDA graphs unless eager):
    the chosen tokens' logprobs close to the dequantized model's in bf16, greedy tokens mostly equal."""
    base = w8a8_base(make_checkpoint, tmp_path)
    if kind == "online":
        dst, ref = base, round_tripped(base, str(tmp_path / "ref"))
        options = dict(quantization="fp8")
    else:
        qc = {"block": block_qc([128, 128]), "channel": compressed_qc("channel"),
              "tensor-static": compressed_qc("tensor", static=True)}[kind]
        dst, ref = quantize_checkpoint(base, str(tmp_path / "q"), str(tmp_path / "ref"), qc, kind.split("-")[0],
                                       block=(128, 128))
        options = {}
    compare_on_cuda(dst, ref, options, eager, kind)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["block", "online"])
def test_cuda_fp8_moe_close_to_the_dequantized_bf16_model(tmp_path, kind):
    """FP8 experts in the fused-MoE kernel (weight-only), FP8 linear layers, CUDA graphs."""
    src = build_tiny_moe_checkpoint(str(tmp_path / "moe"), hidden_size=256, moe_intermediate_size=128,
                                    intermediate_size=256, head_dim=64)
    src = confident(src, str(tmp_path / "confident"), MOE_EMBED_SCALE)
    if kind == "online":
        compare_on_cuda(src, round_tripped(src, str(tmp_path / "ref")), dict(quantization="fp8"), False, "moe online")
    else:
        dst, ref = quantize_checkpoint(src, str(tmp_path / "q"), str(tmp_path / "ref"), block_qc([128, 128]),
                                       "block", block=(128, 128))
        compare_on_cuda(dst, ref, {}, False, "moe block")


def compare_on_cuda(dst, ref, options, eager, label):
    """Greedy agreement and |delta logprob| of the chosen tokens, FP8 engine against the dequantized
    model in bf16 (printed: run with -s for the figures)."""
    sp = SamplingParams(temperature=0, max_tokens=W8A8_TOKENS, ignore_eos=True, logprobs=0)
    results = {}
    for path, opts in ((dst, options), (ref, {})):
        # (a fixed pool: with the default gpu_memory_utilization, tests run side by side on one GPU
        # would leave each other no memory)
        llm = LLM(path, dtype="bfloat16", enforce_eager=eager, num_kvcache_blocks=512, **SMALL, **opts)
        try:
            results[path] = llm.generate(W8A8_PROMPTS, sp, use_tqdm=False)
            if path == dst:  # FP8 kept on CUDA: linear layers and experts
                from nanoinfer.layers.fused_moe import ExpertsGateUp
                model = llm.model_runner.model
                assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
                assert all(m.weight.dtype == FP8 for m in model.modules() if isinstance(m, ExpertsGateUp))
        finally:
            llm.exit()
    ours, theirs = results[dst], results[ref]
    # each token's logprob under its own run; the reference's logprob of our token where they agree
    first, same, deltas = agreement([o["token_ids"] for o in ours], [t["token_ids"] for t in theirs],
                                    [[lp[tok].logprob for tok, lp in zip(o["token_ids"], o["logprobs"])] for o in ours],
                                    [[lp[tok].logprob for tok, lp in zip(t["token_ids"], t["logprobs"])]
                                     for t in theirs])
    print(f"{label}, eager={eager}: first tokens agree {first}/{len(W8A8_PROMPTS)}, all {W8A8_TOKENS} tokens "
          f"{same}/{len(W8A8_PROMPTS)}; |delta logprob| mean {sum(deltas) / len(deltas):.4f}, max "
          f"{max(deltas):.4f} over {len(deltas)} tokens")
    assert within_w8a8_bounds(first, deltas), \
        f"outside the W8A8 bounds: first tokens {first} < {MIN_FIRST_AGREE}, or |delta logprob| mean >= " \
        f"{MAX_MEAN_DELTA} or max >= {MAX_DELTA}"


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 64, 300])
@pytest.mark.parametrize("strategy", ["block", "channel"])
def test_cuda_fp8_linear_matches_dequantized_reference(m, strategy):
    """One FP8 layer: the GEMV (m = 1) and W8A8 (_scaled_mm or Triton) against x @ dequantized W in
    float32, within FP8 activation rounding; the same result inside a CUDA graph."""
    from nanoinfer.layers.linear import ReplicatedLinear
    from nanoinfer.layers.model_build import ModelBuild
    from nanoinfer.quant import Fp8Scheme, linear_method_chooser
    from nanoinfer.quant.fp8_math import dequantize
    scheme = Fp8Scheme("block", (128, 128), "weight_scale_inv") if strategy == "block" else Fp8Scheme("channel")
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = ReplicatedLinear(512, 384, build=ModelBuild(linear_method=linear_method_chooser(scheme, {})),
                                     prefix="x.proj")
    finally:
        torch.set_default_dtype(torch.float32)
    w, scale = _fp8_weight(384, 512, strategy, 128)
    layer.weight.data.copy_(w)
    layer.weight_scale_inv.data.copy_(scale) if strategy == "block" else layer.weight_scale.data.copy_(scale)
    layer.method.process_weights_after_loading(layer)
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize(w, scale, 128 if strategy == "block" else 512, torch.float32).cuda().t()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    err = (y.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    layer(static_x)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_y, y)


@pytest.mark.parametrize("m,k,gk", [(3, 96, None), (5, 80, 32), (2, 2048, 128), (1, 64, 16)])
def test_fp8_activation_quant_kernel_matches_torch(m, k, gk):
    from nanoinfer.kernels.fp8_quant import quantize_fp8
    from nanoinfer.quant.fp8_math import quantize_activations
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * 3
    x[0, : min(k, 16)] = 0.0  # an all-zero group takes the minimum scale
    q, s = quantize_fp8(x, gk, out_dtype=torch.float32)  # the e4m3 values before the cast
    q_ref, s_ref = quantize_activations(x, gk)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert q.abs().max() <= FP8_MAX
    assert torch.equal(q.to(FP8).view(torch.uint8), q_ref.view(torch.uint8))
    q8, s8 = quantize_fp8(x, gk)  # the kernel's own cast to float8: exact, its input already e4m3
    assert torch.equal(s8, s_ref) and torch.equal(q8.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("strategy,static,scaled_mm", [("block", False, False), ("channel", False, False),
                                                       ("channel", False, True), ("tensor", True, False),
                                                       ("tensor", True, True)])
def test_fp8_layer_kernel_paths_on_cpu(monkeypatch, strategy, static, scaled_mm):
    """The CUDA-side glue of Fp8LinearMethod run on CPU in the interpreter: weights kept FP8, one row
    through the FP8 GEMV (plain and a Deferred RMSNorm input), a few rows through the W8A16 GEMM
    (activations not quantized; a Deferred RMSNorm input once its prologue rows allow), more than
    W8A16_MAX_ROWS through activation quantization and the Triton W8A8 GEMM or torch._scaled_mm
    (row-wise scales, bf16 out, which torch also runs on CPU); against x @ dequantized W."""
    from nanoinfer.kernels import fp8_quant
    from nanoinfer.layers.linear import MergedColumnParallelLinear
    from nanoinfer.layers.linear_method import Deferred
    from nanoinfer.layers.model_build import ModelBuild
    from nanoinfer.quant import Fp8Scheme, fp8_linear, linear_method_chooser
    from nanoinfer.quant.fp8_math import dequantize, quantize_activations
    monkeypatch.setattr(fp8_linear, "keeps_fp8", lambda device: True)
    monkeypatch.setattr(fp8_linear, "takes_gemv", lambda x: x.shape[0] == 1)
    monkeypatch.setattr(fp8_linear, "scaled_mm_ok", lambda device, n, k: scaled_mm)
    monkeypatch.setattr(fp8_quant, "quantize_fp8", quantize_activations)  # (the interpreter's FP8 cast is wrong)
    scheme = {"block": Fp8Scheme("block", (16, 32), "weight_scale_inv"), "channel": Fp8Scheme("channel"),
              "tensor": Fp8Scheme("tensor", static_input=True)}[strategy]
    layer = MergedColumnParallelLinear(64, [40, 40], build=ModelBuild(linear_method=linear_method_chooser(scheme, {})),
                                       prefix="m.gate_up_proj")
    g = torch.Generator().manual_seed(5)
    dense = []
    for shard in (0, 1):
        w = torch.randn(40, 64, generator=g) * 0.1
        q, scale, full = _quantize(w, strategy, (16, 32))
        layer.weight_loader(layer.weight, q, shard)
        layer.weight_loader(getattr(layer, scheme.scale_name), scale, shard)
        if static:
            layer.weight_loader(layer.input_scale, torch.tensor([0.01 * (shard + 1)]), shard)
        dense.append(q.float() * full)
    layer.method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8 and layer.use_scaled_mm == scaled_mm
    if static:
        assert layer.input_scale.item() == pytest.approx(0.02)  # the larger shard's
    w = torch.cat(dense)
    x = torch.randn(fp8_linear.W8A16_MAX_ROWS + 5, 64, generator=g)
    if static:
        xq = (x / 0.02).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * 0.02
    else:
        xq, xs = quantize_activations(x, 32 if strategy == "block" else None)
        xq = dequantize(xq, xs, 32 if strategy == "block" else 64, torch.float32)
    tol = dict(rtol=1e-2, atol=1e-2) if scaled_mm else dict(rtol=1e-4, atol=1e-4)  # (bf16 out)
    torch.testing.assert_close(layer(x).float(), xq @ w.t(), **tol)
    torch.testing.assert_close(layer(x[:1]), x[:1] @ w.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer(x[:5]), x[:5] @ w.t(), rtol=1e-4, atol=1e-4)  # W8A16
    nw, res = torch.rand(64, generator=g) + 0.5, torch.randn(1, 64, generator=g)
    res_out = torch.empty(1, 64)
    h = x[:1] + res
    normed = nw * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    y = layer(Deferred(x[:1], norm_weight=nw, eps=1e-6, residual=res, residual_out=res_out))
    torch.testing.assert_close(y, normed @ w.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(res_out, h)


@pytest.mark.cuda
@pytest.mark.parametrize("gk", [None, 128])
def test_cuda_activation_quant_kernel(gk):
    from nanoinfer.kernels.fp8_quant import quantize_fp8
    from nanoinfer.quant.fp8_math import dequantize, quantize_activations
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_fp8(x, gk)
    q_ref, s_ref = quantize_activations(x, gk)
    # one definition of the rounding (kernels/fp8_round.py): the same scales and bytes as torch
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    k = gk or 4096
    torch.testing.assert_close(dequantize(q, s, k, torch.float32), x.float(), rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("m,hidden,inter,gk13,gk2", [(7, 64, 40, 32, 16), (3, 48, 40, None, None),
                                                    (20, 96, 64, 32, 32)])
def test_fused_moe_kernel_with_fp8_experts_matches_torch(m, hidden, inter, gk13, gk2):
    """FP8 expert weights (block scales, or per channel when gk is None) in the fused-MoE kernel, in
    the interpreter, against the torch path on the dequantized weights."""
    from nanoinfer.kernels.fused_moe import fused_moe
    from nanoinfer.layers.fused_moe import fused_moe_torch, select_experts
    from nanoinfer.quant.fp8_math import dequantize
    g = torch.Generator().manual_seed(7)
    e, top_k = 6, 2
    gk13, gk2 = gk13 or hidden, gk2 or inter
    w13 = torch.randn(e, 2 * inter, hidden, generator=g).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    w2 = torch.randn(e, hidden, inter, generator=g).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    s13 = torch.rand(e, 2 * inter, -(-hidden // gk13), generator=g) * 0.02 + 0.01
    s2 = torch.rand(e, hidden, -(-inter // gk2), generator=g) * 0.02 + 0.01
    x = torch.randn(m, hidden, generator=g)
    weights, ids = select_experts(torch.randn(m, e, generator=g), top_k, True)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, group_k13=gk13, group_k2=gk2)
    ref = fused_moe_torch(x, dequantize(w13, s13, gk13, torch.float32), dequantize(w2, s2, gk2, torch.float32),
                          weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_fused_moe_layer_keeps_fp8_experts_where_the_kernel_runs(monkeypatch):
    """FusedMoE with FP8 experts, kept FP8 as on CUDA (monkeypatched, kernel in the interpreter): its
    output matches the same layer dequantized (the CPU path)."""
    from nanoinfer.layers.fused_moe import FusedMoE
    from nanoinfer.layers.model_build import ModelBuild
    from nanoinfer.quant import Fp8Scheme, fp8_linear, linear_method_chooser
    scheme = Fp8Scheme("block", (16, 32), "weight_scale_inv")
    g = torch.Generator().manual_seed(11)
    e, hidden, inter = 4, 64, 48
    tensors = {}
    for i in range(e):
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors[i, part] = _quantize(torch.randn(*shape, generator=g) * 0.1, "block", (16, 32))[:2]
    router = torch.randn(e, hidden, generator=g)

    def build():
        layer = FusedMoE(e, 2, hidden, inter, True, build=ModelBuild(linear_method=linear_method_chooser(scheme, {})),
                         prefix="model.layers.0.mlp")
        layer.gate.weight.data.copy_(router)
        gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
        for i in range(e):
            for j, part in enumerate(("gate", "up")):
                q, s = tensors[i, part]
                gu.weight_loader(gu.weight, q, (i, j))
                gu.weight_loader(gu.weight_scale_inv, s, (i, j))
            q, s = tensors[i, "down"]
            dn.weight_loader(dn.weight, q, i)
            dn.weight_loader(dn.weight_scale_inv, s, i)
        gu.process_weights_after_loading()
        dn.process_weights_after_loading()
        return layer

    dequantized = build()
    assert dequantized.experts.gate_up_proj.weight.dtype == torch.float32
    monkeypatch.setattr(fp8_linear, "keeps_fp8", lambda device: True)
    kept = build()
    assert kept.experts.gate_up_proj.weight.dtype == FP8 and kept.experts.down_proj.scale.shape == (e, hidden, 2)
    x = torch.randn(9, hidden, generator=g)
    torch.testing.assert_close(kept(x), dequantized(x), rtol=1e-4, atol=1e-4)


def test_checkpoint_kv_cache_scales_reach_the_attention_layers(base, tmp_path):
    """compressed-tensors' `self_attn.k_proj.k_scale` and the older `self_attn.v_scale` load into
    `self_attn.attn.k_scale` / `v_scale`."""
    from nanoinfer.config import Config
    from nanoinfer.layers.attention_backend import TorchAttentionBackend
    from nanoinfer.models.build import build_model
    extra = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor([0.5]),
             "model.layers.1.self_attn.v_scale": torch.tensor(0.25)}
    dst, _ = quantize_checkpoint(base, str(tmp_path / "q"), str(tmp_path / "ref"), compressed_qc("channel"),
                                 "channel", extra=extra)
    model = build_model(Config(dst, device="cpu"), 0, 1, torch.device("cpu"), TorchAttentionBackend())
    attn0, attn1 = model.model.layers[0].self_attn.attn, model.model.layers[1].self_attn.attn
    assert attn0.k_scale.item() == 0.5 and attn0.v_scale.item() == 1.0
    assert attn1.v_scale.item() == 0.25 and attn1.k_scale.item() == 1.0

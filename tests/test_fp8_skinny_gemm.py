"""The W8A16 few-row GEMM (kernels/fp8_skinny_gemm.py): FP8 weights with per-channel or block scales
times unquantized activations, plain, split over K, with its RMSNorm / SiLU*mul prologues, against
x @ the dequantized weight in torch: under TRITON_INTERPRET=1 on CPU (float32), and on a GPU
(bfloat16, float16) at odd shapes and at the 8B shapes with the configs the layer picks, in a CUDA
graph too. Also its config rules, and its refusals."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels import fp8_skinny_gemm as fsg
from nanoinfer.kernels.fp8_skinny_gemm import candidate_configs, default_config, fp8_skinny_gemm
from nanoinfer.layers.activation import silu_and_mul
from nanoinfer.layers.layernorm import add_rms_norm
from nanoinfer.quant.fp8_math import dequantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.cuda] if DEV == "cuda" else []  # (on a GPU every test runs there: `pytest -m cuda`)
FP8 = torch.float8_e4m3fn
# (M, N, K, group_k or None for one scale column, config): row, feature and K tails; K split in two,
# three (uneven, the last split short), none; block scales with several K tiles a group
CASES = [(3, 40, 96, None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
         (8, 64, 256, 64, dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)),
         (5, 48, 392, None, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3)),
         (17, 20, 160, 32, dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=3)),
         (2, 24, 80, 48, dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=1))]


def dtypes():  # (bfloat16 is wrong in the interpreter, for the dense kernels too)
    return [torch.bfloat16, torch.float16] if DEV == "cuda" else [torch.float32, torch.float16]


def config(m, cfg):
    return dict(cfg, BLOCK_M=fsg.block_rows(m), num_warps=4, num_stages=2)


def fp8_weight(n, k, gk, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)  # (made on the device: the 8B shapes are large)
    w = (torch.randn(n, k, generator=g, device=DEV) * 64).clamp(-448, 448).to(FP8)
    scale = torch.rand(n, 1 if gk is None else -(-k // gk), generator=g, device=DEV) * 0.002 + 0.001
    return w, scale, k if gk is None else gk


def reference(x, w, scale, gk, bias=None):
    return F.linear(x.float(), dequantize(w, scale, gk, torch.float32), None if bias is None else bias.float())


def assert_close(out, ref, dtype):
    """Equal up to summation order and the scales' placement, plus one rounding of the output in 16 bits."""
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("m, n, k, gk, cfg", CASES)
@pytest.mark.parametrize("dtype", dtypes())
def test_plain_bias_out_and_repeat(m, n, k, gk, cfg, dtype):
    w, scale, gk = fp8_weight(n, k, gk, n + k)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype)
    for _ in range(2):  # the split-K arrival counters are back at zero after a call
        assert_close(fp8_skinny_gemm(x, w, scale, gk, config=config(m, cfg)), reference(x, w, scale, gk), dtype)
    assert_close(fp8_skinny_gemm(x, w, scale, gk, bias, config=config(m, cfg)), reference(x, w, scale, gk, bias),
                 dtype)
    out = torch.empty(m + 3, n, dtype=dtype, device=DEV)[:m]
    assert fp8_skinny_gemm(x, w, scale, gk, out=out, config=config(m, cfg)) is out
    assert_close(out, reference(x, w, scale, gk), dtype)
    wide = torch.zeros(m, k + 8, dtype=dtype, device=DEV)  # rows with a stride: a slice of a wider buffer
    wide[:, :k] = x
    assert_close(fp8_skinny_gemm(wide[:, :k], w, scale, gk, config=config(m, cfg)), reference(x, w, scale, gk),
                 dtype)


@pytest.mark.parametrize("m, n, k, gk, cfg", CASES[:3])
@pytest.mark.parametrize("dtype", dtypes())
def test_prologues(m, n, k, gk, cfg, dtype):
    """RMSNorm with the residual add (the new residual stored as torch rounds it) and SiLU * mul."""
    w, scale, gk = fp8_weight(n, k, gk, 3 * n + k)
    g = torch.Generator().manual_seed(k)
    x, res = (torch.randn(m, k, generator=g) * 2).to(DEV, dtype), torch.randn(m, k, generator=g).to(DEV, dtype)
    nw = (torch.rand(k, generator=g) + 0.5).to(DEV, dtype)
    res_out = torch.empty_like(res)
    y = fp8_skinny_gemm(x, w, scale, gk, norm_weight=nw, eps=1e-6, residual=res, residual_out=res_out,
                        config=config(m, cfg))
    normed, new_res = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(res_out, new_res)
    assert_close(y, reference(normed, w, scale, gk), dtype)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 4).to(DEV, dtype)
    assert_close(fp8_skinny_gemm(gate_up, w, scale, gk, silu_mul=True, config=config(m, cfg)),
                 reference(silu_and_mul(gate_up), w, scale, gk), dtype)


@pytest.mark.parametrize("by_bits", [True, False])
def test_every_fp8_code_reads_exactly(monkeypatch, by_bits):
    """One-hot rows read back weights holding every finite e4m3 code: each value exact (bfloat16 holds
    every e4m3 value), through the bit-moving bfloat16 conversion and through Triton's (on CPU: float32,
    Triton's conversion either way)."""
    monkeypatch.setattr(fsg, "BF16_BY_BITS", by_bits)
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # (the two NaN codes)
    w = codes[(torch.arange(256)[:, None] + torch.arange(256)[None, :]) % 256].view(FP8).to(DEV)  # row n: codes n..
    dtype = dtypes()[0]
    x = torch.eye(16, 256, dtype=dtype, device=DEV)
    y = fp8_skinny_gemm(x, w, torch.ones(256, 1, device=DEV), 256,
                        config=config(16, dict(BLOCK_N=64, BLOCK_K=64, SPLIT_K=1)))
    assert torch.equal(y.float(), w.float()[:, :16].t())


@pytest.mark.skipif(DEV == "cuda", reason="a CPU-only check: on a GPU the CUDA tests compile and run the kernel")
def test_the_kernel_compiles_for_hopper_without_a_gpu():
    """sm_90a code for four variants (both bfloat16 conversions, block scales, the prologues, split-K,
    float16) from Triton's compiler and ptxas, outside the interpreter: each uses the tensor cores and
    pipelines its loads. Skipped where Triton's NVIDIA backend or its ptxas is missing."""
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    if not os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")):
        pytest.skip("no ptxas in Triton's NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "hopper_compile.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == 4 and all("mma=none" not in line and "async_copies=0" not in line for line in lines)


def test_default_and_candidate_configs_tile_the_8b_shapes():
    """Every config the rule or the benchmark picks tiles the rows and the scale groups, and the rule
    gives every SM at least one program at each 8B projection (K split where features are few)."""
    for m in (2, 8, 16, 33, 64, 128):
        for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (28672, 4096), (4096, 14336)):
            for kb, gk in ((1, k), (-(-k // 128), 128)):
                cfg = default_config(m, n, k, kb, gk, sms=132)
                programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
                assert cfg["BLOCK_M"] >= m and gk % cfg["BLOCK_K"] == 0 and programs >= 132, (m, n, k, cfg)
                cands = candidate_configs(m, n, k, kb, gk)
                assert len(cands) >= 12 and all(c["BLOCK_M"] >= m and gk % c["BLOCK_K"] == 0 for c in cands)
    assert default_config(8, 4096, 12288, 1, 12288)["SPLIT_K"] > 1  # down_proj: few output tiles


def test_config_for_prefers_the_tuned_table(monkeypatch):
    tuned = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3)
    monkeypatch.setattr(fsg, "TUNED", {(16, 4096, 4096, False): tuned, (16, 4096, 4096, True): tuned})
    cpu = torch.device("cpu")
    assert fsg.config_for(9, 4096, 4096, 1, 4096, cpu) == tuned
    assert fsg.config_for(17, 4096, 4096, 1, 4096, cpu) == default_config(17, 4096, 4096, 1, 4096)  # other bucket
    assert fsg.config_for(9, 4096, 4096, 32, 128, cpu)["BLOCK_K"] == 128  # 256 does not divide the groups


def test_bad_inputs_are_refused():
    w, scale, gk = fp8_weight(32, 64, None, 0)
    x = torch.zeros(4, 64, device=DEV)
    with pytest.raises(ValueError, match="rows"):
        fp8_skinny_gemm(torch.zeros(fsg.MAX_ROWS + 1, 64, device=DEV), w, scale, gk)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_skinny_gemm(x, w.float(), scale, gk)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_skinny_gemm(x, w, scale[:, :0], gk)
    with pytest.raises(ValueError, match="x must be"):
        fp8_skinny_gemm(x.to(torch.int32), w, scale, gk)
    with pytest.raises(ValueError, match="power-of-two"):
        fp8_skinny_gemm(x, w, torch.ones(32, 8, device=DEV), 8)
    with pytest.raises(ValueError, match="does not tile"):
        fp8_skinny_gemm(torch.zeros(20, 64, device=DEV), w, scale, gk, config=config(8, CASES[0][-1]))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [2, 37, 64, 128])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("gk", [None, 128])
def test_cuda_8b_shapes_with_the_chosen_configs(monkeypatch, m, n, k, gk):
    """The 8B projections with the layer's configs (bfloat16, and float16 at one size), eager and replayed
    from a CUDA graph (the split-K counters survive replays); bfloat16 through both FP8 conversions,
    the same result bit for bit."""
    w, scale, gk = fp8_weight(n, k, gk, m + n)
    for dtype in (torch.bfloat16,) + ((torch.float16,) if m == 2 else ()):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        ref = reference(x, w, scale, gk)
        y = fp8_skinny_gemm(x, w, scale, gk)
        assert_close(y, ref, dtype)
        if dtype == torch.bfloat16:
            monkeypatch.setattr(fsg, "BF16_BY_BITS", not fsg.BF16_BY_BITS)
            assert torch.equal(fp8_skinny_gemm(x, w, scale, gk), y)
            monkeypatch.undo()
        static_x = x.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = fp8_skinny_gemm(static_x, w, scale, gk)
        for _ in range(2):
            graph.replay()
        torch.testing.assert_close(static_y, y, rtol=0, atol=0)  # deterministic split-K


# ------------------------------------------------------------------ the layer's choice (quant/fp8_linear.py)
def fp8_layer(strategy, device):
    """A MergedColumnParallelLinear(64 -> 2 x 40) with FP8 weights (block scales 16 x 32 or per channel)
    and its dequantized float32 weight."""
    from nanoinfer.layers.linear import MergedColumnParallelLinear
    from nanoinfer.layers.model_build import ModelBuild
    from nanoinfer.quant import Fp8Scheme, linear_method_chooser
    scheme = Fp8Scheme("block", (16, 32), "weight_scale_inv") if strategy == "block" else Fp8Scheme("channel")
    with torch.device(device):
        layer = MergedColumnParallelLinear(64, [40, 40], prefix="m.gate_up_proj",
                                           build=ModelBuild(linear_method=linear_method_chooser(scheme, {})))
    g = torch.Generator().manual_seed(5)
    for shard in (0, 1):
        w = (torch.randn(40, 64, generator=g) * 64).clamp(-448, 448).to(FP8)
        scale = torch.rand(40, 2 if strategy == "block" else 1, generator=g) * 0.002 + 0.001
        scale = scale[::16].contiguous() if strategy == "block" else scale  # checkpoint blocks: [ceil(40/16), 2]
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(getattr(layer, scheme.scale_name), scale, shard)
    kept = layer.weight.data.clone()
    scales = getattr(layer, scheme.scale_name).data.clone()
    layer.method.process_weights_after_loading(layer)
    return layer, dequantize(kept, scales, 32 if strategy == "block" else 64, torch.float32).to(device)


def counting(monkeypatch):
    """Which kernels the FP8 layer calls: its GEMV, the W8A16 GEMM, or W8A8 (activation quantization)."""
    from nanoinfer.kernels import fp8_quant
    from nanoinfer.quant import fp8_linear
    from nanoinfer.quant.fp8_math import quantize_activations
    calls = []

    def counted(name, fn):
        def run(*args, **kwargs):
            calls.append((name, args[0].shape[0]))
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(fp8_linear, "fp8_gemv", counted("gemv", fp8_linear.fp8_gemv))
    monkeypatch.setattr(fp8_linear, "fp8_skinny_gemm", counted("w8a16", fp8_linear.fp8_skinny_gemm))
    # (on CPU the torch quantization: the interpreter's FP8 cast is wrong)
    quant = fp8_quant.quantize_fp8 if DEV == "cuda" else lambda x, gk: quantize_activations(x, gk)
    monkeypatch.setattr(fp8_quant, "quantize_fp8", counted("w8a8", quant))
    return calls


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_the_fp8_layer_takes_w8a16_from_two_rows_to_the_threshold(monkeypatch, strategy):
    """On CUDA (on CPU: FP8 kept as on CUDA, kernels in the interpreter): one row through the GEMV, 2 to
    W8A16_MAX_ROWS rows through W8A16 (x @ dequantized W, no activation rounding), more through W8A8;
    a Deferred RMSNorm input is taken by W8A16 only up to W8A16_PROLOGUE_MAX_ROWS rows."""
    from nanoinfer.layers.linear_method import Deferred
    from nanoinfer.quant import fp8_linear
    if DEV == "cpu":
        monkeypatch.setattr(fp8_linear, "keeps_fp8", lambda device: True)
        monkeypatch.setattr(fp8_linear, "takes_gemv", lambda x: x.shape[0] == 1 and x.is_contiguous())
    layer, w = fp8_layer(strategy, DEV)
    assert layer.weight.dtype == FP8
    calls = counting(monkeypatch)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    top = fp8_linear.W8A16_MAX_ROWS
    x = torch.randn(top + 1, 64, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    for m in (1, 2, top):
        assert_close(layer(x[:m]), F.linear(x[:m].float(), w), dtype)
    layer(x)
    assert calls == [("gemv", 1), ("w8a16", 2), ("w8a16", top), ("w8a8", top + 1)]
    monkeypatch.setitem(fp8_linear.W8A16_MAX_ROWS_BY_SHAPE, tuple(layer.weight.shape), top + 1)
    layer(x)  # a weight shape measured faster under W8A16 up to more rows takes it up to those
    assert calls[-1] == ("w8a16", top + 1)
    monkeypatch.delitem(fp8_linear.W8A16_MAX_ROWS_BY_SHAPE, tuple(layer.weight.shape))
    nw, res = torch.rand(64, device=DEV, dtype=dtype) + 0.5, torch.randn(3, 64, device=DEV, dtype=dtype)
    assert not layer.method.takes_deferred(layer, x[:3])  # (off by default)
    monkeypatch.setattr(fp8_linear, "W8A16_PROLOGUE_MAX_ROWS", 4)
    assert layer.method.takes_deferred(layer, x[:3]) and not layer.method.takes_deferred(layer, x[:5])
    res_out = torch.empty_like(res)
    y = layer(Deferred(x[:3], norm_weight=nw, eps=1e-6, residual=res, residual_out=res_out))
    normed, new_res = add_rms_norm(x[:3], res, nw, 1e-6)
    assert torch.equal(res_out, new_res) and calls[-1] == ("w8a16", 3)
    assert_close(y, F.linear(normed.float(), w), dtype)


@pytest.mark.skipif(DEV == "cuda", reason="the CPU path")
def test_on_cpu_the_fp8_layer_stays_dequantized_dense(monkeypatch):
    """CPU: weights dequantized at load, every row count a dense product; no FP8 kernel runs."""
    from nanoinfer.quant import fp8_linear
    layer, w = fp8_layer("channel", "cpu")
    calls = counting(monkeypatch)
    assert layer.weight.dtype == torch.float32
    x = torch.randn(9, 64)
    assert not fp8_linear.takes_w8a16(x)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=0, atol=0)
    assert calls == []

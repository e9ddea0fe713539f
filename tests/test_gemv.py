"""The GEMV kernel (kernels/gemv.py), one row and a few, plain and with its RMSNorm / SiLU*mul
prologues, against the torch path it replaces: under TRITON_INTERPRET=1 on CPU (float32, float16),
and on a GPU (bfloat16, float32) at the 0.6B shapes too; and linear()'s use of it and of the
few-row kernels, with a Deferred input's pending step."""
import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels.gemv import MAX_ROWS, gemv
from nanoinfer.layers import linear_method
from nanoinfer.layers.activation import silu_and_mul
from nanoinfer.layers.layernorm import add_rms_norm, rms_norm
from nanoinfer.layers.linear_method import Deferred, linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(40, 96), (7, 1000), (130, 64), (12, 2500)]  # (N, K): tails in both dimensions, several K tiles
if DEV == "cuda":
    SHAPES += [(4096, 1024), (1024, 2048), (1024, 3072)]
ROWS = [1, 2, 3]  # (3: a padded rows tile)


def dtypes():
    return [torch.bfloat16, torch.float32] if DEV == "cuda" else [torch.float32, torch.float16]


def assert_close(out, ref, dtype):
    """Equal up to summation order, plus one rounding of the output in 16 bits."""
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


def tensors(n, k, dtype, seed, m=1):
    """x [m, k] (several rows: strided, a slice of wider rows), w, bias, residual [m, k], norm weight."""
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)  # noqa: E731
    x = make(m, k, scale=3) if m == 1 else make(m, k + 8, scale=3)[:, :k]
    return x, make(n, k, scale=k ** -0.5), make(n), make(m, k), (torch.rand(k, generator=g) + 0.5).to(DEV, dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("m", ROWS)
def test_plain_and_bias(n, k, dtype, m):
    x, w, b, _, _ = tensors(n, k, dtype, n + k, m)
    assert_close(gemv(x, w), F.linear(x.float(), w.float()), dtype)
    assert_close(gemv(x, w, b), F.linear(x.float(), w.float(), b.float()), dtype)
    out = torch.empty(m, n, dtype=dtype, device=DEV)
    assert gemv(x, w, out=out) is out  # (tensor parallel: straight into the all-reduce's buffer)
    assert_close(out, F.linear(x.float(), w.float()), dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("m", ROWS)
def test_rms_norm_prologue(n, k, dtype, m):
    """y = add_rms_norm(x, residual) @ W^T, and the new residual stored exactly as torch rounds it."""
    x, w, _, res, nw = tensors(n, k, dtype, 2 * n + k, m)
    out = torch.empty_like(res)
    y = gemv(x, w, norm_weight=nw, eps=1e-6, residual=res, residual_out=out)
    normed, ref_res = add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(out, ref_res)
    assert_close(y, F.linear(normed.float(), w.float()), dtype)
    assert_close(gemv(x, w, norm_weight=nw, eps=1e-6), F.linear(rms_norm(x, nw, 1e-6).float(), w.float()), dtype)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("m", ROWS)
def test_silu_mul_prologue(n, k, dtype, m):
    g = torch.Generator().manual_seed(n * k)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 4).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    assert_close(gemv(gate_up, w, silu_mul=True), F.linear(silu_and_mul(gate_up).float(), w.float()), dtype)


def test_bad_shapes_are_refused():
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 16, device=DEV), w)
    with pytest.raises(ValueError, match="contiguous features"):
        gemv(torch.zeros(1, 16, device=DEV), w, silu_mul=True)
    with pytest.raises(ValueError, match="contiguous features"):
        gemv(torch.zeros(2, 32, device=DEV)[:, ::2], w)
    x, nw, res = torch.zeros(1, 16, device=DEV), torch.ones(16, device=DEV), torch.zeros(1, 16, device=DEV)
    with pytest.raises(ValueError, match="residual_out"):
        gemv(x, w, norm_weight=nw, residual=res)
    with pytest.raises(ValueError, match="must not share memory"):
        gemv(x, w, norm_weight=nw, residual=res, residual_out=res)
    with pytest.raises(ValueError, match="norm_weight must be"):
        gemv(x, w, norm_weight=torch.ones(8, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        gemv(torch.zeros(2, 16, device=DEV), w, out=torch.empty(1, 8, device=DEV))


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("residual", [False, True])
def test_a_deferred_input_without_a_fusing_kernel_runs_its_step_first(m, residual):
    """linear() on a Deferred input that no fusing kernel takes (CPU; or cuBLAS's rows and
    weights) applies the pending norm or SiLU * mul on its own: the same product and new residual
    as the unfused path."""
    x, w, b, res, nw = tensors(24, 40, torch.float32, m, m)
    x = x.contiguous()
    out = torch.empty_like(res)
    d = Deferred(x, nw, 1e-6, res, out) if residual else Deferred(x, nw, 1e-6)
    normed, new_res = add_rms_norm(x, res, nw, 1e-6) if residual else (rms_norm(x, nw, 1e-6), None)
    torch.testing.assert_close(linear(d, w, b), F.linear(normed, w, b))
    if residual:
        assert torch.equal(out, new_res)
    gate_up = torch.randn(m, 80, device=DEV)
    torch.testing.assert_close(linear(Deferred(gate_up, silu_mul=True), w), F.linear(silu_and_mul(gate_up), w))


@pytest.mark.cuda
@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
def test_few_row_routing_by_rows_and_weight_size():
    """2 rows of a small weight: the GEMV; up to 16 rows of one up to 32 MiB: the few-row GEMM;
    beyond either, or float32: cuBLAS. A Deferred goes where its rows would, and is fused there."""
    x = lambda m: torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    small = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16)  # 8 MiB
    mid = torch.randn(16384, 1024, device=DEV, dtype=torch.bfloat16)  # 32 MiB
    big = torch.randn(16400, 1024, device=DEV, dtype=torch.bfloat16)
    few = linear_method.few_row_kernel
    assert few(x(2), small) is gemv and few(x(3), small) is linear_method.skinny_gemm
    assert few(x(2), mid) is linear_method.skinny_gemm and few(x(16), mid) is linear_method.skinny_gemm
    assert few(x(17), small) is None and few(x(2), big) is None and few(x(1), small) is None
    assert few(x(4).float(), small.float()) is None
    for m in (2, 8):
        xm, res, nw = x(m), x(m), torch.rand(1024, device=DEV, dtype=torch.bfloat16) + 0.5
        out = torch.empty_like(res)
        assert linear_method.fuses_prologue(xm, small)
        y = linear(Deferred(xm, nw, 1e-6, res, out), small)
        normed, new_res = add_rms_norm(xm, res, nw, 1e-6)
        assert torch.equal(out, new_res)
        assert_close(y, F.linear(normed.float(), small.float()), torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on a CPU-only host; on a GPU the "
                    "one-row path runs for real (tests/test_gpu.py)")
@pytest.mark.parametrize("arch", ["qwen3-bias", "llama-mlp-bias", "qwen3-moe-dense-and-sparse"])
def test_one_row_steps_through_the_gemv_match_hf(make_checkpoint, tmp_path, monkeypatch, arch):
    """The engine's one-row path (every projection and the LM head through the GEMV, the norms and
    SiLU*mul deferred into it) end to end against HF, here on CPU under the interpreter: the rule
    that routes one-row CUDA inputs to the GEMV is widened to CPU inputs."""
    from hf_reference import assert_greedy_matches_hf
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.layers import linear_method
    from nanoinfer.utils.tiny_moe import build_tiny_moe_checkpoint
    if arch == "qwen3-moe-dense-and-sparse":
        path = build_tiny_moe_checkpoint(str(tmp_path), num_layers=2, mlp_only_layers=(0,))
    else:
        path = make_checkpoint(arch=arch.split("-")[0], attention_bias=True, mlp_bias=arch.startswith("llama"))
    calls = []

    def counted_gemv(*args, **kwargs):
        calls.append(kwargs.get("norm_weight") is not None or kwargs.get("silu_mul", False))
        return gemv(*args, **kwargs)

    monkeypatch.setattr(linear_method, "takes_gemv", lambda x: x.shape[0] == 1 and x.is_contiguous())
    monkeypatch.setattr(linear_method, "gemv", counted_gemv)
    llm = LLM(path, device="cpu", kvcache_block_size=16, max_model_len=128, max_num_seqs=1)
    try:
        prompts = [[5]]  # a one-token prompt: its prefill takes the GEMV too (the interpreter is slow)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(path, p, o["token_ids"])
    finally:
        llm.exit()
    assert len(calls) >= 5 * 3 and any(calls), "the one-row steps did not go through the (fused) GEMV"


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on a CPU-only host; on a GPU the "
                    "few-row path runs for real (tests/test_gpu.py)")
def test_few_row_steps_through_the_fused_kernels_match_hf(make_checkpoint, monkeypatch):
    """Steps of 2 and 3 rows through the few-row kernels (the GEMV at two rows, the few-row GEMM
    at three), the norms and SiLU*mul deferred into them, end to end against HF, on CPU under the
    interpreter: the few-row rule is widened to CPU float32 inputs."""
    from hf_reference import assert_greedy_matches_hf
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.kernels.skinny_gemm import skinny_gemm
    path = make_checkpoint(arch="qwen3", attention_bias=True)
    fused = []

    def counted(kernel):
        def run(*args, **kwargs):
            fused.append((kernel.__name__, args[0].shape[0], kwargs.get("norm_weight") is not None
                          or kwargs.get("silu_mul", False)))
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(linear_method, "few_row_kernel", lambda x, w: None if not 2 <= x.shape[0] <= 16 else
                        counted(gemv) if x.shape[0] == 2 else counted(skinny_gemm))
    llm = LLM(path, device="cpu", kvcache_block_size=16, max_model_len=128, max_num_seqs=3)
    try:
        prompts = [[5], [7], [11]]  # one-token prompts: three rows, then two once one has finished
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 4, 4)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(path, p, o["token_ids"])
    finally:
        llm.exit()
    for kernel, rows in (("gemv", 2), ("skinny_gemm", 3)):
        assert any(k == kernel and m == rows and prologue for k, m, prologue in fused), \
            f"no {rows}-row step went through the fused {kernel}"

"""Compile the W8A16 GEMM (kernels/fp8_skinny_gemm.py) for Hopper (sm_90a) ahead of time, on a machine
without a GPU (Triton's own ptxas): run as a script, outside the Triton interpreter, by
tests/test_fp8_skinny_gemm.py. Prints one line a variant: its shared memory, the MMA it uses and
whether its loads are pipelined (asynchronous copies), or why it failed."""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanoinfer.kernels import fp8_skinny_gemm as fsg

# (dtype, BF16_BITS, BLOCK_SCALES, PROLOGUE, HAS_RES, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
VARIANTS = [("bf16", True, False, 0, False, False, True, 16, 64, 128, 4, 4),
            ("bf16", False, False, 0, False, False, False, 16, 32, 256, 4, 4),
            ("bf16", True, True, 1, True, True, True, 64, 128, 128, 8, 4),
            ("fp16", False, False, 2, False, False, True, 128, 32, 128, 4, 3)]
# integers Triton finds divisible by 16 at the 8B shapes' launches (M, SPLIT_K and KB it is told not to look at)
DIVISIBLE = ("stride_x", "stride_y", "stride_r", "N", "K", "K_SPLIT")


def compile_variant(dt, bits, block_scales, prologue, has_res, bias, split, bm, bn, bk, warps, stages):
    sig = {"x_ptr": f"*{dt}", "stride_x": "i32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": f"*{dt}",
           "y_ptr": f"*{dt}", "stride_y": "i32", "res_ptr": f"*{dt}", "stride_r": "i32", "res_out_ptr": f"*{dt}",
           "nw_ptr": f"*{dt}", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "K_SPLIT": "i32", "SPLIT_K": "i32", "KB": "i32", "eps": "fp32"}
    const = dict(BLOCK_SCALES=block_scales, GROUP_K=128 if block_scales else 1, PROLOGUE=prologue, HAS_RES=has_res,
                 HAS_BIAS=bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, PRECISION="tf32", BF16_BITS=bits,
                 PDL=True)
    sig.update({name: "constexpr" for name in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(sig.items())
             if t.startswith("*") or name in DIVISIBLE}
    kernel = triton.compile(ASTSource(fsg._fp8_skinny_gemm_kernel, sig, const, attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return kernel.metadata.shared, mma, kernel.asm["ttgir"].count("async_copy_global_to_local")


if __name__ == "__main__":
    for v in VARIANTS:
        try:
            shared, mma, copies = compile_variant(*v)
            print(f"ok {v} shared={shared} mma={mma} async_copies={copies}", flush=True)
        except Exception as e:  # (printed for the test to show)
            print(f"FAILED {v}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            sys.exit(1)

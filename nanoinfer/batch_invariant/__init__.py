"""Batch-invariant inference (vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference):
with Config.batch_invariant, a request's tokens and logprobs are bitwise the same whether it runs
alone or in any batch, after a prefix-cache hit or not, however its prompt is chunked.

Chosen once when the model is built (models/build.py):
    options.py     the option, its environment variable, and what it refuses
    linear.py      every linear layer and the LM head: fixed-size row chunks on CPU (the MoE
                   experts' products too: ModelBuild.rows_product), the no-split-K GEMM on CUDA
                   (kernels/invariant_matmul.py)
    attention.py   attention over the paged cache in fixed KV blocks at absolute positions (on
                   CUDA the Triton prefill kernel with one config for every step)

RMSNorm, the activation, q/k norm with RoPE, the sampling kernel and the logits' log-softmax
reduce within one row, the same way whatever the number of rows (tests/test_batch_invariant.py
checks the whole engine), so they are left as they are.
"""
from nanoinfer.batch_invariant.attention import invariant_attention_backend
from nanoinfer.batch_invariant.linear import InvariantLinearMethod, fixed_rows, invariant_chooser
from nanoinfer.batch_invariant.options import resolve_batch_invariant

__all__ = ["InvariantLinearMethod", "fixed_rows", "invariant_attention_backend", "invariant_chooser",
           "resolve_batch_invariant"]

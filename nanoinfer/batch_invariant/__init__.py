"""Batch-invariant inference (vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference):
with Config.batch_invariant, a request's tokens and logprobs are bitwise the same whether it runs
alone or in any batch, after a prefix-cache hit or not, however its prompt is chunked.

Chosen once when the model is built (models/build.py):
    options.py     the option, its environment variable, and what it refuses
    linear.py      every linear layer and the LM head multiply in fixed-size row chunks
    attention.py   attention over the paged cache in fixed KV blocks at absolute positions

RMSNorm, the activation and the logits' log-softmax reduce within one row, which torch already
does the same way whatever the number of rows (tests/test_batch_invariant.py checks it), so they
are left as they are. CPU only for now: CUDA needs kernels of its own (docs/batch-invariant.md).
"""
from nanoinfer.batch_invariant.attention import BatchInvariantAttentionBackend
from nanoinfer.batch_invariant.linear import FixedRowsLinearMethod, fixed_rows_chooser
from nanoinfer.batch_invariant.options import resolve_batch_invariant

__all__ = ["BatchInvariantAttentionBackend", "FixedRowsLinearMethod", "fixed_rows_chooser", "resolve_batch_invariant"]

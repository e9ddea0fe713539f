"""Fuse small elementwise chains (norms, RoPE, SiLU*mul) with torch.compile on CUDA tensors.

On the GPU each of these would otherwise be 5-10 tiny kernels per layer, which costs both device
time and CUDA-graph launch time (one graph node per kernel). On CPU the plain eager function runs:
tests stay fast and need no compiler.
"""
import functools

import torch


def compile_on_cuda(fn):
    compiled = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args):
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args)

    return wrapper

"""Sampling micro-benchmark: the logits pipeline (sampling/pipeline.py) on 256 sequences x 151,936
vocabulary (Qwen3), plain temperature sampling versus every feature on (penalties over 1k-token
histories, top-k, top-p, min-p, min_tokens, seeds, logprobs). Times the device work
(the plan and its tensors, sampling_options.tensors_for, on the host are timed separately).

    python3 -m nanoinfer.bench.sampler [--batch 256] [--vocab 151936] [--history 1024] [--device cuda|cpu]
"""
import argparse
import time

import torch

from nanoinfer.sampling.pipeline import logprobs_to_host, sample_logits
from nanoinfer.sampling_options import default_options, tensors_for
from nanoinfer.sampling_params import SamplingParams


class FakeSeq:
    def __init__(self, sp, prompt_len, output_len, vocab, gen):
        ids = torch.randint(0, vocab, (prompt_len + output_len,), generator=gen).tolist()
        self.sampling_params, self.token_ids, self.num_prompt_tokens = sp, ids, prompt_len
        self.num_inflight = 0

    @property
    def num_completion_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


def timeit(fn, device, iters):
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def to_host(logits, t):
    """A whole step's sampling: the plan's tensors, the pipeline, its tokens and logprobs on the host."""
    tokens, lp = sample_logits(logits, t)
    return tokens.tolist(), None if lp is None else logprobs_to_host(t, tokens.shape[0], lp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--history", type=int, default=1024, help="prompt + output tokens per sequence")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=0, help="0: 50 on CUDA, 3 on CPU")
    args = ap.parse_args()
    device = torch.device(args.device)
    iters = args.iters or (50 if device.type == "cuda" else 3)
    B, V = args.batch, args.vocab
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, V, generator=gen) * 3).to(device, getattr(torch, args.dtype))
    eos = (151645, 151643)
    half = args.history // 2
    configs = {
        "greedy": [SamplingParams(temperature=0)] * B,
        "plain temperature": [SamplingParams(temperature=0.8)] * B,
        "top_k=50 only": [SamplingParams(temperature=0.8, top_k=50)] * B,
        "top_p=0.9 only": [SamplingParams(temperature=0.8, top_p=0.9)] * B,
        "all features on": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                                           frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=half + 10, max_tokens=None,
                                           stop_token_ids=[11, 13], seed=i, logprobs=5) for i in range(B)],
        "all on, half the rows": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                                                 frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=half + 10, max_tokens=None,
                                                 seed=i, logprobs=5) if i % 2 else SamplingParams(temperature=0.8)
                                  for i in range(B)],
    }
    print(f"sampling pipeline: {B} seqs x {V} vocab, {args.dtype} logits, {args.history}-token histories, on {device}")
    print(f"{'config':<24}{'device ms':>12}{'build ms':>12}{'total ms':>12}")
    for name, params in configs.items():
        seqs = [FakeSeq(sp, half, args.history - half, V, gen) for sp in params]
        options = default_options(ephemeral=True)
        t = tensors_for(seqs, V, eos, device, options)
        device_ms = timeit(lambda: sample_logits(logits, t), device, iters)
        build_ms = timeit(lambda: tensors_for(seqs, V, eos, device, options), device, iters)
        total_ms = timeit(lambda: to_host(logits, tensors_for(seqs, V, eos, device, options)), device, iters)
        print(f"{name:<24}{device_ms:>12.3f}{build_ms:>12.3f}{total_ms:>12.3f}")


if __name__ == "__main__":
    main()

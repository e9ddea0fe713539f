"""Embedding throughput (runner="pooling"): `python -m nanoinfer.bench.embed`.

By default 256 prompts of 512 random token ids on the Qwen3-0.6B shape with random weights (nothing
is downloaded; throughput does not depend on the weights), last-token pooling, prefix caching off
(every token is computed). Prints prompts/s and tokens/s; on CUDA also the run's prefill lower
bound: per step, the weights read once plus the K/V written, at the copy bandwidth, plus the
step's matmul and attention FLOPs at the bf16 matmul rate (no LM head: embeddings skip it), both
ceilings measured in this process, and the measured time as a share of the bound's speed.
--model runs a real checkpoint (e.g. a tiny one on CPU: --num-prompts 8 --prompt-len 32)."""
import argparse
import time
from random import Random

import torch

from nanoinfer import LLM, PoolingParams
from nanoinfer.bench.random_model import SHAPES, make_random_model_dir
from nanoinfer.utils.ceilings import measure_ceilings


def prefill_bound(steps, hf, weight_bytes: int, dtype_bytes: int, bandwidth: float, flops_rate: float) -> float:
    """Seconds: Σ steps (weight bytes read + K/V bytes written) / bandwidth + FLOPs / flops_rate,
    for steps of prompt rows only (StepRecord rows: (query_len, context_len)). Every weight but the
    embedding (a gather of a few rows) and the unused LM head is read once a step; a token's matmul
    FLOPs are 2 x those parameters; attention 4 x layers x heads x head_dim per causal query-key pair."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_per_token = hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 2 * dtype_bytes
    embed = hf.vocab_size * hf.hidden_size
    matmul_params = weight_bytes / dtype_bytes - embed * (1 if hf.tie_word_embeddings else 2)
    read_bytes = matmul_params * dtype_bytes
    total = 0.0
    for step in steps:
        tokens = sum(q for q, _ in step.rows)
        pairs = sum(q * (ctx - q) + q * (q + 1) / 2 for q, ctx in step.rows)
        flops = 2 * matmul_params * tokens + 4 * hf.num_hidden_layers * hf.num_attention_heads * head_dim * pairs
        total += (read_bytes + tokens * kv_per_token) / bandwidth + flops / flops_rate
    return total


def random_prompts(n: int, length: int, vocab: int, rng: Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def timed_embed(llm: LLM, prompts) -> tuple[float, list]:
    """Seconds to embed `prompts`, and the engine's step log of that run."""
    sync = torch.cuda.synchronize if llm.config.device == "cuda" else (lambda: None)
    sync()
    llm.step_log = []
    t = time.perf_counter()
    outs = llm.embed(prompts, PoolingParams(), use_tqdm=False)
    sync()
    t = time.perf_counter() - t
    assert len(outs) == len(prompts) and all(o.finished for o in outs)
    steps, llm.step_log = llm.step_log, None
    return t, steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a real checkpoint (directory or repo id) instead of random weights")
    p.add_argument("--config", choices=sorted(SHAPES), default="0.6b", help="shape of the random model")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="timed runs (the best is reported)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model = args.model or make_random_model_dir(args.config)
    llm = LLM(model, runner="pooling", enforce_eager=args.enforce_eager, enable_prefix_caching=False,
              max_model_len=max(args.prompt_len + 1, 1024), max_num_batched_tokens=args.max_num_batched_tokens,
              load_format="auto" if args.model else "dummy", seed=args.seed)
    rng = Random(args.seed)
    vocab = min(llm.vocab_size, len(llm.tokenizer))
    timed_embed(llm, random_prompts(min(args.num_prompts, 64), args.prompt_len, vocab, rng))  # warm-up (compiles)
    best, steps = float("inf"), []
    for _ in range(args.repeat):
        t, log = timed_embed(llm, random_prompts(args.num_prompts, args.prompt_len, vocab, rng))
        if t < best:
            best, steps = t, log
    tokens = args.num_prompts * args.prompt_len
    line = (f"embed {args.num_prompts} prompts x {args.prompt_len} tokens "
            f"({args.model or 'random Qwen3-' + args.config}, {llm.config.device}, {len(steps)} steps): "
            f"{args.num_prompts / best:.1f} prompts/s, {tokens / best:.0f} tok/s")
    if llm.config.device == "cuda":
        params = list(llm.model_runner.model.parameters())
        weight_bytes = sum(x.numel() * x.element_size() for x in params)
        dtype_bytes = torch.tensor([], dtype=llm.config.torch_dtype).element_size()
        bandwidth, flops_rate = measure_ceilings(torch.device("cuda"))
        bound = prefill_bound(steps, llm.config.hf_config, weight_bytes, dtype_bytes, bandwidth, flops_rate)
        line += (f"; bound {args.num_prompts / bound:.1f} prompts/s (copy {bandwidth / 1e12:.2f} TB/s, "
                 f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s): {bound / best * 100:.1f}% of the prefill bound")
    print(line)
    llm.exit()
    return best, steps


if __name__ == "__main__":
    main()

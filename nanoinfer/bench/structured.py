"""The throughput cost of structured outputs: one workload run with no request constrained, one in
eight, and all of them (`--fractions`), each after a warm-up; prints output tokens/s and the ratio
to the unconstrained run.

    python -m nanoinfer.bench.structured                       # Qwen3-0.6B shape, random weights
    python -m nanoinfer.bench.structured --model Qwen/Qwen3-0.6B --num-seqs 256 --output-len 256
    python -m nanoinfer.bench.structured --shape tiny --num-seqs 64 --output-len 64   # the host's side, on a CPU

A constrained request asks for any JSON object (xgrammar's JSON grammar, the one that walks the
most grammar states on random output) and, like the others, ignores EOS, so every run makes the
same number of tokens. With random weights the tokenizer is the small trained one while the
vocabulary is 151,936 wide: the device work (the bitmask's copy and unpacking over the full
vocabulary) is real, the host's mask filling is cheaper than with a real tokenizer: pass
--model for that.
"""
import argparse
import random
import time

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.bench.random_model import make_random_model_dir


def workload(num_seqs: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 300)) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]


def params_for(num_seqs: int, fraction: float, output_len: int) -> list[SamplingParams]:
    every = 0 if fraction <= 0 else max(1, round(1 / fraction))
    so = StructuredOutputsParams(json_object=True)
    return [SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True,
                           structured_outputs=so if every and i % every == 0 else None)
            for i in range(num_seqs)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a real checkpoint (its tokenizer makes the host's mask work real)")
    p.add_argument("--shape", default="0.6b", help="random weights of this shape (nanoinfer/bench/random_model.py)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.125, 1.0])
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    options = dict(max_model_len=args.max_model_len, async_scheduling=not args.no_async_scheduling)
    if args.model is None:
        path, options["load_format"] = make_random_model_dir(args.shape), "dummy"
    else:
        path = args.model
    llm = LLM(path, **options)
    try:
        prompts = workload(args.num_seqs, llm.vocab_size, args.min_input_len, args.max_input_len, 0)
        llm.generate(prompts[:8], params_for(8, 1.0, 16), use_tqdm=False)  # warm-up: kernels, the grammar
        rows, base = [], None
        for fraction in args.fractions:
            params = params_for(args.num_seqs, fraction, args.output_len)
            llm.generate(prompts[:16], params[:16], use_tqdm=False)
            llm.step_log = []
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            steps, llm.step_log = len(llm.step_log), None
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rate = tokens / dt
            base = rate if base is None else base
            rows.append((fraction, sum(sp.structured_outputs is not None for sp in params), rate, rate / base,
                         steps, 1e3 * dt / steps))
        print(f"{'constrained':>12} {'requests':>9} {'output tok/s':>13} {'vs first':>9} {'steps':>6} {'ms/step':>8}")
        for fraction, n, rate, rel, steps, ms in rows:
            print(f"{fraction:>12.3f} {n:>9d} {rate:>13,.0f} {rel:>9.2f} {steps:>6d} {ms:>8.2f}")
    finally:
        llm.exit()


if __name__ == "__main__":
    main()

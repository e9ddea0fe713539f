"""Structured outputs' per-step cost, for a CPU: the structured bench's workload (temperature 0.6,
ignore_eos, any JSON object for the constrained rows; nanoinfer/bench/structured.py) on a toy body
with the full 151,936-token vocabulary (random_model.py's "tiny"), with 0, 1/8 and all rows
constrained. Per launched step it times, with perf_counter, the host's mask work (matchers advanced,
masks filled) and the mask's application to the logits (the GRAMMAR stage); it counts the engine's
advance() calls (a request that waits for its token in flight needs two per token) and reports
output tokens/s, the best of --reps runs interleaved over the fractions (a shared CPU disturbs some).

    python -m nanoinfer.bench.structured_host [--num-seqs 64] [--output-len 32] [--reps 3]
"""
import argparse
import time

from nanoinfer import LLM
from nanoinfer.bench.random_model import make_random_model_dir
from nanoinfer.bench.structured import params_for, workload
import nanoinfer.sampling_options.grammar as grammar_option
import nanoinfer.structured.step_masks as step_masks

FRACTIONS = (0.0, 0.125, 1.0)


def _timed(module, name: str, totals: dict, key: str):
    """Wrap module.name so that its time adds up in totals[key]."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0

    setattr(module, name, wrapper)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    totals = {"fill": 0.0, "apply": 0.0}
    _timed(grammar_option, "fill_bitmasks", totals, "fill")              # masks filled with the plan (tensor parallel)
    _timed(step_masks, "fill_bitmask_rows", totals, "fill")    # masks filled after the forward's launch
    _timed(grammar_option, "apply_token_bitmask", totals, "apply")
    n = args.num_seqs
    llm = LLM(make_random_model_dir("tiny"), load_format="dummy", max_model_len=1024, max_num_seqs=n)
    try:
        prompts = workload(n, llm.vocab_size, 20, 60, 0)
        llm.generate(prompts[:8], params_for(8, 1.0, 16), use_tqdm=False)  # warm-up: the grammar
        best = {}
        for _ in range(args.reps):
            for fraction in FRACTIONS:
                totals.update(fill=0.0, apply=0.0)
                llm.step_log = []
                rids = [llm.add_request(q, sp, keep_output=True)
                        for q, sp in zip(prompts, params_for(n, fraction, args.output_len))]
                t0, calls = time.perf_counter(), 0
                while not llm.is_finished():
                    llm.advance()
                    calls += 1
                dt = time.perf_counter() - t0
                tokens = sum(len(llm.pop_output(rid).outputs[0].token_ids) for rid in rids)
                steps, llm.step_log = len(llm.step_log), None
                row = (tokens / dt, steps, calls, 1e3 * totals["fill"] / steps, 1e3 * totals["apply"] / steps)
                if fraction not in best or row[0] > best[fraction][0]:
                    best[fraction] = row
    finally:
        llm.exit()
    print(f"{n} requests x {args.output_len} tokens, best of {args.reps}")
    print(f"{'constrained':>11} {'tok/s':>7} {'vs 0':>5} {'steps':>6} {'advance() calls':>16} "
          f"{'mask fill ms/step':>18} {'mask apply ms/step':>19}")
    for fraction in FRACTIONS:
        rate, steps, calls, fill, apply = best[fraction]
        print(f"{fraction:>11.3f} {rate:>7.0f} {rate / best[0.0][0]:>5.2f} {steps:>6d} {calls:>16d} "
              f"{fill:>18.2f} {apply:>19.2f}")


if __name__ == "__main__":
    main()

"""Speculative decoding's mechanism, measured (`python bench.py --speculative ...`): with random
weights real acceptance cannot be measured, so at each batch size this runs

- plain decoding (the baseline: tok/s and the decode step's time);
- a draft equal to its target (every proposal accepted): tok/s, step time and tokens per step,
  which checks the accounting of accepted tokens;
- a draft that disagrees (another random model: acceptance about 0), with the policy off and on:
  the worst-case overhead;
- n-gram prompt lookup (on random prompts);

and prints the measured cost of a speculative step (the disagreeing draft: k proposals and their
verification, every proposal rejected), synchronous and overlapped (each row chained onto the one
in flight, speculative/chaining.py), and the speed-up the overlapped one implies at acceptance rates 0.6
/ 0.7 / 0.8: E[tokens per step] * plain step / speculative step, with E = (1 - a^(k+1)) / (1 - a)
for a per-position acceptance a. Those are computed from measured costs, not measured speed-ups.
The proposer's own host time a step is printed beside it (a greedy draft's forwards then run on
the device while the host launches the verification, so their device time is inside the step).
Greedy sampling throughout (a draft equal to its target then accepts all).
"""
import random
import time

import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.bench.random_model import make_random_model_dir

ACCEPTANCE_RATES = (0.6, 0.7, 0.8)


class TimedProposer:
    """Wraps a speculator's proposer: the host time each step's proposals took (propose() waits for
    its tokens; launch() leaves them on the device)."""

    def __init__(self, proposer):
        self.proposer, self.times = proposer, []

    def propose(self, seqs, max_lens):
        return self._timed(self.proposer.propose, seqs, max_lens)

    def launch(self, *args):
        return self._timed(self.proposer.launch, *args)

    def _timed(self, call, *args):
        t = time.perf_counter()
        out = call(*args)
        self.times.append(time.perf_counter() - t)
        return out

    def __getattr__(self, name):
        return getattr(self.proposer, name)


def expected_tokens(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def _sync(llm):
    if llm.config.device == "cuda":
        torch.cuda.synchronize()


def timed_run(llm: LLM, batch: int, prompt_len: int, output_len: int, rng) -> dict:
    """One batch through the engine's loop: tok/s, mean step wall time, tokens per step, and the
    proposer's mean time per step (0 without one)."""
    prompts = [[rng.randrange(100, min(10000, llm.vocab_size)) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)
    timer = None
    speculator = getattr(llm.rows, "speculator", None)  # (speculative/row_planner.py)
    if speculator is not None:
        timer = speculator.proposer = TimedProposer(speculator.proposer)
    stats0 = (llm.spec_stats.num_drafts, llm.spec_stats.num_accepted_tokens) if llm.spec_stats else (0, 0)
    _sync(llm)
    llm.step_log = []
    t = time.perf_counter()
    rids = llm.add_requests(prompts, [params] * batch, keep_output=True)
    while not llm.is_finished():
        llm.advance()
    _sync(llm)
    t = time.perf_counter() - t
    for rid in rids:
        llm.pop_output(rid)
    steps, llm.step_log = llm.step_log, None
    decode = [b.start - a.start for a, b in zip(steps, steps[1:]) if a.num_decode == len(a.rows) or
              a.num_decode < len(a.rows) and all(q <= 17 for q, _ in a.rows)]  # (verify rows are short)
    out = dict(tok_s=batch * output_len / t, step_ms=1e3 * sum(decode) / max(len(decode), 1),
               tokens_per_step=batch * output_len / max(len(steps), 1), propose_ms=0.0, accepted=0.0)
    if timer is not None:
        speculator.proposer = timer.proposer
        out["propose_ms"] = 1e3 * sum(timer.times) / max(len(timer.times), 1)
        drafts = llm.spec_stats.num_drafts - stats0[0]
        out["accepted"] = (llm.spec_stats.num_accepted_tokens - stats0[1]) / max(drafts, 1)
    return out


RUNS = ("plain", "same", "same-sync", "other", "other-sync", "policy", "ngram")


def compare(target: str, draft: str, k: int, batches, prompt_len: int, output_len: int, dummy: bool = True,
            enforce_eager: bool = False, max_model_len: int = 4096, runs=RUNS, **options):
    """The table (see the module's doc). `target` / `draft`: checkpoint directories (random-weight
    ones with dummy=True). `runs`: which of RUNS to run (each builds its engine: on a device with a
    time limit per command, run them in parts)."""
    load = "dummy" if dummy else "auto"
    common = dict(enforce_eager=enforce_eager, max_model_len=max_model_len, load_format=load, **options)
    same = {"model": target, "num_speculative_tokens": k}
    other = {"model": draft, "num_speculative_tokens": k}
    policy = {**other, "disable_below_acceptance": 0.3}
    unknown = set(runs) - set(RUNS)
    if unknown:
        raise ValueError(f"unknown run(s) {sorted(unknown)}; choose from {list(RUNS)}")
    engines = [("plain", {}, "plain"), ("draft = target", dict(speculative_config=same), "same"),
               ("draft = target, sync", dict(speculative_config=same, async_scheduling=False), "same-sync"),
               ("disagreeing draft", dict(speculative_config=other), "other"),
               ("disagreeing draft, sync", dict(speculative_config=other, async_scheduling=False), "other-sync"),
               ("disagreeing draft, policy on", dict(speculative_config=policy), "policy"),
               ("n-gram", dict(speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}), "ngram")]
    results = {}
    for name, opts, key in engines:
        if key not in runs:
            continue
        llm = LLM(target, **common, **opts)
        rng = random.Random(0)
        for b in batches:  # a short warm-up at each batch size first: kernels it compiles stay out of the timing
            timed_run(llm, b, prompt_len, 8, rng)
            results[name, b] = timed_run(llm, b, prompt_len, output_len, random.Random(b))
        llm.exit()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_table(results, batches, k, output_len)
    return results


def print_table(results: dict, batches, k: int, output_len: int):
    print(f"k = {k}, {output_len} output tokens per sequence, greedy")
    print(f"{'batch':>5} {'run':<30} {'tok/s':>9} {'step ms':>8} {'tok/step':>9} {'accepted/row':>12} "
          f"{'propose ms':>10}")
    for b in batches:
        for (name, batch), r in results.items():
            if batch == b:
                print(f"{b:>5} {name:<30} {r['tok_s']:9.0f} {r['step_ms']:8.2f} {r['tokens_per_step']:9.2f} "
                      f"{r['accepted']:12.2f} {r['propose_ms']:10.2f}")
    print("computed from measured costs (not measured speed-ups): E[tokens a step] x plain step / speculative step "
          "(the disagreeing draft: k proposals and their verification; overlapped where run, else sync)")
    print(f"{'batch':>5} {'plain step ms':>13} {'spec step ms, sync':>18} {'overlapped':>10} "
          f"{'propose ms (host)':>17} " + " ".join(f"{'x at ' + str(a):>9}" for a in ACCEPTANCE_RATES)
          + f" {'overhead, a=0 (policy on)':>26}")
    for b in batches:
        plain, sync = results.get(("plain", b)), results.get(("disagreeing draft, sync", b))
        overlapped = results.get(("disagreeing draft", b))
        spec = overlapped or sync
        if plain is None or spec is None:
            continue
        ups = [expected_tokens(a, k) * plain["step_ms"] / spec["step_ms"] for a in ACCEPTANCE_RATES]
        policy = results.get(("disagreeing draft, policy on", b))
        overhead = f"{(plain['tok_s'] / policy['tok_s'] - 1) * 100:+.1f}%" if policy else "-"
        cells = [f"{r['step_ms']:.2f}" if r else "-" for r in (sync, overlapped)]
        print(f"{b:>5} {plain['step_ms']:13.2f} {cells[0]:>18} {cells[1]:>10} {spec['propose_ms']:17.2f} "
              + " ".join(f"{u:9.2f}" for u in ups) + f" {overhead:>26}")


def main_args(args):
    """bench.py --speculative: the target --config (8b by default) with a --draft-config draft."""
    target = args.model or make_random_model_dir(args.config)
    draft = args.draft_model or make_random_model_dir(args.draft_config)
    batches = [int(b) for b in args.speculative_batches.split(",")]
    compare(target, draft, args.num_speculative_tokens, batches, args.speculative_prompt_len, args.sweep_output_len,
            dummy=args.model is None, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
            runs=args.speculative_runs.split(","), max_num_batched_tokens=args.max_num_batched_tokens)

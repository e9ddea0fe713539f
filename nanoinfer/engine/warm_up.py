"""Start-up warm-up: synthetic steps through a runner's real launch path, so that the first
requests do not pay for compiles and first allocations.

Triton compiles a kernel once per set of constexprs and per specialisation of its integer
arguments (equal to 1, a multiple of 16, or neither) and pointers (16-byte aligned or not); a
step's token and row counts reach many kernels as such integers, and some tile configs depend on
the step's size. Graph captures cover the decode shapes; these steps cover what runs outside them.
They write K/V into the cache's first blocks, which no sequence owns yet; their tokens are dropped."""
from nanoinfer.step.step_message import SampleInput, SamplingPlan, StepInput


def warm_up_shapes(max_tokens: int, max_rows: int, max_len: int) -> list[list[tuple[int, int]]]:
    """Steps as lists of rows (start, query length): decode rows (query length 1) first. Every
    step has at most max_tokens tokens and max_rows rows, no row past max_len positions."""
    cap = max(1, min(max_tokens, max_len - 1))
    steps = [
        [(0, cap)],                                    # one long prompt, as long as a step takes
        [(0, max(1, cap - 3))],                        # the same, a token count that is no multiple of 16
        [(0, max(1, min(cap, 100)))],                  # a short prompt alone
        [(0, max(1, min(cap, 777)))],
        [(0, 3)] * 5,                                  # short rows (a step of few tokens a row)
    ]
    for rows in (16, 17, 3):                           # a token budget shared by many rows, and by few
        if rows <= max_rows:
            each = max(1, min(cap, max_tokens // rows))
            steps.append([(0, each)] * (rows - 1) + [(0, max(1, each - (rows % 2)))])
    for rows in (16, 3):                               # mid-size steps (the mixed-step graphs' sizes)
        if rows <= max_rows:
            steps.append([(0, max(1, min(cap, 1000 // rows)))] * rows)
    chunk = max(1, min(cap // 2, 1000))
    if chunk + chunk < max_len:                        # a prompt's second chunk: attends to its first
        steps.append([(chunk, chunk)])
    for decode in (7, 16):                             # decode rows in a step with a prompt chunk
        if decode + 1 <= max_rows and 200 < max_len and decode + 1 <= max_tokens:
            prompt = max(1, min(cap, max_tokens - decode, 1500 if decode == 7 else 3001))
            steps.append([(199, 1)] * decode + [(0, prompt)])
    return [s for s in steps if sum(q for _, q in s) <= max_tokens and len(s) <= max_rows]


def warm_up_steps(max_tokens: int, max_rows: int, max_len: int, block_size: int, num_blocks: int,
                  vocab_size: int) -> list[tuple[StepInput, SampleInput]]:
    """The steps of warm_up_shapes as messages (each row its own blocks, numbered from 0; steps
    that need more blocks than the cache has are left out), sampling at temperature 0.6, the
    last one greedy."""
    out = []
    for i, rows in enumerate(warm_up_shapes(max_tokens, max_rows, max_len)):
        tables, next_block = [], 0
        for start, q in rows:
            n = -(-(start + q) // block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        if next_block > num_blocks:
            continue
        num_decode = sum(1 for start, q in rows if q == 1 and start > 0)
        ids = [(7 * j + 11) % min(vocab_size, 10000) for j in range(sum(q for _, q in rows))]
        step = StepInput(num_decode=num_decode, starts=[s for s, _ in rows], query_lens=[q for _, q in rows],
                         input_ids=ids, block_tables=tables)
        plan = SamplingPlan(temperatures=[0.6] * len(rows), all_greedy=False, any_greedy=False, seed=i)
        out.append((step, SampleInput(plan)))
    if out:  # one all-greedy step
        step = out[-1][0]
        out.append((step, SampleInput(SamplingPlan([0.0] * step.num_rows, all_greedy=True, any_greedy=True, seed=0))))
    return out


def warm_up(runner, num_blocks: int) -> int:
    """Run the warm-up steps on `runner` (engine/model_runner.py, one rank that samples), each
    collected before the next; returns how many ran."""
    cfg = runner.config
    steps = warm_up_steps(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len, cfg.kvcache_block_size,
                          num_blocks, cfg.hf_config.vocab_size)
    for step, sample in steps:
        runner.collect(runner.launch(step, sample, None))
    return len(steps)

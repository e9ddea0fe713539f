"""The start-up warm-up (engine/warm_up.py): its steps fit the engine's limits, run through a runner's
real launch path, and leave the engine as it found it (CPU, tiny model; on CUDA the runner runs
them itself after the graph captures)."""
from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.warm_up import warm_up, warm_up_shapes, warm_up_steps


def test_shapes_respect_the_limits_and_cover_the_specialisations():
    for max_tokens, max_rows, max_len in ((16384, 512, 4096), (2048, 8, 40960), (64, 4, 100), (8, 1, 16)):
        shapes = warm_up_shapes(max_tokens, max_rows, max_len)
        assert shapes
        for rows in shapes:
            assert sum(q for _, q in rows) <= max_tokens and len(rows) <= max_rows
            assert all(q >= 1 and start + q <= max_len for start, q in rows)
            starts = [start > 0 and q == 1 for start, q in rows]
            assert starts == sorted(starts, reverse=True)  # decode rows first
    tokens = {sum(q for _, q in rows) for rows in warm_up_shapes(16384, 512, 4096)}
    rows = {len(r) for r in warm_up_shapes(16384, 512, 4096)}
    assert 16384 in tokens and any(t % 16 for t in tokens if t > 2048)  # a full budget and an odd large step
    assert {1, 16} <= rows and any(r % 16 and r > 1 for r in rows)


def test_steps_skip_what_the_cache_cannot_hold():
    steps = warm_up_steps(16384, 512, 4096, 256, num_blocks=4, vocab_size=1000)
    assert steps and all(max(max(t) for t in s.block_tables) < 4 for s, _ in steps)
    assert all(max(s.input_ids) < 1000 for s, _ in steps)


def test_warm_up_runs_and_leaves_the_engine_as_it_was(tiny_qwen3):
    prompts = [[(i * 13 + j) % 200 + 1 for i in range(5 + 9 * j)] for j in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    options = dict(max_model_len=300, max_num_batched_tokens=512, max_num_seqs=24, kvcache_block_size=16)
    outs = []
    for warm in (False, True):
        llm = LLM(tiny_qwen3, **options)
        try:
            if warm:
                assert warm_up(llm.model_runner, llm.scheduler.block_manager.num_blocks) >= 10
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        finally:
            llm.exit()
    assert outs[0] == outs[1]

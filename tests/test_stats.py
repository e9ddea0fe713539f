"""disable_log_stats=False: the engine logs its statistics as it runs (metrics/stats.py), and the
counters match the requests run."""
import logging
import re

from nanoinfer import LLM, SamplingParams

LINE = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                  r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%, "
                  r"Prefix cache hit rate: ([\d.]+)%, Preemptions: (\d+)")


def stat_lines(caplog) -> list[tuple]:
    return [LINE.search(r.getMessage()).groups() for r in caplog.records
            if r.name == "nanoinfer.stats" and LINE.search(r.getMessage())]


def test_stats_lines_and_counters(tiny_qwen3, caplog, monkeypatch):
    monkeypatch.setenv("NANOINFER_LOG_STATS_INTERVAL", "0")  # a line every step
    caplog.set_level(logging.INFO, logger="nanoinfer.stats")
    llm = LLM(tiny_qwen3, disable_log_stats=False, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=32,
              max_num_seqs=2)
    try:
        prompts = [[5 + i] * 20 for i in range(4)]
        outs = llm.generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * 3
                            + [SamplingParams(max_tokens=3, n=2, ignore_eos=True)], use_tqdm=False)
        lines = stat_lines(caplog)
        assert lines, "no statistics line was logged"
        assert lines[0][2:4] == ("2", "2"), "first step: two running (max_num_seqs=2), two waiting"
        assert lines[-1][2:5] == ("0", "0", "0.0"), "at the end: nothing running or waiting, no KV block in use"
        t = llm.stats.totals(llm.scheduler)
        assert t["prompt_tokens"] == sum(len(p) for p in prompts)
        assert t["generation_tokens"] == sum(len(c.token_ids) for o in outs for c in o.outputs) == 3 * 6 + 2 * 3
        assert t["requests_finished"] == 4
        # the same prompts again: their full blocks are in the prefix cache
        again = llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        t = llm.stats.totals(llm.scheduler)
        cached = sum(o.num_cached_tokens for o in again)
        # (the n=2 request's second sample, too, found its first's full prompt block in the cache)
        assert cached == 2 * 16 and t["prefix_cache_hits"] == cached + 16
        assert t["prefix_cache_queries"] == sum(len(p) for p in prompts) + 20 + 40
        assert t["prompt_tokens"] == sum(len(p) for p in prompts) + 40
        last = stat_lines(caplog)[-1]
        assert float(last[5]) == round(100 * (cached + 16) / t["prefix_cache_queries"], 1)
        assert int(last[6]) == llm.scheduler.num_preemptions
    finally:
        llm.exit()


def test_throughput_counts_the_interval(tiny_qwen3, caplog, monkeypatch):
    """With one line per step, the tokens logged (throughput x the line's interval) add up: each
    line's prompt throughput is positive exactly when a prompt finished in that step."""
    monkeypatch.setenv("NANOINFER_LOG_STATS_INTERVAL", "0")
    caplog.set_level(logging.INFO, logger="nanoinfer.stats")
    llm = LLM(tiny_qwen3, disable_log_stats=False, async_scheduling=False, kvcache_block_size=16,
              max_model_len=128, num_kvcache_blocks=16, max_num_seqs=1)
    try:
        llm.generate([[7] * 10, [8] * 10], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        lines = stat_lines(caplog)
        prompt_lines = [i for i, line in enumerate(lines) if float(line[0]) > 0]
        gen_lines = [i for i, line in enumerate(lines) if float(line[1]) > 0]
        assert len(prompt_lines) == 2 and len(gen_lines) == 6  # one token per step, one request at a time
    finally:
        llm.exit()


def test_off_by_default_offline(tiny_qwen3, caplog):
    caplog.set_level(logging.INFO, logger="nanoinfer.stats")
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=8)
    try:
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.stats is None and not stat_lines(caplog)
    finally:
        llm.exit()


def test_embeddings_count_prompt_tokens(tiny_qwen3, monkeypatch):
    monkeypatch.setenv("NANOINFER_LOG_STATS_INTERVAL", "0")
    llm = LLM(tiny_qwen3, runner="pooling", disable_log_stats=False, kvcache_block_size=16, max_model_len=64,
              num_kvcache_blocks=8)
    try:
        outs = llm.embed(["hello there", "a b c"], use_tqdm=False)
        t = llm.stats.totals(llm.scheduler)
        assert t["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs) and t["generation_tokens"] == 0
        assert t["requests_finished"] == 2
    finally:
        llm.exit()

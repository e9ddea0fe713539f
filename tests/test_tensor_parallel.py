"""Tensor parallelism on CPU (gloo): tp > 1 gives the same greedy tokens as tp = 1 (Qwen3 and Qwen2,
forced preemption, warm prefix cache, KV-head replication, tp = 4); a worker that dies or raises
makes the parent raise within seconds and leaves no process or shared-memory segment; engines can
follow one another in a process and live side by side in two; bad options fail before any spawn.

Each TP engine spawns workers that import torch (seconds on CI), so each test builds at most one or
two and does several checks with them."""
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine import tp_worker

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SMALL_POOL = dict(kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8)  # one max-length sequence


def random_prompts(n, vocab, seed=0, lo=5, hi=40, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def generate(llm, prompts, params=GREEDY):
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


def run_by_hand(llm, prompts, params=GREEDY):
    """Like generate, through the engine's public loop; returns the RequestOutputs too (for their
    prefix-cache counters)."""
    rids = [llm.add_request(p, params, keep_output=True) for p in prompts]
    while not llm.is_finished():
        llm.step()
    outs = [llm.pop_output(rid) for rid in rids]
    return [o["token_ids"] for o in outs], outs


def reference(path, prompt_sets, params=GREEDY, **options):
    llm = LLM(path, kvcache_block_size=16, max_model_len=SMALL_POOL["max_model_len"], **options)
    try:
        return [generate(llm, prompts, params) for prompts in prompt_sets]
    finally:
        llm.exit()


def our_segments(pid=None):
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"nanoinfer_{pid or os.getpid()}_"))


@pytest.fixture
def shm_before():
    """/dev/shm before the test: a test must leave no segment and no semaphore (its Events') behind."""
    return set(os.listdir("/dev/shm"))


def assert_clean(llm, shm_before):
    """No worker alive, no segment or semaphore left, no process group held."""
    runner = llm.model_runner
    for proc in runner.procs:
        assert not proc.is_alive() and proc.exitcode is not None, f"worker {proc.pid} still alive"
    assert not [p for p in mp.active_children() if p.name.startswith("nanoinfer-tp")]
    assert our_segments() == []
    assert not [f for f in set(os.listdir("/dev/shm")) - shm_before if f.startswith("sem.mp-")]
    assert not dist.is_initialized()


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def kv4(make_checkpoint):
    return make_checkpoint(num_heads=8, num_kv_heads=4)


@pytest.fixture(scope="module")
def kv1(make_checkpoint):
    return make_checkpoint(num_kv_heads=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_tp2_matches_tp1_with_preemption_and_warm_cache(make_checkpoint, arch, shm_before):
    path = make_checkpoint(arch=arch)
    llm = LLM(path, tensor_parallel_size=2, **SMALL_POOL)
    try:
        assert llm.model_runner.num_blocks == SMALL_POOL["num_kvcache_blocks"]
        vocab = llm.vocab_size
        busy = random_prompts(4, vocab, seed=1)                       # 4 x up to 5 blocks > 8 blocks
        shared = random_prompts(3, vocab, seed=2, lo=3, hi=8, shared=40)
        # the tp=1 reference, built while the TP engine's process group is alive (it must not shard)
        expected_busy, expected_shared = reference(path, [busy, shared])

        assert generate(llm, busy) == expected_busy
        assert llm.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
        assert generate(llm, shared[:1]) == expected_shared[:1]       # warms the cache
        outs, results = run_by_hand(llm, shared)
        assert outs == expected_shared
        assert all(r.num_cached_tokens >= 32 for r in results[1:]), [r.num_cached_tokens for r in results]
        bm = llm.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.exit()
    assert_clean(llm, shm_before)


@pytest.mark.timeout(120)
def test_tp4_with_four_kv_heads_and_a_killed_worker(kv4, shm_before):
    prompts = random_prompts(6, 384, seed=3)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    [expected] = reference(kv4, [prompts])
    llm = LLM(kv4, tensor_parallel_size=4, kvcache_block_size=16, max_model_len=256)
    try:
        assert llm.model_runner.runner.num_kv_heads == 1
        assert generate(llm, prompts) == expected
        # kill rank 2 in the middle of a generation: the parent must raise, not hang
        victim = llm.model_runner.procs[1]
        threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 2: process \d+ killed by SIGKILL"):
            generate(llm, prompts * 4, long)
        assert time.monotonic() - start < 30
        assert_clean(llm, shm_before)
        with pytest.raises(RuntimeError, match="unusable"):
            generate(llm, prompts[:1])
        assert llm.is_finished()
    finally:
        llm.exit()
    assert_clean(llm, shm_before)


@pytest.mark.timeout(120)
def test_kv_head_replication_and_a_worker_raising_in_forward(kv1, monkeypatch, shm_before):
    """num_key_value_heads=1 < tp=2: both ranks keep the one KV head (vLLM's choice)."""
    prompts = random_prompts(5, 384, seed=4)
    [expected] = reference(kv1, [prompts])
    llm = LLM(kv1, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        assert llm.model_runner.runner.num_kv_heads == 1
        assert generate(llm, prompts) == expected

        def bad_block_tables(batch):  # the worker's KV store indexes out of its cache
            step = from_batch(batch)
            step.rows = [(start, ids, [10**6] * len(table)) for start, ids, table in step.rows]
            return step

        from_batch = tp_worker.StepInput.from_batch
        monkeypatch.setattr(tp_worker.StepInput, "from_batch", bad_block_tables)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)rank 1: Traceback.*IndexError"):
            generate(llm, prompts)
        assert time.monotonic() - start < 30
    finally:
        llm.exit()
    assert_clean(llm, shm_before)


SIDE_SCRIPT = textwrap.dedent("""
    import os, sys
    from nanoinfer import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=2048)
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        print("TOKENS", out[0]["token_ids"], flush=True)
        print("PIDS", os.getpid(), *[p.pid for p in llm.model_runner.procs], flush=True)
        # a long generation, for the test's Ctrl-C
        llm.generate([[1, 2, 3]] * 8, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
                     use_tqdm=False)
""")


@pytest.mark.timeout(180)
def test_engines_side_by_side_and_one_after_another(tiny_qwen3, tmp_path, monkeypatch, shm_before):
    """A TP engine here and one in another process at the same time (own segment, own port), which
    then gets a Ctrl-C mid-generation and must leave nothing behind; then a second engine here
    after the first exits. A tiny buffer makes every call outgrow it."""
    monkeypatch.setattr(tp_worker, "SHM_INITIAL_BYTES", 128)
    script = tmp_path / "side.py"
    script.write_text(SIDE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    prompt, params = [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = reference(tiny_qwen3, [prompt], params)

    side = subprocess.Popen([sys.executable, str(script), tiny_qwen3], env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
        try:
            with pytest.raises(RuntimeError, match="already initialized"):  # one TP engine per process
                LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
            big = [list(range(1, 100))] * 6  # a prefill message of several KiB: the buffer grows
            assert generate(first, big, params) == generate(first, big[:1], params) * 6
            assert first.model_runner.shm.size > 128 and len(our_segments()) == 1
            assert generate(first, prompt, params) == expected
            lines = [side.stdout.readline() for _ in range(2)]  # while this engine is alive
            assert lines[0].startswith("TOKENS") and lines[1].startswith("PIDS"), "".join(lines) + side.stdout.read()
            assert lines[0].split(None, 1)[1].strip() == str(expected[0])
        finally:
            first.exit()

        # Ctrl-C (SIGINT to the whole process group) in the middle of the other process's generation
        side_pids = [int(p) for p in lines[1].split()[1:]]
        time.sleep(0.5)
        os.killpg(side.pid, signal.SIGINT)
        start = time.monotonic()
        out, _ = side.communicate(timeout=60)
        assert "KeyboardInterrupt" in out and time.monotonic() - start < 20
        assert not [p for p in side_pids if pid_alive(p)]
        assert our_segments(side.pid) == []
        assert_clean(first, shm_before)  # now that the other process's semaphores are gone too
    finally:
        if side.poll() is None:
            side.kill()
            side.communicate()

    second = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        assert second.model_runner.init_method != first.model_runner.init_method
        assert generate(second, prompt, params) == expected
    finally:
        second.exit()
    assert_clean(second, shm_before)


@pytest.mark.parametrize("options, ckpt, match", [
    (dict(tensor_parallel_size=0), {}, "tensor_parallel_size must be"),
    (dict(tensor_parallel_size=-2), {}, "tensor_parallel_size must be"),
    (dict(tensor_parallel_size=3), {}, "num_attention_heads"),
    (dict(tensor_parallel_size=8), {}, "num_attention_heads"),
    (dict(tensor_parallel_size=2), dict(num_heads=6, num_kv_heads=3, hidden_size=48), "num_key_value_heads"),
    (dict(tensor_parallel_size=4), dict(vocab_size=390), "vocab_size"),
    (dict(tensor_parallel_size=4), dict(intermediate_size=130), "intermediate_size"),
])
def test_bad_tp_options_fail_before_any_spawn(make_checkpoint, options, ckpt, match):
    with pytest.raises(ValueError, match=match):
        LLM(make_checkpoint(**ckpt), **options)
    assert not mp.active_children() and our_segments() == []


def test_more_ranks_than_gpus_fails_before_any_spawn(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"exceeds the 1 visible CUDA device"):
        LLM(tiny_qwen3, tensor_parallel_size=2, device="cuda")
    assert not mp.active_children() and our_segments() == []

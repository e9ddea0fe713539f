"""Tensor parallelism on CPU (gloo): tp > 1 gives the same greedy tokens as tp = 1 (Qwen3 and Qwen2,
forced preemption, warm prefix cache, KV-head replication, tp = 4); a worker that dies or raises
makes the parent raise within seconds and leaves no process or shared-memory segment; so does a
stopped (SIGSTOP) worker, past the step timeout; Ctrl-C during start-up exits within 2 s; engines
can follow one another in a process and live side by side in two; bad options fail before any spawn.

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


def semaphores(llm):
    """The /dev/shm files of the engine's semaphores (one per worker: the engine makes no other).
    Named exactly, so that other processes' semaphores (other test runs) do not count."""
    return sorted("sem." + calls._semlock.name.lstrip("/") for calls in llm.model_runner.calls)


def left_in_shm(names):
    return [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]


def assert_clean(llm, sems):
    """No worker alive, no segment or semaphore (`sems`: semaphores(llm) while it ran) left, no
    process group held."""
    runner = llm.model_runner
    for proc in runner.procs:
        assert not proc.is_alive() and proc.exitcode is not None, f"worker {proc.pid} still alive"
    assert not [p for p in mp.active_children() if p.name.startswith("nanoinfer-tp")]
    assert our_segments() == []
    assert sems and left_in_shm(sems) == []
    assert not runner.calls
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
def test_tp2_matches_tp1_with_preemption_and_warm_cache(make_checkpoint, arch):
    path = make_checkpoint(arch=arch)
    llm = LLM(path, tensor_parallel_size=2, **SMALL_POOL)
    sems = semaphores(llm)
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
    assert_clean(llm, sems)


@pytest.mark.timeout(120)
def test_tp4_with_four_kv_heads_and_a_killed_worker(kv4):
    prompts = random_prompts(6, 384, seed=3)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    [expected] = reference(kv4, [prompts])
    llm = LLM(kv4, tensor_parallel_size=4, kvcache_block_size=16, max_model_len=256)
    sems = semaphores(llm)
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
        assert_clean(llm, sems)
        with pytest.raises(RuntimeError, match="unusable"):
            generate(llm, prompts[:1])
        assert llm.is_finished()
    finally:
        llm.exit()
    assert_clean(llm, sems)


@pytest.mark.timeout(120)
def test_kv_head_replication_and_a_worker_raising_in_forward(kv1, monkeypatch):
    """num_key_value_heads=1 < tp=2: both ranks keep the one KV head (vLLM's choice)."""
    prompts = random_prompts(5, 384, seed=4)
    [expected] = reference(kv1, [prompts])
    llm = LLM(kv1, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    sems = semaphores(llm)
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
    assert_clean(llm, sems)


@pytest.mark.timeout(180)
def test_a_stopped_worker_fails_the_step_after_the_timeout(tiny_qwen3, monkeypatch):
    """A worker stopped with SIGSTOP (alive, silent) blocks rank 0 in a collective, or in handing it
    the next call; past NANOINFER_TP_STEP_TIMEOUT_S the step raises a RuntimeError naming the rank,
    and the engine refuses further use with that error."""
    monkeypatch.setenv(tp_worker.STEP_TIMEOUT_ENV, "3")
    prompt, params = [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = reference(tiny_qwen3, [prompt], params)
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    sems = semaphores(llm)
    try:
        assert llm.model_runner.step_timeout == 3
        assert generate(llm, prompt, params) == expected
        victim = llm.model_runner.procs[0]
        os.kill(victim.pid, signal.SIGSTOP)
        start = time.monotonic()
        message = rf"rank 1: process {victim.pid} did not answer a step within 3 s \(stopped"
        with pytest.raises(RuntimeError, match=message):
            generate(llm, prompt, params)
        assert 3 <= time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="unusable: " + message):
            generate(llm, prompt, params)
        assert llm.is_finished()
    finally:
        llm.exit()
    assert_clean(llm, sems)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_bad_step_timeout(tiny_qwen3, monkeypatch, value):
    monkeypatch.setenv(tp_worker.STEP_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=tp_worker.STEP_TIMEOUT_ENV):
        LLM(tiny_qwen3, tensor_parallel_size=2)
    assert not mp.active_children() and our_segments() == []


STARTUP_SCRIPT = textwrap.dedent("""
    import sys
    from nanoinfer import LLM
    from nanoinfer.engine import tp_worker
    if __name__ == "__main__":
        if sys.argv[2] == "spawn":  # Ctrl-C while the workers start (import torch)
            start = tp_worker.TensorParallelRunner._start

            def start_and_tell(proc):
                start(proc)
                print("READY", proc.pid, flush=True)
            tp_worker.TensorParallelRunner._start = staticmethod(start_and_tell)
        else:  # Ctrl-C while rank 0 joins the process group and loads its shard
            model_runner = tp_worker.ModelRunner

            def tell_and_load(*args):
                print("READY", flush=True)
                return model_runner(*args)
            tp_worker.ModelRunner = tell_and_load
        LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
        print("STARTED", flush=True)
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("phase", ["spawn", "load"])
def test_ctrl_c_during_start_up_exits_promptly(tiny_qwen3, tmp_path, phase):
    """Ctrl-C (SIGINT to the process group) while the workers start, or while rank 0 joins them
    and loads: the process exits with KeyboardInterrupt within 2 s, leaving no worker and no
    segment (the workers serve no calls yet: no polite exit to wait for)."""
    script = tmp_path / "startup.py"
    script.write_text(STARTUP_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), tiny_qwen3, phase], env=env, text=True,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("READY"), ready + proc.stdout.read()
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
        assert "KeyboardInterrupt" in out and "STARTED" not in out, out
        assert elapsed < 2, f"took {elapsed:.1f} s to exit"
        assert not [int(pid) for pid in ready.split()[1:] if pid_alive(int(pid))]
        assert our_segments(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


SIDE_SCRIPT = textwrap.dedent("""
    import os, sys
    from nanoinfer import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=2048)
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        print("TOKENS", out[0]["token_ids"], flush=True)
        print("PIDS", os.getpid(), *[p.pid for p in llm.model_runner.procs], flush=True)
        print("SEMS", *[c._semlock.name.lstrip("/") for c in llm.model_runner.calls], flush=True)
        # a long generation, for the test's Ctrl-C
        llm.generate([[1, 2, 3]] * 8, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
                     use_tqdm=False)
""")


@pytest.mark.timeout(180)
def test_engines_side_by_side_and_one_after_another(tiny_qwen3, tmp_path, monkeypatch):
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
        first_sems = semaphores(first)
        try:
            with pytest.raises(RuntimeError, match="already initialized"):  # one TP engine per process
                LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
            big = [list(range(1, 100))] * 6  # a prefill message of several KiB: the buffer grows
            assert generate(first, big, params) == generate(first, big[:1], params) * 6
            assert first.model_runner.shm.size > 128 and len(our_segments()) == 1
            assert generate(first, prompt, params) == expected
            lines = [side.stdout.readline() for _ in range(3)]  # while this engine is alive
            assert [line.split(None, 1)[0] for line in lines if line.strip()] == ["TOKENS", "PIDS", "SEMS"], \
                "".join(lines) + side.stdout.read()
            assert lines[0].split(None, 1)[1].strip() == str(expected[0])
        finally:
            first.exit()

        # Ctrl-C (SIGINT to the whole process group) in the middle of the other process's generation
        side_pids = [int(p) for p in lines[1].split()[1:]]
        side_sems = ["sem." + name for name in lines[2].split()[1:]]
        time.sleep(0.5)
        os.killpg(side.pid, signal.SIGINT)
        start = time.monotonic()
        out, _ = side.communicate(timeout=60)
        assert "KeyboardInterrupt" in out and time.monotonic() - start < 20
        assert not [p for p in side_pids if pid_alive(p)]
        assert our_segments(side.pid) == []
        assert side_sems and left_in_shm(side_sems) == []
        assert_clean(first, first_sems)
    finally:
        if side.poll() is None:
            side.kill()
            side.communicate()

    second = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    second_sems = semaphores(second)
    try:
        assert second.model_runner.init_method != first.model_runner.init_method
        assert generate(second, prompt, params) == expected
    finally:
        second.exit()
    assert_clean(second, second_sems)


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

"""Tensor parallelism on CPU (gloo): tp > 1 gives the same greedy tokens as tp = 1 (Qwen3 and Qwen2,
forced preemption, warm prefix cache, KV-head replication, tp = 4, overlapped steps, prompt
logprobs, penalties, logits processors); a worker that dies, raises, or stops (SIGSTOP, past the step
timeout) makes the engine raise within seconds and leaves no process or shared-memory segment;
Ctrl-C during start-up exits within 2 s; engines live side by side in one process and in two, and
when an engine's process is interrupted, terminated or killed its workers go too; bad options fail
before any spawn.

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
from nanoinfer.engine import tp_executor, worker_group

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
    """Shared-memory names of the TP engines of a process; the engine unlinks each once every rank
    has mapped it, so none is ever seen between calls."""
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"nanoinfer-tp_{pid or os.getpid()}_"))


def assert_clean(llm):
    """No worker alive, no segment left, no process group in this process (it never joins one)."""
    group = llm.model_runner.group
    for proc in group.procs:
        assert not proc.is_alive() and proc.exitcode is not None, f"worker {proc.pid} still alive"
    assert all(conn.closed for conn in group.conns)
    assert our_segments() == []
    assert not dist.is_initialized()


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and [p for p in pids if pid_alive(p)]:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def ban_token_7(output_ids, logits):  # a logits processor that pickles (module level)
    logits[7] = float("-inf")
    return logits


def fail_on_third_token(output_ids, logits):
    if len(output_ids) == 2:
        raise ValueError("processor failed on purpose")
    return logits


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
    try:
        assert llm.model_runner.num_blocks == SMALL_POOL["num_kvcache_blocks"]
        assert llm.overlap and our_segments() == []  # overlapped steps on every rank; the segment unlinked
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
    assert_clean(llm)


@pytest.mark.timeout(120)
def test_tp4_with_four_kv_heads_and_a_killed_worker(kv4):
    prompts = random_prompts(6, 384, seed=3)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    [expected] = reference(kv4, [prompts])
    llm = LLM(kv4, tensor_parallel_size=4, kvcache_block_size=16, max_model_len=256)
    try:
        assert llm.model_runner.info()["num_kv_heads"] == 1
        assert generate(llm, prompts) == expected
        # kill rank 2 in the middle of a generation: the engine must raise within 5 s, not hang
        victim = llm.model_runner.group.procs[2]
        killed = []
        threading.Timer(0.3, lambda: (os.kill(victim.pid, signal.SIGKILL), killed.append(time.monotonic()))).start()
        with pytest.raises(RuntimeError, match=r"rank 2: process \d+ killed by SIGKILL"):
            generate(llm, prompts * 4, long)
        assert killed and time.monotonic() - killed[0] < 5
        assert_clean(llm)
        with pytest.raises(RuntimeError, match="unusable"):
            generate(llm, prompts[:1])
        assert llm.is_finished()
    finally:
        llm.exit()
    assert_clean(llm)


@pytest.mark.timeout(120)
def test_kv_head_replication_and_a_worker_raising_in_forward(kv1, monkeypatch):
    """num_key_value_heads=1 < tp=2: both ranks keep the one KV head (vLLM's choice)."""
    prompts = random_prompts(5, 384, seed=4)
    [expected] = reference(kv1, [prompts])
    llm = LLM(kv1, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        assert llm.model_runner.info()["num_kv_heads"] == 1
        assert generate(llm, prompts) == expected

        def bad_block_tables(*args):  # the ranks' KV stores index out of their caches
            step, sample = encode(*args)
            step.block_tables = [[10**6] * len(table) for table in step.block_tables]
            return step, sample

        encode = llm.step_encoder.encode
        monkeypatch.setattr(llm.step_encoder, "encode", bad_block_tables)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?s)rank 1: Traceback.*IndexError"):
            generate(llm, prompts)
        assert time.monotonic() - start < 5
    finally:
        llm.exit()
    assert_clean(llm)


@pytest.mark.timeout(120)
def test_sampling_features_and_a_raising_logits_processor(tiny_qwen3, capfd):
    """What rank 0 samples with (penalties over in-flight tokens, seeds, logprobs, prompt
    logprobs, a picklable logits processor, token constraints sent once and then named by key)
    gives tp = 1's results; an unpicklable processor is refused up front; one that raises fails its
    own request (finish_reason "error") and the engine keeps serving. The workers exit quietly: no
    library reports leaked objects at their teardown (triton's nanobind did, ~60 lines, when the
    workers' frozen objects outlived it)."""
    vocab = 384
    prompts = random_prompts(5, vocab, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True, presence_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logits_processors=[ban_token_7]),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=5),
              SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, n=2,
                             logit_bias={9: 5.0, 10: -100.0}, allowed_token_ids=list(range(5, 40)))]

    def outputs(llm):
        return [(o["token_ids"], o["logprobs"], o["prompt_logprobs"])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=128)
    try:
        expected = outputs(ref)
    finally:
        ref.exit()
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        got = outputs(llm)
        for (tokens, lps, plps), (e_tokens, e_lps, e_plps) in zip(got, expected):
            assert tokens == e_tokens
            assert [sorted(d) for d in lps or []] == [sorted(d) for d in e_lps or []]
            assert (plps is None) == (e_plps is None)
        assert 7 not in got[2][0] and set(got[4][0]) <= set(range(5, 40))
        with pytest.raises(ValueError, match="logits_processors must be picklable"):
            llm.generate(prompts[:1], SamplingParams(logits_processors=[lambda ids, row: row]), use_tqdm=False)
        bad = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logits_processors=[fail_on_third_token])
        good = llm.add_request(prompts[0], GREEDY, keep_output=True)
        failing = llm.add_request(prompts[1], bad, keep_output=True)
        while not llm.is_finished():  # the other request finishes as if alone
            llm.step()
        assert llm.pop_output(failing).outputs[0].finish_reason == "error"
        assert llm.pop_output(good)["token_ids"] == generate(llm, prompts[:1])[0]
    finally:
        llm.exit()
    assert_clean(llm)
    output = "".join(capfd.readouterr())  # (the workers write to this process's descriptors)
    assert "leaked" not in output, output


@pytest.mark.timeout(180)
def test_a_stopped_worker_fails_the_step_after_the_timeout(tiny_qwen3, monkeypatch):
    """A worker stopped with SIGSTOP (alive, silent) leaves the step unanswered; past
    NANOINFER_TP_STEP_TIMEOUT_S the step raises a RuntimeError naming the rank, every worker is
    killed, and the engine refuses further use with that error."""
    monkeypatch.setenv(tp_executor.STEP_TIMEOUT_ENV, "3")
    prompt, params = [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = reference(tiny_qwen3, [prompt], params)
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        assert llm.model_runner.step_timeout == 3
        assert generate(llm, prompt, params) == expected
        victim = llm.model_runner.group.procs[1]
        os.kill(victim.pid, signal.SIGSTOP)
        start = time.monotonic()
        message = rf"rank 1: process {victim.pid} did not answer a step within 3 s \(stopped\)"
        with pytest.raises(RuntimeError, match=message):
            generate(llm, prompt, params)
        assert 3 <= time.monotonic() - start < 8
        with pytest.raises(RuntimeError, match="unusable: " + message):
            generate(llm, prompt, params)
        assert llm.is_finished()
    finally:
        llm.exit()
    assert_clean(llm)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_bad_step_timeout(tiny_qwen3, monkeypatch, value):
    monkeypatch.setenv(tp_executor.STEP_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=tp_executor.STEP_TIMEOUT_ENV):
        LLM(tiny_qwen3, tensor_parallel_size=2)
    assert not mp.active_children() and our_segments() == []


STARTUP_SCRIPT = textwrap.dedent("""
    import sys
    from nanoinfer import LLM
    from nanoinfer.engine import worker_group
    if __name__ == "__main__":
        group = worker_group.WorkerGroup
        if sys.argv[2] == "spawn":  # Ctrl-C while the workers start (import torch)
            start = group._start

            def start_and_tell(proc):
                start(proc)
                print("READY", proc.pid, flush=True)
            worker_group.WorkerGroup._start = staticmethod(start_and_tell)
        else:  # Ctrl-C while the ranks join the process group and load their shards
            wait = group.wait

            def tell_and_wait(self, *args, **kwargs):
                print("READY", *[p.pid for p in self.procs], flush=True)
                worker_group.WorkerGroup.wait = wait
                return wait(self, *args, **kwargs)
            worker_group.WorkerGroup.wait = tell_and_wait
        LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
        print("STARTED", flush=True)
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("phase", ["spawn", "load"])
def test_ctrl_c_during_start_up_exits_promptly(tiny_qwen3, tmp_path, phase):
    """Ctrl-C (SIGINT to the process group) while the workers start, or while they load: the
    process exits with KeyboardInterrupt within 2 s, leaving no worker and no segment."""
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
        assert not wait_gone([int(pid) for pid in ready.split()[1:]], 2)
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
        print("PIDS", os.getpid(), *[p.pid for p in llm.model_runner.group.procs], flush=True)
        # a long generation, for the test's signal
        llm.generate([[1, 2, 3]] * 8, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
                     use_tqdm=False)
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_engines_side_by_side_and_one_after_another(tiny_qwen3, tmp_path, monkeypatch, sig):
    """Two TP engines in this process at once (with SIGINT), and one in another process at the same
    time, which then gets Ctrl-C (or SIGKILL) mid-generation: its workers must go too, leaving nothing
    behind; then another engine here after the first ones exit. A tiny segment makes every call outgrow it."""
    monkeypatch.setattr(worker_group, "INITIAL_SEGMENT_BYTES", 128)
    script = tmp_path / "side.py"
    script.write_text(SIDE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    prompt, params = [[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = reference(tiny_qwen3, [prompt], params)

    side = subprocess.Popen([sys.executable, str(script), tiny_qwen3], env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    engines = []
    try:
        if sig == signal.SIGINT:  # (two engines here do not depend on the side's signal: built once)
            engines = [LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
                       for _ in range(2)]
            first, other = engines
            assert first.model_runner.init_method != other.model_runner.init_method
            big = [list(range(1, 100))] * 6  # a prefill payload of several KiB: the segment grows
            assert generate(first, big, params) == generate(other, big[:1], params) * 6
            assert first.model_runner.group.shm.size > 128 and our_segments() == []
            assert generate(first, prompt, params) == expected == generate(other, prompt, params)
        lines = [side.stdout.readline() for _ in range(2)]  # while these engines are alive
        assert [line.split(None, 1)[0] for line in lines if line.strip()] == ["TOKENS", "PIDS"], \
            "".join(lines) + side.stdout.read()
        assert lines[0].split(None, 1)[1].strip() == str(expected[0])
    finally:
        for llm in engines:
            llm.exit()

    # a signal in the middle of the other process's generation
    side_pids = [int(p) for p in lines[1].split()[1:]]
    try:
        time.sleep(0.5)
        os.killpg(side.pid, sig) if sig == signal.SIGINT else os.kill(side.pid, sig)
        out, _ = side.communicate(timeout=60)
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in out
        assert not wait_gone(side_pids, 5)
        assert our_segments(side.pid) == []
        for llm in engines:
            assert_clean(llm)
    finally:
        if side.poll() is None:
            side.kill()
            side.communicate()

    second = LLM(tiny_qwen3, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=128)
    try:
        assert generate(second, prompt, params) == expected
    finally:
        second.exit()
    assert_clean(second)


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


# ---- on two GPUs --------------------------------------------------------------------------------
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture
def nvls_off(monkeypatch):
    """NVLink multicast stays off on the lent machines (set before the workers start NCCL)."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("nvls_off")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_tp2_float32_matches_hf(make_checkpoint, enforce_eager):
    """float32 tp = 2 on two GPUs (CUDA graphs and eager, overlapped steps, mixed batches) against
    HF teacher-forced, token for token."""
    from hf_reference import assert_greedy_matches_hf
    path = make_checkpoint(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128)
    llm = LLM(path, tensor_parallel_size=2, dtype="float32", device="cuda", enforce_eager=enforce_eager,
              kvcache_block_size=16, max_model_len=1024, max_num_seqs=20, max_num_batched_tokens=512)
    try:
        prompts = random_prompts(12, llm.vocab_size, seed=6, lo=1, hi=300)
        assert llm.model_runner.info()["cuda_graphs"] == (not enforce_eager)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert_greedy_matches_hf(path, p, o["token_ids"], tol=1e-3)
    finally:
        llm.exit()
    assert_clean(llm)


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("nvls_off")
def test_cuda_tp2_samples_the_tokens_tp1_samples(make_checkpoint):
    """Temperature sampling at tp = 2 on two GPUs (each rank samples its vocabulary shard) takes the
    tokens tp = 1 takes from the full rows, given the same seed (float32: the logits agree to ~1e-6)."""
    path = make_checkpoint(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128)
    outs = {}
    params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True)
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, dtype="float32", device="cuda", seed=7,
                  kvcache_block_size=16, max_model_len=512, max_num_seqs=16)
        try:
            outs[tp] = generate(llm, [[1 + i, 2, 3, 4, 5] for i in range(12)], params)
        finally:
            llm.exit()
    assert outs[1] == outs[2] and len({tuple(o) for o in outs[1]}) > 1


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("nvls_off")
@pytest.mark.parametrize("victim", [0, 1])
def test_cuda_tp2_killed_worker_raises_within_5_s(make_checkpoint, victim):
    """A rank killed mid-generation on CUDA (its peer then waits in an NCCL collective forever):
    generate raises within 5 s, nothing is left, and a new engine works in the same process."""
    path = make_checkpoint(num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompts = [[1 + i, 2, 3, 4] for i in range(16)]
    llm = LLM(path, tensor_parallel_size=2, device="cuda", kvcache_block_size=16, max_model_len=512)
    try:
        expected = generate(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        pid = llm.model_runner.group.procs[victim].pid
        killed = []
        threading.Timer(1.0, lambda: (os.kill(pid, signal.SIGKILL), killed.append(time.monotonic()))).start()
        with pytest.raises(RuntimeError, match=rf"rank {victim}: process {pid} killed by SIGKILL"):
            while True:
                generate(llm, prompts, params)
        assert killed and time.monotonic() - killed[0] < 5
        assert_clean(llm)
    finally:
        llm.exit()
    again = LLM(path, tensor_parallel_size=2, device="cuda", kvcache_block_size=16, max_model_len=512)
    try:
        assert generate(again, prompts[:2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) == expected
    finally:
        again.exit()
    assert_clean(again)

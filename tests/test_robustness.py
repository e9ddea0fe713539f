"""Issue 15: no interrupt or thread corrupts the engine, and the same tokens give the same text.

- Ctrl-C (a KeyboardInterrupt inside a preemption, and a real SIGINT in the middle of a step)
  propagates, and leaves every block free, no request behind, and the next generate exact;
- abort_request from another thread while generate() drives the engine: no internal error, no
  leaked block;
- requests queued by hand are reported by step(), whoever drove the engine;
- after exit(), every entry point is a clear RuntimeError; exit() from another thread waits for the
  running step;
- a prompt ending inside a UTF-8 character: generate, generate with a stop string and stream give
  the same text, tokenizer.decode of the completion;
- a lone surrogate in a prompt is a ValueError.
Tensor-parallel robustness (a stopped worker, Ctrl-C during start-up) is in test_tensor_parallel.py."""
import os
import random
import signal
import threading
import time

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.scheduler import Scheduler

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SMALL_POOL = dict(kvcache_block_size=BS, max_model_len=128, num_kvcache_blocks=8)  # forces preemption


def random_prompts(n, seed, lo=5, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def token_ids(outs):
    return [o["token_ids"] for o in outs]


def assert_clean(llm):
    """Every block free, no request left, nothing queued or in flight."""
    bm = llm.scheduler.block_manager
    assert llm.is_finished()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.requests


@pytest.fixture(params=[True, False], ids=["overlap", "sync"])
def small(tiny_qwen3, request):
    llm = LLM(tiny_qwen3, async_scheduling=request.param, **SMALL_POOL)
    yield llm
    llm.exit()


def preemption_interrupted(monkeypatch, interrupt):
    """Call interrupt() once, on entry to BlockManager.free during the first preemption."""
    state = {"preempting": False, "done": False}
    preempt, free = Scheduler.preempt, BlockManager.free

    def preempt_spy(self, seq):
        state["preempting"] = True
        try:
            preempt(self, seq)
        finally:
            state["preempting"] = False

    def free_spy(self, seq):
        if state["preempting"] and not state["done"]:
            state["done"] = True
            interrupt()
        free(self, seq)

    monkeypatch.setattr(Scheduler, "preempt", preempt_spy)
    monkeypatch.setattr(BlockManager, "free", free_spy)
    return state


def raise_keyboard_interrupt():
    raise KeyboardInterrupt


def send_sigint():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("interrupt", [raise_keyboard_interrupt, send_sigint], ids=["raised", "SIGINT"])
def test_ctrl_c_during_a_preemption_leaves_the_engine_clean(small, monkeypatch, interrupt):
    """Item 7: a KeyboardInterrupt on entry to BlockManager.free during a preemption (the sequence
    is then in no queue, or in one with its blocks), raised there or sent as a real SIGINT (which
    the engine defers to the step's end). It propagates; afterwards all blocks are free, no request
    is left, and the next generate gives the uninterrupted result."""
    # Python's own Ctrl-C handler, as in an interactive run, whatever launched the tests (a job in
    # the background starts with SIGINT ignored, and the engine leaves an ignored SIGINT alone)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_during_a_preemption(small, monkeypatch, interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_during_a_preemption(small, monkeypatch, interrupt):
    prompts = random_prompts(4, seed=1)  # 4 x up to 5 blocks > 8 blocks
    expected = token_ids(small.generate(prompts, GREEDY, use_tqdm=False))
    assert small.scheduler.num_preemptions > 0, "the small pool should force preemption"
    state = preemption_interrupted(monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        small.generate(prompts, GREEDY, use_tqdm=False)
    assert state["done"]
    assert_clean(small)
    monkeypatch.undo()
    assert token_ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert_clean(small)


@pytest.mark.timeout(600)
def test_abort_from_another_thread_during_generate(small):
    """Item 8: requests queued by hand are aborted from another thread, at arbitrary points of the
    steps generate() runs on this thread, many times: generate's results stay exact, nothing
    raises, no block leaks, and step() reports none of the aborted requests."""
    rng = random.Random(0)
    prompts = random_prompts(3, seed=2)
    LONG = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)  # still running when aborted
    expected = token_ids(small.generate(prompts, GREEDY, use_tqdm=False))
    steps = [0]
    schedule = small.scheduler.schedule

    def counting_schedule(*args):
        steps[0] += 1
        return schedule(*args)

    small.scheduler.schedule = counting_schedule
    errors = []

    def abort_all(rids, gaps):
        try:
            for rid, gap in zip(rids, gaps):
                start = steps[0]
                while steps[0] < start + gap and not stop.is_set():  # a few steps, then abort mid-step
                    stop.wait(0.0005)
                small.abort_request(rid)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    for _ in range(60):
        hand = [small.add_request(p, LONG) for p in random_prompts(3, seed=rng.randrange(10**6))]
        stop = threading.Event()
        aborter = threading.Thread(target=abort_all, args=(hand, [rng.randrange(4) for _ in hand]))
        aborter.start()
        try:
            assert token_ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
        finally:
            stop.set()
            aborter.join(timeout=60)
        assert not aborter.is_alive() and not errors, errors
        reported = []
        while not small.is_finished():
            reported += small.step()[0]
        reported += small.step()[0]
        assert not {rid for rid, _ in reported} & set(hand), "an aborted request was reported (or finished)"
        assert_clean(small)


@pytest.mark.timeout(300)
def test_hand_requests_are_reported_by_step_after_generate_and_stream(tiny_qwen3):
    """Item 9: requests queued with add_request() progress while generate() or stream() drive the
    engine, are left to step(), which reports each once, with the tokens it would have alone."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128)
    try:
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        hand_prompts = random_prompts(2, seed=3)
        alone = token_ids(llm.generate(hand_prompts, short, use_tqdm=False))
        rids = [llm.add_request(p, short) for p in hand_prompts]
        out = llm.generate([[5, 6, 7]], long, use_tqdm=False)
        assert len(out) == 1 and len(out[0]["token_ids"]) == 30
        rids.append(llm.add_request(hand_prompts[0], short))
        deltas = list(llm.stream([[8, 9, 10]], long))
        assert sum(len(d.token_ids) for d in deltas) == 30
        reported = []
        while True:
            pairs, _ = llm.step()
            reported += pairs
            if llm.is_finished() and not pairs:
                break
        assert sorted(reported) == sorted(zip(rids, alone + alone[:1]))
        assert_clean(llm)
    finally:
        llm.exit()


def test_every_entry_point_after_exit_is_a_runtime_error(tiny_qwen3):
    """Item 11."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.exit()
    llm.exit()  # twice is fine
    sp = SamplingParams(max_tokens=2)
    for call in (lambda: llm.generate([[1, 2, 3]], sp, use_tqdm=False), lambda: llm.generate("Hello", sp),
                 lambda: list(llm.stream([[1, 2, 3]], sp)), lambda: llm.add_request([1, 2, 3], sp),
                 lambda: llm.step(), lambda: llm.chat([{"role": "user", "content": "hi"}], sp)):
        with pytest.raises(RuntimeError, match="exited"):
            call()


def test_exit_from_another_thread_waits_for_the_running_step(tiny_qwen3):
    """A step is held inside a logits processor while another thread calls exit(): exit() returns
    only after the step has ended (which must not fail), and the next step is a clear RuntimeError."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128)
    inside, release, events = threading.Event(), threading.Event(), []

    def hold(token_ids, logits):
        if not inside.is_set():
            inside.set()
            release.wait(30)
            events.append("step ends")
        return logits

    llm.add_request([1, 2, 3], SamplingParams(max_tokens=8, logits_processors=[hold]))
    stepper_error = []

    def drive():
        try:
            llm.step()
        except BaseException as e:  # noqa: BLE001 (checked below)
            stepper_error.append(e)

    stepper = threading.Thread(target=drive)
    stepper.start()
    assert inside.wait(30)
    exiter = threading.Thread(target=lambda: (llm.exit(), events.append("exit returns")))
    exiter.start()
    exiter.join(0.3)
    assert exiter.is_alive() and not events  # exit() waits while the step runs
    release.set()
    stepper.join(30)
    exiter.join(30)
    assert not stepper_error
    assert events == ["step ends", "exit returns"]
    with pytest.raises(RuntimeError, match="exited"):
        llm.step()


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=128)
    yield engine
    engine.exit()


def test_prompt_ending_inside_a_character_gives_the_same_text_every_way(llm):
    """Item 10: the prompt ends with the first two of the three bytes of "你", and some completions
    start with bytes that continue no character of their own. generate(), generate() with a stop
    string (incremental detokenization) and stream() give the same text for the same tokens:
    tokenizer.decode of the completion, where each such orphan byte is U+FFFD (the bytes are the
    completion's, the character they would finish is not)."""
    tok = llm.tokenizer
    ids = tok.encode("Hello 你")
    prompt = ids[:-1]
    assert tok.decode(ids[-3:]) == "你" and tok.decode(prompt).endswith("\ufffd")
    sp = dict(n=24, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True)
    plain = llm.generate([prompt], SamplingParams(**sp), use_tqdm=False)[0].outputs
    stopped = llm.generate([prompt], SamplingParams(stop=["\x00\x01"], **sp), use_tqdm=False)[0].outputs
    streamed = [""] * sp["n"]
    for d in llm.stream([prompt], SamplingParams(**sp)):
        streamed[d.completion_index] += d.text
    assert [c.token_ids for c in stopped] == [c.token_ids for c in plain]
    orphans = 0
    for c, s, text in zip(plain, stopped, streamed):
        expected = tok.decode(c.token_ids)
        assert (c.text, s.text, text) == (expected, expected, expected), c.token_ids
        orphans += expected.startswith("\ufffd")
    assert orphans, "no completion starts inside a character: the test checks nothing"


@pytest.mark.parametrize("prompt", ["abc\ud800", "\udfff", {"prompt": "x\udc80y"}])
def test_lone_surrogate_is_a_value_error(llm, prompt):
    """Item 12: not valid Unicode text, named; the engine keeps serving."""
    with pytest.raises(ValueError, match=r"not valid Unicode.*surrogate"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]
    assert_clean(llm)


# ---- issue 27: bounded work per request, one driving thread, non-finite logits -------------------
def _best_of(times, fn):
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_finishing_and_aborting_n_samples_is_linear_in_n(tiny_qwen3):
    """A request's n samples finish and abort in O(n) (they were O(n^2): a scan of the request's
    samples per finished sample, and of the waiting queue per aborted one). A ratio of times, 4x
    the samples: about 4x the time when linear, 16x when quadratic."""
    llm = LLM(tiny_qwen3, max_num_seqs=512, num_kvcache_blocks=2048, kvcache_block_size=BS, max_model_len=64)
    try:
        def abort(n):
            def run():
                rid = llm.add_request("hi", SamplingParams(n=n, max_tokens=4, ignore_eos=True))
                llm.step()  # the first sample prefills; the others wait for its prompt blocks
                llm.abort_request(rid)
                assert llm.is_finished()
            return run

        def finish(n):
            return lambda: llm.generate("hi", SamplingParams(n=n, max_tokens=1, ignore_eos=True), use_tqdm=False)

        for make in (abort, finish):
            small, large = _best_of(3, make(1000)), _best_of(3, make(4000))
            assert large / small < 9, f"{make.__name__}: {small:.3f}s for n=1000, {large:.3f}s for n=4000"
        assert_clean(llm)
    finally:
        llm.exit()


def test_a_second_thread_driving_the_engine_is_refused_at_once(tiny_qwen3):
    """While one thread is inside generate(), another's generate() / stream() / step() is a clear
    RuntimeError at once, queuing nothing; the first thread's results are whole."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS)
    inside, release = threading.Event(), threading.Event()

    def hold(token_ids, logits):
        inside.set()
        release.wait(60)
        return logits

    try:
        result = {}
        first = threading.Thread(target=lambda: result.setdefault("out", llm.generate(
            "hello", SamplingParams(max_tokens=3, temperature=0, logits_processors=[hold]), use_tqdm=False)))
        first.start()
        assert inside.wait(60)
        for call in (lambda: llm.generate("world", GREEDY, use_tqdm=False), lambda: next(llm.stream("x", GREEDY)),
                     llm.step):
            with pytest.raises(RuntimeError, match="driven by one thread"):
                call()
        assert len(llm.requests) == 1  # only the first thread's
        release.set()
        first.join(60)
        assert len(result["out"][0].outputs[0].token_ids) == 3
        assert llm.generate("world", GREEDY, use_tqdm=False)  # this thread may drive it now
        assert_clean(llm)
    finally:
        release.set()
        llm.exit()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_non_finite_logits_fail_that_request_only(tiny_qwen3, overlap):
    """A request whose logits turn NaN (here: the embedding of one token its prompt holds is NaN)
    finishes with finish_reason "error", never a fake "stop"; the other requests of its batches are
    untouched, and the engine serves on."""
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, async_scheduling=overlap)
    try:
        clean = random_prompts(3, seed=5)
        want = token_ids(llm.generate(clean, GREEDY, use_tqdm=False))
        poisoned = 301
        embed = llm.model_runner.model.model.embed_tokens
        plain = embed.forward  # (the weight itself is the tied LM head: a NaN there would reach every row)
        embed.forward = lambda ids: plain(ids).masked_fill((ids == poisoned)[:, None], float("nan"))
        outs = llm.generate([clean[0], [5, poisoned, 7], clean[1], clean[2]],
                            [GREEDY, SamplingParams(max_tokens=5, n=2, temperature=0.8, logprobs=1), GREEDY, GREEDY],
                            use_tqdm=False)
        assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
        assert all(not c.token_ids for c in outs[1].outputs)
        assert token_ids([outs[0], outs[2], outs[3]]) == want
        assert token_ids(llm.generate(clean, GREEDY, use_tqdm=False)) == want
        assert_clean(llm)
    finally:
        llm.exit()

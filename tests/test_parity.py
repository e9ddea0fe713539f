"""vLLM parity (issue 14) on the tiny checkpoint: prompt_logprobs against HF, logit_bias,
allowed_token_ids, bad_words, logits_processors (with overlapped steps), detokenize=False,
truncate_prompt_tokens, max_tokens past max_model_len, the exports, the TP main-guard error, and
small API conveniences."""
import subprocess
import sys
import textwrap

import pytest
import torch

import nanoinfer
from nanoinfer import LLM, SamplingParams
from nanoinfer.outputs import CompletionOutput, Logprob, RequestOutput

from hf_reference import hf_model

BS = 16
PROMPT = "The quick brown fox jumps over the lazy dog. Hello, my name is"


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def llm(request, tiny_qwen3):
    engine = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=96, num_kvcache_blocks=48,
                 async_scheduling=request.param)
    yield engine
    engine.exit()


def hf_logits(path, token_ids):
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


def greedy(**kw):
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def assert_clean(llm):
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == bm.num_blocks and not llm.requests


# ---- prompt_logprobs ------------------------------------------------------------------------------
def check_prompt_logprobs(out, path, k):
    ids = out.prompt_token_ids
    lp = torch.log_softmax(hf_logits(path, ids), -1)
    pl = out.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] is None
    for p in range(1, len(ids)):
        d, tok, row = pl[p], ids[p], lp[p - 1]
        assert isinstance(d[tok], Logprob)
        assert abs(d[tok].logprob - row[tok].item()) < 1e-4
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        others = [t for t in d if t != tok]
        assert set(top.indices.tolist()) - {tok} == set(others)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[t].logprob - v) < 1e-4
        assert d[top.indices[0].item()].rank == 1


def test_prompt_logprobs_match_hf_in_a_mixed_batch(llm, tiny_qwen3):
    llm.generate([PROMPT], greedy(max_tokens=2), use_tqdm=False)  # warm the prefix cache
    plain = llm.generate(["Hello, my name is"], greedy(max_tokens=8), use_tqdm=False)[0]
    outs = llm.generate([PROMPT, "Hello, my name is"], [greedy(max_tokens=4, prompt_logprobs=3),
                                                         greedy(max_tokens=8)], use_tqdm=False)
    assert outs[0].num_cached_tokens == 0, "a prompt_logprobs request takes no prefix-cache hit"
    check_prompt_logprobs(outs[0], tiny_qwen3, 3)
    assert outs[1].prompt_logprobs is None and outs[1]["token_ids"] == plain["token_ids"]
    zero = llm.generate([PROMPT], greedy(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(len(d) == 1 for d in zero.prompt_logprobs[1:])  # the prompt token alone
    assert_clean(llm)


def test_prompt_logprobs_with_chunked_prefill_and_n(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=96, num_kvcache_blocks=48, max_num_batched_tokens=7)
    try:
        out = llm.generate([PROMPT], SamplingParams(n=2, max_tokens=3, seed=1, prompt_logprobs=2), use_tqdm=False)[0]
        assert len(out.outputs) == 2
        check_prompt_logprobs(out, tiny_qwen3, 2)
        assert_clean(llm)
    finally:
        llm.exit()


# ---- logit_bias / allowed_token_ids --------------------------------------------------------------
def teacher_forced(path, prompt_ids, completion, adjust):
    """HF logits at each generated position, `adjust`ed as the request's options say."""
    logits = hf_logits(path, prompt_ids + completion)[len(prompt_ids) - 1:-1]
    return adjust(logits)


def assert_greedy_of(logits, completion):
    ours = logits.gather(1, torch.tensor(completion)[:, None])[:, 0]
    assert (logits.max(-1).values - ours <= 1e-4).all(), "not the argmax of the adjusted logits"


def test_logit_bias_constrains_greedy_and_seeded_sampling(llm, tiny_qwen3):
    base = llm.generate([PROMPT], greedy(max_tokens=8), use_tqdm=False)[0]
    bias = {t: -100.0 for t in set(base["token_ids"])} | {41: 3.0}
    outs = llm.generate([PROMPT, PROMPT], [greedy(max_tokens=8, logit_bias=bias), greedy(max_tokens=8)],
                        use_tqdm=False)
    got = outs[0]["token_ids"]
    assert not set(got) & set(base["token_ids"])
    vec = torch.zeros(len(llm.tokenizer))
    for t, b in bias.items():
        vec[t] = b
    assert_greedy_of(teacher_forced(tiny_qwen3, base.prompt_token_ids, got, lambda x: x + vec), got)
    assert outs[1]["token_ids"] == base["token_ids"], "the plain request beside it is unchanged"
    forced = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                   logit_bias={57: 100}), use_tqdm=False)[0]
    assert forced["token_ids"] == [57] * 8


def test_allowed_token_ids_constrain_greedy_and_seeded_sampling(llm, tiny_qwen3):
    allowed = [11, 40, 57, 90, 200]
    g = llm.generate([PROMPT], greedy(max_tokens=8, allowed_token_ids=allowed), use_tqdm=False)[0]
    mask = torch.full((len(llm.tokenizer),), float("-inf"))
    mask[allowed] = 0
    assert_greedy_of(teacher_forced(tiny_qwen3, g.prompt_token_ids, g["token_ids"], lambda x: x + mask),
                     g["token_ids"])
    sp = SamplingParams(temperature=1.5, seed=5, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    a, b, _ = llm.generate([PROMPT, PROMPT, "Hello"], [sp, sp, SamplingParams(max_tokens=5)], use_tqdm=False)
    assert set(a["token_ids"]) <= set(allowed) and len(set(a["token_ids"])) > 1
    assert a["token_ids"] == b["token_ids"], "seeded: the same whatever the batch"


# ---- bad_words -----------------------------------------------------------------------------------
def contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_emit_the_banned_continuation(llm):
    tok = llm.tokenizer
    base = llm.generate([PROMPT], greedy(max_tokens=24), use_tqdm=False)[0]["token_ids"]
    # a two-token word the model does produce, that encodes back to the same two tokens
    word = next(w for w in (tok.decode(base[i:i + 2]) for i in range(len(base) - 1))
                if len(tok.encode(w.lstrip(), add_special_tokens=False)) == 2 or
                len(tok.encode(" " + w.lstrip(), add_special_tokens=False)) == 2)
    one = tok.decode([base[0]]).strip() or "the"
    sp = greedy(max_tokens=24, bad_words=[word, one])
    variants = sp.with_bad_words_token_ids(tok).bad_words_token_ids
    assert any(len(v) == 2 and contains(base, v) for v in variants), "the unconstrained output has the word"
    outs = llm.generate([PROMPT, PROMPT], [sp, greedy(max_tokens=24)], use_tqdm=False)
    got = outs[0]["token_ids"]
    for v in variants:
        assert not contains(got, v), f"banned {v} in {got}"
    assert outs[1]["token_ids"] == base
    seeded = llm.generate([PROMPT], SamplingParams(seed=2, max_tokens=24, ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)[0]["token_ids"]
    assert not any(contains(seeded, v) for v in variants)


# ---- logits_processors ---------------------------------------------------------------------------
def test_logits_processors_see_every_output_token(llm):
    """The forced token depends on the whole history, so a stale output_token_ids (a token still in
    flight) would change it; the plain requests beside it are unaffected."""
    seen, seen3 = [], []

    def force(output_ids, row):
        seen.append(list(output_ids))
        row[:] = float("-inf")
        row[(sum(output_ids) * 7 + len(output_ids)) % 300 + 5] = 0.0
        return row

    def with_prompt(prompt_ids, output_ids, row):
        seen3.append((len(prompt_ids), len(output_ids)))
        return row

    plain = llm.generate([PROMPT, "Hello"], greedy(max_tokens=12), use_tqdm=False)
    sps = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, logits_processors=[force]),
           greedy(max_tokens=12), greedy(max_tokens=12, logits_processors=[with_prompt])]
    outs = llm.generate([PROMPT, PROMPT, "Hello"], sps, use_tqdm=False)
    got = outs[0]["token_ids"]
    want = []
    for _ in range(10):
        want.append((sum(want) * 7 + len(want)) % 300 + 5)
    assert got == want
    assert seen == [want[:i] for i in range(10)]
    assert outs[1]["token_ids"] == plain[0]["token_ids"]
    assert outs[2]["token_ids"] == plain[1]["token_ids"]  # an identity processor changes nothing
    n = len(outs[2].prompt_token_ids)
    assert seen3 == [(n, i) for i in range(12)]
    assert_clean(llm)


def test_a_request_needing_host_tokens_skips_steps_with_its_token_in_flight(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=96, num_kvcache_blocks=48)
    try:
        slow = llm.add_request("Hello", greedy(max_tokens=6, logits_processors=[lambda ids, row: row]))
        fast = llm.add_request("Hello", greedy(max_tokens=6))
        rows = []
        while not llm.is_finished():
            llm.step()
            if llm.inflight is not None:
                rows.append(sorted(s.seq_id for s in llm.inflight.batch.seqs))
        assert rows[:3] == [sorted([slow, fast]), [fast], sorted([slow, fast])]
    finally:
        llm.exit()


# ---- detokenize / truncate_prompt_tokens / spaces_between_special_tokens --------------------------
def test_detokenize_false_gives_tokens_without_text(llm):
    with_text = llm.generate([PROMPT], greedy(max_tokens=6, logprobs=2), use_tqdm=False)[0]
    out = llm.generate([PROMPT], greedy(max_tokens=6, logprobs=2, detokenize=False), use_tqdm=False)[0]
    assert out["token_ids"] == with_text["token_ids"] and with_text["text"] and out["text"] == ""
    assert all(lp.decoded_token is None for d in out["logprobs"] for lp in d.values())
    deltas = list(llm.stream([PROMPT], greedy(max_tokens=6, detokenize=False)))
    assert [t for d in deltas for t in d.token_ids] == out["token_ids"] and all(d.text == "" for d in deltas)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([PROMPT], greedy(max_tokens=5, truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-6:] and out.prompt == PROMPT
    assert out["token_ids"] == llm.generate([ids[-6:]], greedy(max_tokens=5), use_tqdm=False)[0]["token_ids"]
    assert llm.generate([ids], greedy(max_tokens=2, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0].prompt_token_ids == ids  # -1: max_model_len, longer than this prompt
    long = list(range(5, 125))
    assert llm.generate([long], greedy(max_tokens=2, truncate_prompt_tokens=50),
                        use_tqdm=False)[0].prompt_token_ids == long[-50:]
    # -1 keeps what can be admitted: max_model_len (96) less one output token
    out = llm.generate([long], greedy(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-95:] and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="truncate_prompt_tokens.*max_model_len"):
        llm.generate([ids], greedy(truncate_prompt_tokens=97), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_spaces_between_special_tokens_is_a_validated_option():
    assert SamplingParams().spaces_between_special_tokens is True
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    with pytest.raises(TypeError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=0)


def test_spaces_between_special_tokens_reaches_the_tokenizer(llm, monkeypatch):
    """It is the tokenizer's option (slow tokenizers use it, fast ones ignore it, as in vLLM): every
    decode of the completion, one-shot and streamed, passes it on."""
    seen = []
    real = type(llm.tokenizer).decode

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("spaces_between_special_tokens"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(llm.tokenizer), "decode", spy)
    for flag in (False, True):
        seen.clear()
        llm.generate([PROMPT], greedy(max_tokens=4, spaces_between_special_tokens=flag), use_tqdm=False)
        list(llm.stream([PROMPT], greedy(max_tokens=4, spaces_between_special_tokens=flag)))
        assert seen and set(seen) == {flag}


# ---- length limits -------------------------------------------------------------------------------
def test_max_tokens_past_max_model_len_stops_at_it(llm):
    out = llm.generate([[5] * 90], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 96 - 90
    last = llm.generate([[5] * 95], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(last["token_ids"]) == 1 and last["finish_reason"] == "length"
    with pytest.raises(ValueError, match="max_model_len=96"):
        llm.add_request([5] * 96, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt length 90 \+ max_tokens 50 = 140 exceeds max_model_len=96"):
        llm.add_requests([[5], [5] * 90], [SamplingParams(max_tokens=50)] * 2, max_tokens_must_fit=True)  # the server's rule
    assert_clean(llm)


# ---- exports, conveniences -----------------------------------------------------------------------
def test_exports():
    assert nanoinfer.RequestOutput is RequestOutput and nanoinfer.CompletionOutput is CompletionOutput
    assert nanoinfer.Logprob is Logprob
    assert {"LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"} <= set(nanoinfer.__all__)


def test_tokenizer_tqdm_factory_and_batch_error_index(llm):
    assert llm.get_tokenizer() is llm.tokenizer
    made = []

    def factory(**kw):
        from tqdm import tqdm
        made.append(kw["total"])
        return tqdm(**kw)

    llm.generate(["Hello", "Hi"], greedy(max_tokens=2), use_tqdm=factory)
    assert made == [2]
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*allowed_token_ids"):
        llm.generate(["Hello", "Hi"], [greedy(), greedy(allowed_token_ids=[10 ** 6])], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: .*logit_bias"):
        llm.generate(["Hello", "Hi"], [greedy(logit_bias={10 ** 6: 1.0}), greedy()], use_tqdm=False)
    assert_clean(llm)


def run_script(tmp_path, body: str):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))


def test_tp_engine_without_main_guard_is_a_clear_error(tiny_qwen3, tmp_path):
    res = run_script(tmp_path, f"""
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(nanoinfer.__file__).parents[1])!r})
        from nanoinfer import LLM
        llm = LLM({tiny_qwen3!r}, tensor_parallel_size=2, device="cpu")
        print("made")
        """)
    assert res.returncode != 0 and "made" not in res.stdout
    assert 'if __name__ == "__main__":' in res.stderr and "line 5" in res.stderr, res.stderr[-2000:]


def test_main_guard_check_itself(tmp_path):
    root = str(__import__("pathlib").Path(nanoinfer.__file__).parents[1])
    res = run_script(tmp_path, f"""
        import multiprocessing, sys
        sys.path.insert(0, {root!r})
        from nanoinfer.utils.main_guard import check_main_guard

        def make():
            check_main_guard()

        if __name__ == "__main__":
            make()  # guarded: fine
            print("guarded ok")
            multiprocessing.current_process()._inheriting = True  # as while a spawned child imports main
            try:
                make()
            except RuntimeError as e:
                print("inheriting:", e)
            del multiprocessing.current_process()._inheriting
        make()
        """)
    assert "guarded ok" in res.stdout and "inheriting: " in res.stdout and "__main__" in res.stdout
    assert res.returncode != 0 and "line 18" in res.stderr, res.stderr[-2000:]

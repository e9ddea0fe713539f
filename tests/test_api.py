"""The vLLM-style offline API on the tiny checkpoint: outputs, logprobs vs HF, seeds, stop strings,
stop token ids, min_tokens, n > 1 block sharing, chat, streaming, abort, incremental detokenization."""
import copy
import random

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.detokenizer import IncrementalDetokenizer, decode, decoder
from nanoinfer.outputs import RequestOutput

from hf_reference import hf_model

BS = 16
PROMPTS = ["Hello, my name is", "The quick brown fox", "café résumé 你好", "list all prime numbers within 100"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, kvcache_block_size=BS, max_model_len=256, num_kvcache_blocks=64)
    yield engine
    engine.exit()


def assert_all_blocks_free(llm):
    bm = llm.scheduler.block_manager
    assert llm.is_finished()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.requests  # the one request registry


def greedy(llm, prompt, max_tokens=24, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw),
                        use_tqdm=False)[0]


def test_request_output_shape(llm):
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert isinstance(out, RequestOutput) and out.finished and out.prompt == prompt
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        c = out.outputs[0]
        assert out["text"] == c.text and out["token_ids"] == c.token_ids and len(c.token_ids) == 6
        assert out["finish_reason"] == c.finish_reason == "length" and c.stop_reason is None
        assert c["text"] == c.text and c["token_ids"] == c.token_ids and c["finish_reason"] == "length"
        with pytest.raises(KeyError):
            c["nope"]
        assert c.index == 0 and c.logprobs is None and c.cumulative_logprob is None
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        with pytest.raises(KeyError):
            out["nope"]
    assert_all_blocks_free(llm)


def test_logprobs_match_hf(llm, tiny_qwen3):
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=4)
    out = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    c = out.outputs[0]
    ids = torch.tensor([out.prompt_token_ids + c.token_ids])
    with torch.no_grad():
        logits = hf_model(tiny_qwen3)(ids).logits[0, len(out.prompt_token_ids) - 1:-1].float()
    ref = torch.log_softmax(logits, -1)
    assert len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for pos, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
        assert tok in lps
        lo = int((ref[pos] > ref[pos, tok] + 1e-5).sum()) + 1  # the rank, up to ties
        hi = int((ref[pos] > ref[pos, tok] - 1e-5).sum()) + 1
        assert lo <= lps[tok].rank <= hi
        # the dict holds the top 4 (and the sampled token, which is in them or below them)
        assert len(lps) in (4, 5) and sorted(lp.rank for t, lp in lps.items() if t != tok or len(lps) == 4)[:4] == [1, 2, 3, 4]
        torch.testing.assert_close(torch.tensor(sorted(lp.logprob for lp in lps.values())[-4:]),
                                   ref[pos].topk(4).values.flip(0), atol=1e-4, rtol=0)
        for t, lp in lps.items():
            assert abs(lp.logprob - ref[pos, t].item()) < 1e-4
            assert lp.decoded_token == llm.tokenizer.decode([t])
        total += lps[tok].logprob
    assert abs(c.cumulative_logprob - total) < 1e-6


def test_seeded_independent_of_batch_and_position(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0]["token_ids"]
    other = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)
    for position in (0, 1, 3):
        prompts = list(PROMPTS[1:])
        prompts.insert(position, PROMPTS[0])
        params = [other] * len(prompts)
        params[position] = sp
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[position]["token_ids"] == alone
    unseeded = {tuple(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
                      ["token_ids"]) for _ in range(3)}
    assert len(unseeded) > 1


def test_top_k_1_is_greedy(llm):
    want = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                                 use_tqdm=False)]
    got = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=20,
                                                                        ignore_eos=True), use_tqdm=False)]
    assert got == want


def _clean_multi_token_stop(llm, ids):
    """A stop string made of 3 whole tokens whose first occurrence in the text starts where they do."""
    text = decode(llm.tokenizer, ids)
    for j in range(1, len(ids) - 3):
        head, stop = decode(llm.tokenizer, ids[:j]), decode(llm.tokenizer, ids[j:j + 3])
        if "\ufffd" in head + stop or len(stop) < 3 or not text.startswith(head):
            continue
        if text.find(stop) == len(head) and len({len(decode(llm.tokenizer, [t])) for t in ids[j:j + 3]}) >= 1:
            return j, head, stop
    return None


def test_stop_string_spanning_tokens(llm):
    found = None
    for prompt in PROMPTS + ["Once upon a time", "Paris. what is"]:
        base = greedy(llm, prompt, max_tokens=40)
        found = _clean_multi_token_stop(llm, base["token_ids"])
        if found:
            break
    assert found, "no usable stop string in the greedy outputs"
    j, head, stop = found
    for include in (False, True):
        out = greedy(llm, prompt, max_tokens=40, stop=["never-there", stop], include_stop_str_in_output=include)
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == base["token_ids"][:j + 3]  # stopped at the token completing it
        assert c.text == (head + stop if include else head)
    assert_all_blocks_free(llm)


def test_stop_token_ids(llm):
    base = greedy(llm, PROMPTS[2], max_tokens=30)["token_ids"]
    stop_id = base[5]
    first = base.index(stop_id)
    out = greedy(llm, PROMPTS[2], max_tokens=30, stop_token_ids=[stop_id])
    c = out.outputs[0]
    assert c.token_ids == base[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.text == decode(llm.tokenizer, base[:first])  # the stop token is not in the text
    # min_tokens: the stop token cannot end it before min_tokens tokens
    out = greedy(llm, PROMPTS[2], max_tokens=30, stop_token_ids=[stop_id], min_tokens=first + 3)
    ids = out["token_ids"]
    assert stop_id not in ids[:first + 3] and len(ids) >= first + 3
    assert out.outputs[0].finish_reason == "length" or ids[-1] == stop_id


def test_min_tokens_suppresses_eos(llm):
    eos = llm.tokenizer.eos_token_id
    # a prompt of EOS-ish context; sample hot so EOS would come early without min_tokens
    sp = SamplingParams(temperature=2.0, max_tokens=12, min_tokens=12, seed=3, stop_token_ids=[5, 6])
    for out in llm.generate(PROMPTS * 4, sp, use_tqdm=False):
        ids = out["token_ids"]
        assert len(ids) == 12 and not set(ids) & (set(llm.eos_token_ids) | {5, 6, eos})


def test_n_shares_prompt_blocks(llm):
    prompt = list(range(20, 60))  # 40 tokens: 2 full blocks + 8 tokens
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    rid = llm.add_request(prompt, sp)
    seqs = llm.requests[rid].seqs
    assert len(seqs) == 3
    max_refs = 0
    bm = llm.scheduler.block_manager
    llm.step_log = []
    while not llm.is_finished():
        llm.step()
        if seqs[0].block_table:
            max_refs = max(max_refs, bm.blocks[seqs[0].block_table[0]].ref_count)
    prefill_tokens = sum(q for r in llm.step_log for q, _ in r.rows[r.num_decode:])
    llm.step_log = None
    assert prefill_tokens == 40 + 2 * 8  # the siblings computed only the last partial block
    assert max_refs == 3
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32]
    assert len({tuple(s.completion_token_ids) for s in seqs}) > 1
    assert_all_blocks_free(llm)

    outs = llm.generate([prompt, PROMPTS[0]], SamplingParams(n=2, max_tokens=5, ignore_eos=True, seed=1),
                        use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2] and [c.index for c in outs[0].outputs] == [0, 1]
    assert all(len(c.token_ids) == 5 for o in outs for c in o.outputs)
    assert_all_blocks_free(llm)


def test_chat(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is the capital of France?"}]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.chat(conv, sp, use_tqdm=False)
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwhat is the capital of France?<|im_end|>\n" \
           "<|im_start|>assistant\n"
    assert len(outs) == 1 and outs[0].prompt == want
    assert outs[0]["token_ids"] == greedy(llm, want, max_tokens=5)["token_ids"]
    two = llm.chat([conv, conv[1:]], sp, add_generation_prompt=False, use_tqdm=False)
    assert len(two) == 2 and not two[1].prompt.endswith("assistant\n")
    custom = llm.chat(conv[1:], sp, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}", use_tqdm=False)
    assert custom[0].prompt == conv[1]["content"]
    saved = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="chat template"):
            llm.chat(conv, sp)
    finally:
        llm.tokenizer.chat_template = saved
    with pytest.raises(TypeError):
        llm.chat([conv, [{"role": "user"}]], sp)
    assert_all_blocks_free(llm)


def test_stream_deltas_concatenate(llm):
    params = [SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, seed=6, max_tokens=25, logprobs=1),
              SamplingParams(temperature=0, max_tokens=30, stop=["e", "ab"], ignore_eos=True)]
    prompts = ["café 你好 🙂", "你好，世界！", "Hello, my name is"]
    texts, ids, finals, lps = {}, {}, {}, {}
    for d in llm.stream(prompts, params):
        key = (d.index, d.completion_index)
        assert key not in finals, "delta after the finished one"
        texts[key] = texts.get(key, "") + d.text
        ids[key] = ids.get(key, []) + d.token_ids
        if d.logprobs is not None:
            lps[key] = lps.get(key, []) + d.logprobs
        if d.finished:
            finals[key] = d
        if d.output is not None:
            assert d.output.finished
            for c in d.output.outputs:
                assert texts[(d.index, c.index)] == c.text and ids[(d.index, c.index)] == c.token_ids
                if c.logprobs is not None:
                    assert lps[(d.index, c.index)] == c.logprobs
    assert set(finals) == {(0, 0), (1, 0), (1, 1), (2, 0)}
    # same tokens as generate (seeded), and the text of a full decode when no stop string cut it
    again = llm.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    assert again["token_ids"] == ids[(0, 0)] and again["text"] == texts[(0, 0)]
    assert texts[(0, 0)] == decode(llm.tokenizer, ids[(0, 0)])
    assert_all_blocks_free(llm)


def test_stream_survives_generate_and_another_stream_driving_the_engine(llm):
    """Deltas made while another caller drives the engine reach the stream later: each caller
    gets its complete output, whatever the interleaving on one thread."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["hello", "abc"], sp, use_tqdm=False)
    g = llm.stream("hello", sp)
    first = next(g)
    other = llm.generate("world", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    rest = list(g)
    assert first.token_ids + [t for d in rest for t in d.token_ids] == alone[0]["token_ids"]
    assert len(other[0]["token_ids"]) == 50 and rest[-1].finished
    a, b = llm.stream("hello", sp), llm.stream("abc", sp)
    ids = {0: [], 1: []}
    done = set()
    while len(done) < 2:  # alternate the two generators
        for key, gen in ((0, a), (1, b)):
            if key not in done:
                d = next(gen, None)
                if d is None:
                    done.add(key)
                else:
                    ids[key] += d.token_ids
    assert ids[0] == alone[0]["token_ids"] and ids[1] == alone[1]["token_ids"]
    assert_all_blocks_free(llm)


def test_take_stream_deltas_takes_a_step_of_the_given_requests_at_once(llm):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = llm.add_requests(PROMPTS[:2], [sp, SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=6, logprobs=2)],
                            stream=True, keep_output=True)
    other = llm.add_request(PROMPTS[2], sp, stream=True, keep_output=True)
    texts, ids, lps, done = {}, {}, {}, set()
    while not llm.is_finished():
        llm.advance()
        deltas = llm.take_stream_deltas({a, b})
        keys = [(d.request_id, d.completion_index) for d in deltas]
        assert len(keys) == len(set(keys)) and not done & set(keys)  # one delta per completion and step
        for d in deltas:
            assert d.request_id in (a, b) and d.index == (0 if d.request_id == a else 1)  # its add_requests position
            key = (d.request_id, d.completion_index)
            texts[key] = texts.get(key, "") + d.text
            ids[key] = ids.get(key, []) + d.token_ids
            lps[key] = lps.get(key, []) + (d.logprobs or [])
            if d.finished:
                done.add(key)
    assert done == {(a, 0), (b, 0), (b, 1)}
    for rid in (a, b):
        for c in llm.pop_output(rid).outputs:
            assert (texts[(rid, c.index)], ids[(rid, c.index)]) == (c.text, c.token_ids)
            assert lps[(rid, c.index)] == (c.logprobs or [])
    rest = llm.stream_deltas(other)  # the request not asked for kept its news
    out = llm.pop_output(other)
    assert "".join(d.text for d in rest) == out["text"] and sum((d.token_ids for d in rest), []) == out["token_ids"]
    assert not llm.output_processor.news  # popped requests are forgotten
    assert_all_blocks_free(llm)


def test_decoder_calls_the_rust_backend_and_decodes_the_same(llm):
    """A stock fast tokenizer is decoded by its backend, skipping the Python wrapper's per-call
    cost (streaming decodes twice a token); the text is the wrapper's, special tokens and ids past
    the vocabulary included."""
    tok = copy.copy(llm.tokenizer)  # (its own attributes: the spy below stays on it)
    rng = random.Random(0)
    cases = [[rng.randrange(len(tok) + 8) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    cases += [[0, 1, 2, 5, 1, 6]]  # special tokens between others
    want = {(tuple(ids), skip): tok.decode([t for t in ids if t < len(tok)], skip_special_tokens=skip,
                                           clean_up_tokenization_spaces=False)
            for ids in cases for skip in (True, False)}
    tok.decode = lambda *a, **k: pytest.fail("the Python wrapper was called")
    for (ids, skip), text in want.items():
        assert decoder(tok, skip)(list(ids)) == text == decode(tok, list(ids), skip)


def test_decoder_keeps_a_tokenizer_class_that_overrides_decode(llm):
    tok = copy.copy(llm.tokenizer)

    class Shouting(type(tok)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    tok.__class__ = Shouting
    ids = tok.encode("Hello, my name is")
    assert decoder(tok)(ids) == llm.tokenizer.decode(ids).upper()


def test_stream_close_early_aborts(llm):
    gen = llm.stream(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True))
    for i, _ in enumerate(gen):
        if i == 5:
            break
    gen.close()
    assert_all_blocks_free(llm)


def test_abort_request_frees_blocks(llm):
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [llm.add_request(list(range(10, 10 + 20 * (i + 1))), sp) for i in range(3)]
    ids.append(llm.add_request(list(range(5, 45)), SamplingParams(n=3, max_tokens=30, ignore_eos=True)))
    finished = {}
    for _ in range(3):
        finished.update(llm.step()[0])
    llm.abort_request(ids[1])
    llm.abort_request(ids[3])  # all three samples
    llm.abort_request(12345678)  # unknown: ignored
    while not llm.is_finished():
        finished.update(llm.step()[0])
    assert set(finished) == {ids[0], ids[2]} and all(len(v) == 30 for v in finished.values())
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.requests


def test_bad_batch_adds_nothing(llm):
    good = SamplingParams(n=2, max_tokens=4)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["a", "b"], [good, SamplingParams(stop_token_ids=[10**6])], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["a", [1] * 300], [good, SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.stream(["a"], SamplingParams(logprobs=10**6))
    assert llm.is_finished() and not llm.requests
    assert_all_blocks_free(llm)


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    """vLLM's rule: logprobs / prompt_logprobs = -1 return every token's logprob; the caller's
    SamplingParams is left as given, and the values equal an explicit vocabulary-sized request."""
    sp = SamplingParams(max_tokens=3, temperature=0, logprobs=-1, prompt_logprobs=-1)
    vocab = llm.vocab_size
    whole = llm.generate(["hello there"], sp, use_tqdm=False)[0]
    assert (sp.logprobs, sp.prompt_logprobs) == (-1, -1)
    explicit = llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0, logprobs=vocab,
                                                            prompt_logprobs=vocab), use_tqdm=False)[0]
    completion = whole.outputs[0]
    assert [len(step) for step in completion.logprobs] == [vocab] * 3
    assert all(len(p) == vocab for p in whole.prompt_logprobs[1:])
    for got, want in zip(completion.logprobs, explicit.outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in got.items()} == {t: lp.logprob for t, lp in want.items()}
    assert sorted(completion.logprobs[0]) == list(range(vocab))


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": "hello"}, "prompt_token_ids"),       # text where ids belong: not tokenized
    ({"prompt": 123, "prompt_token_ids": [1, 2]}, "'prompt'"),  # would become the output's prompt
    ({"prompt": [1, 2]}, "'prompt'"),
])
def test_bad_prompt_dict_types(llm, prompt, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(["ok", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert llm.generate({"prompt": "a", "prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].prompt == "a"


@pytest.mark.parametrize("ids, error, match", [
    ([1, True, 2], TypeError, "list of ints"),
    ([1, 2.0], TypeError, "list of ints"),
    ([1, "2"], TypeError, "list of ints"),
    ([3, -1, 4], ValueError, r"in \[0, \d+\), got \[-1\]"),
    ([5, 10**9], ValueError, r"got \[1000000000\]"),
])
def test_token_id_prompts_checked(llm, ids, error, match):
    with pytest.raises(error, match=match):
        llm.generate([[1, 2], ids], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_numpy_token_ids_equal_ints(llm):
    import numpy as np
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ints, numpy_ints = llm.generate([[5, 6, 7], [np.int64(5), np.int32(6), 7]], sp, use_tqdm=False)
    assert ints.prompt_token_ids == numpy_ints.prompt_token_ids == [5, 6, 7]
    assert [type(t) for t in numpy_ints.prompt_token_ids] == [int] * 3
    assert ints.outputs[0].token_ids == numpy_ints.outputs[0].token_ids


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([[1] * 200], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 56 and out["finish_reason"] == "length"


def test_progress_bar(llm, capsys):
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "est. speed input:" in err and "output:" in err


def test_incremental_detokenizer_multibyte(llm):
    tok = copy.copy(llm.tokenizer)  # (its own attributes: the spy below stays on it)
    rng = random.Random(0)
    samples = [tok.encode(t) for t in ["Naïve café résumé — 你好，世界！ emoji 🙂 numbers", "🙂🙂 你好 café"]]
    samples += [[rng.randrange(len(tok)) for _ in range(60)] for _ in range(20)]  # invalid UTF-8 too
    split = 0
    for ids in samples:
        for skip in (True, False):
            d = IncrementalDetokenizer(tok, [1, 2], SamplingParams(skip_special_tokens=skip))
            pieces = []
            for i, t in enumerate(ids):
                before = len(d.text)
                d.add(t, final=i == len(ids) - 1)
                pieces.append(d.text[before:])
                assert "\ufffd" not in pieces[-1] or i == len(ids) - 1 or not d.text.endswith("\ufffd")
            assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=skip)
            split += sum(1 for t in ids if "\ufffd" in tok.decode([t]))
    assert split > 0  # the corpus does split characters across tokens

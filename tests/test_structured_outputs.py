"""Structured outputs (xgrammar) offline: a random-weight model's output under a grammar always
matches it (JSON schema, regex, choice, EBNF grammar, any JSON object), and ends with
finish_reason "stop" once the grammar is complete; each of n samples has its own matcher; structured
and unconstrained requests share a batch without changing the unconstrained greedy tokens, with
overlapped steps on and off and with tensor parallelism; bad specs are a ValueError naming the
field; finished and aborted sequences free their matchers; the device bitmask equals xgrammar's."""
import json
import re
import weakref

import pytest
import torch

from nanoinfer.structured.feature import StructuredFeature
from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from test_engine_loop import failing_processor

xgr = pytest.importorskip("xgrammar")  # (a test dependency: pyproject's test extra)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CITIES = ["Paris", "London", "Tokyo", "São Paulo", 'say "hi"']
YES_NO = 'root ::= answer " " digit digit? digit?\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
YES_NO_RE = r"(yes|no) [0-9]{1,3}"
ANSWER_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<answer>"}, {"type": "json_schema", "json_schema": {"enum": ["UTC", "CET"]}},
    {"type": "const_string", "value": "</answer>"}]}}
PROMPTS = ["Hello, my name is", "The quick brown fox", "list all prime numbers within 100",
           "what is the capital of France?"]


def check_person(text: str):
    obj = json.loads(text)  # strict: no raw control characters in strings
    assert set(obj) == {"name", "age", "ok", "tags"}, obj
    assert isinstance(obj["name"], str) and re.fullmatch(r"[a-z]{1,6}", obj["name"]), obj
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120, obj
    assert type(obj["ok"]) is bool, obj
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3, obj
    assert all(t in ("red", "green", "blue") for t in obj["tags"]), obj


def structured(max_tokens=120, temperature=1.0, seed=None, n=1, **spec):
    return SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def check_json_object(text: str, finish_reason: str):
    """Keys and strings are unbounded: a random model may reach max_tokens inside one."""
    assert text.startswith("{"), text
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text


# what each kind is checked against (check(text) for the kinds whose every output must end, "stop")
KINDS = {
    "json": (dict(json=PERSON, disable_any_whitespace=True), check_person),
    "regex": (dict(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text) or pytest.fail(text)),
    "choice": (dict(choice=CITIES), lambda text: text in CITIES or pytest.fail(text)),
    "grammar": (dict(grammar=YES_NO), lambda text: re.fullmatch(YES_NO_RE, text) or pytest.fail(text)),
    "structural_tag": (dict(structural_tag=ANSWER_TAG),
                       lambda text: re.fullmatch(r'<answer>"(UTC|CET)"</answer>', text) or pytest.fail(text)),
}
UNBOUNDED = {"json_object": (dict(json_object=True, disable_any_whitespace=True), check_json_object)}


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    built = {}

    def get(async_scheduling=True):
        if async_scheduling not in built:
            built[async_scheduling] = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=512,
                                          async_scheduling=async_scheduling)
        return built[async_scheduling]

    yield get
    for llm in built.values():
        llm.exit()


def assert_released(llm):
    assert llm.is_finished()
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind", list(KINDS) + list(UNBOUNDED))
def test_every_sample_matches_and_stops(engines, kind):
    """Many seeds, n=2 (each sample its own matcher): every output matches; each ends on EOS when
    its grammar is complete (finish "stop"), well before max_tokens (regex strings are unbounded
    at [a-z]{2,6}, so they end too)."""
    spec, check = KINDS[kind] if kind in KINDS else UNBOUNDED[kind]
    llm = engines()
    eos = llm.eos_token_ids
    params = [structured(seed=s, n=2, **spec) for s in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            if kind in UNBOUNDED:
                check(c.text, c.finish_reason)
                continue
            check(c.text)
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            assert c.token_ids[-1] in eos
    assert_released(llm)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_batch_keeps_unconstrained_tokens(engines, async_scheduling):
    """Structured requests (every kind, sampled and greedy, n=2) mixed with unconstrained greedy
    ones in one batch: the unconstrained tokens equal a run without the structured ones, and every
    structured output matches."""
    llm = engines(async_scheduling)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    prompts, params, checks = [], [], []
    for i, (kind, (spec, check)) in enumerate(KINDS.items()):
        prompts += [PROMPTS[i % len(PROMPTS)], PROMPTS[(i + 1) % len(PROMPTS)]]
        params += [structured(seed=i, n=2, **spec), structured(temperature=0, **spec)]
        checks += [check, check]
    # the other logits edits and filters around the grammar stage, and logprobs of the raw logits
    edited = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, repetition_penalty=1.3,
                            logprobs=2, seed=5, max_tokens=120, logit_bias={5: 3.0},
                            structured_outputs=StructuredOutputsParams(**KINDS["json"][0]))
    prompts, params, checks = prompts + [PROMPTS[0]], params + [edited], checks + [KINDS["json"][1]]
    mixed_prompts = PROMPTS + prompts
    outs = llm.generate(mixed_prompts, [plain] * len(PROMPTS) + params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:len(PROMPTS)]] == alone
    for out, check in zip(outs[len(PROMPTS):], checks):
        for c in out.outputs:
            check(c.text)
            assert c.finish_reason == "stop", c.text
    assert_released(llm)


def test_greedy_structured_is_deterministic_across_scheduling(engines):
    """A greedy structured request gives the same tokens with overlapped steps and without."""
    spec, check = KINDS["json"]
    runs = []
    for mode in (True, False):
        outs = engines(mode).generate(PROMPTS, structured(temperature=0, **spec), use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        for o in outs:
            check(o.outputs[0].text)
    assert runs[0] == runs[1]


def test_length_limit_and_ignore_eos(engines):
    """max_tokens before the grammar completes: finish "length", the text a prefix of a match.
    ignore_eos: the grammar completes, then only EOS follows, up to max_tokens."""
    llm = engines()
    short = llm.generate(PROMPTS[:2], structured(max_tokens=1, choice=["Paris", "London"]), use_tqdm=False)
    for o in short:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 1
        assert any(choice.startswith(c.text) for choice in ("Paris", "London")), c.text
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=16, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    c = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 16
    assert c.text in ("yes", "no")  # the EOS tokens after it are special: not in the text
    assert c.token_ids[-1] in llm.eos_token_ids
    assert_released(llm)


def test_structured_request_waits_for_its_tokens_not_the_batch(engines):
    """With overlapped steps, a structured request needs its previous token on the host before its
    next mask, which the engine fills after launching the step's forward: the unconstrained
    request beside it is not slowed."""
    llm = engines(True)
    llm.step_log = []
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    long_regex = structured(temperature=0, max_tokens=10, regex="[a-z]{10}")
    llm.generate(PROMPTS[:2], [plain, long_regex], use_tqdm=False)
    steps = len(llm.step_log)
    llm.step_log = None
    assert steps <= 20 + 2, steps  # the plain request was not slowed to every other step


def test_structured_requests_run_every_step_with_overlap(engines):
    """With overlapped steps, structured requests (alone, or all of a batch) run every step: their
    masks are filled after the forward's launch, not a step later. Seeded sampled outputs and
    greedy ones equal those without overlap."""
    runs = []
    for overlap in (True, False):
        llm = engines(overlap)
        params = [SamplingParams(temperature=t, seed=seed, max_tokens=40, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(**spec))
                  for t, seed, spec in [(0.0, None, KINDS["regex"][0]), (1.0, 3, KINDS["choice"][0]),
                                        (0.7, 4, UNBOUNDED["json_object"][0])]]
        rids = [llm.add_request(p, sp, keep_output=True) for p, sp in zip(PROMPTS, params)]
        for rid in rids:  # (grammars compile in intake threads: the step count starts once all are in)
            if llm.requests[rid].seqs[0].intake is not None:
                llm.requests[rid].seqs[0].intake.result()
        steps = 0
        while not llm.is_finished():
            llm.step()
            steps += 1
        assert steps <= 40 + 2, steps  # (every other step: about 80)
        outs = [llm.pop_output(rid).outputs[0] for rid in rids]
        assert all(len(c.token_ids) == 40 for c in outs)
        KINDS["regex"][1](outs[0].text)
        KINDS["choice"][1](outs[1].text)
        check_json_object(outs[2].text, "length")
        runs.append([c.token_ids for c in outs])
        assert_released(llm)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_raising_logits_processor_beside_a_structured_request(tiny_qwen3, overlap):
    """A logits processor that raises in a step whose grammar masks are filled after the forward's
    launch fails its own request only (finish_reason "error"): the structured request beside it,
    in generate() and by hand, gets the tokens it gets alone, and the engine is left clean."""
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, async_scheduling=overlap)
    try:
        json_sp = structured(temperature=0, max_tokens=30, **KINDS["json"][0])
        expected = llm.generate(PROMPTS[0], json_sp, use_tqdm=False)[0].outputs[0].token_ids
        calls = []
        bad = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             logits_processors=[failing_processor(calls, on_call=4)])
        outs = llm.generate(PROMPTS[:2], [json_sp, bad], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == expected and outs[1].outputs[0].finish_reason == "error"
        assert_released(llm)
        assert not llm.requests
        calls.clear()
        rid = llm.add_request(PROMPTS[0], json_sp, keep_output=True)
        bad_id = llm.add_request(PROMPTS[1], bad, keep_output=True)
        while not llm.is_finished():
            llm.step()
        assert llm.pop_output(rid).outputs[0].token_ids == expected
        assert llm.pop_output(bad_id).outputs[0].finish_reason == "error"
        assert_released(llm)
    finally:
        llm.exit()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_sampling_after_the_forward_leaves_the_engine_clean(tiny_qwen3, monkeypatch, overlap):
    """A step launched up to its logits whose sampling fails later (before the next step's forward,
    or when collected): generate() raises, every block is free, and the next generate gives the
    same tokens as before; stepping on by hand after the error, the requests get those tokens."""
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, async_scheduling=overlap)
    try:
        params = [structured(temperature=0, max_tokens=16, **KINDS["json"][0]),
                  SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        real, calls = llm.model_runner.sample_launched, []

        def flaky(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("sampling failed")
            return real(*args)

        monkeypatch.setattr(llm.model_runner, "sample_launched", flaky)
        with pytest.raises(RuntimeError, match="sampling failed"):
            llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert_released(llm)
        assert not llm.requests
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)] == expected
        # by hand: after the error, stepping on gives both requests their tokens
        calls.clear()
        rids = [llm.add_request(p, sp, keep_output=True) for p, sp in zip(PROMPTS, params)]
        with pytest.raises(RuntimeError, match="sampling failed"):
            while not llm.is_finished():
                llm.step()
        while not llm.is_finished():
            llm.step()
        assert [llm.pop_output(rid).outputs[0].token_ids for rid in rids] == expected
        assert_released(llm)
    finally:
        llm.exit()


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "object", "properties": {"a": {"type": 5}}}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(), "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(structural_tag={"type": "nonsense"}), "structured_outputs.structural_tag"),
])
def test_bad_specs_are_value_errors_naming_the_field(spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**spec)


def test_without_xgrammar_the_error_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(ImportError, match=re.escape("pip install nanoinfer[structured]")):
        StructuredOutputsParams(regex="[a-z]+")
    assert SamplingParams(temperature=0).structured_outputs is None  # everything else works without it


def test_bad_types_and_intake(engines):
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": PERSON})
    with pytest.raises(TypeError, match="structured_outputs.regex"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(TypeError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice="abc")
    llm = engines()
    with pytest.raises(ValueError, match=r"prompts\[1\]"):  # a bad request in a batch queues none
        llm.generate(["a", ""], [structured(regex="[a-z]+"), structured(regex="[a-z]+")], use_tqdm=False)
    assert llm.is_finished() and not llm.requests
    sp = structured(json=PERSON)
    assert sp.needs_host_tokens and sp.has_token_constraints
    assert StructuredOutputsParams(json=json.dumps(PERSON, indent=2)).cache_key() == \
        StructuredOutputsParams(json=PERSON).cache_key()
    reordered = dict(PERSON, properties=dict(reversed(PERSON["properties"].items())))
    assert StructuredOutputsParams(json=reordered).cache_key() != StructuredOutputsParams(json=PERSON).cache_key()


def test_finished_and_aborted_sequences_free_their_matchers(engines):
    """A matcher lives on its sequence: once the engine drops a finished or an aborted request,
    its matchers are gone (nothing keyed by seq_id to leak)."""
    llm = engines()
    refs = []
    done = llm.add_request(PROMPTS[0], structured(n=2, seed=1, choice=CITIES), keep_output=True)
    cut = llm.add_request(PROMPTS[1], structured(n=2, seed=2, max_tokens=200, regex="[a-z]{150}"),
                          keep_output=True)
    for rid in (done, cut):
        if llm.requests[rid].seqs[0].intake is not None:  # (the grammar compiles in an intake thread)
            llm.requests[rid].seqs[0].intake.result()
        refs += [weakref.ref(seq.grammar) for seq in llm.requests[rid].seqs]
    assert len({id(r()) for r in refs}) == 4  # one matcher per sample
    for _ in range(6):
        llm.step()
    llm.abort_request(cut)
    while not llm.is_finished():
        llm.step()
    assert llm.pop_output(done).outputs[0].finish_reason == "stop"
    assert all(c.finish_reason == "abort" for c in llm.pop_output(cut).outputs)
    assert all(r() is None for r in refs)  # freed with the sequences, by reference counting
    assert_released(llm)


def test_plan_carries_bitmasks_of_sampling_rows_only(engines):
    """The plan of a step: a structured row that samples gets a bitmask row, a mid-prefill chunk
    does not; it pickles (tp > 1);
    xgrammar's threaded batch fill (many rows) equals the row-by-row fill."""
    import pickle
    from types import SimpleNamespace

    from nanoinfer.step.sequence import Sequence
    from nanoinfer.sampling.plan import build_sampling_plan
    from nanoinfer.sampling_options.grammar import NAME, GrammarOption
    from nanoinfer.structured.grammar_state import BATCH_FILL_MIN_ROWS, GrammarState, bitmask_width, fill_bitmasks

    llm = engines()
    compiler = llm.feature(StructuredFeature)._grammar_intake().compiler
    sp = structured(temperature=0, choice=CITIES)
    seqs = [Sequence([1, 2, 3], sp, 16) for _ in range(3)] + [Sequence([1, 2, 3], SamplingParams(temperature=0), 16)]
    for seq in seqs[:3]:
        seq.grammar = GrammarState(compiler.compile(sp.structured_outputs), compiler.stop_token_ids)
    vocab = llm.vocab_size
    samples = [True, False, True, True]
    for seq, sampled in zip(seqs, samples):
        seq.num_inflight = int(sampled)  # (as the scheduler counts a scheduled sample)
    options = [GrammarOption()]
    plan = build_sampling_plan(seqs, vocab, llm.eos_token_ids, samples=samples, options=options)
    grammar = plan.payload(NAME)
    # not plain (rank 0 alone has the bitmask), fused: on CUDA the fused kernel samples after it
    assert grammar.rows == [0, 2] and not plan.plain and plan.fused and plan.seed is not None
    assert len(grammar.bitmask) == 2 * bitmask_width(vocab) * 4
    assert pickle.loads(pickle.dumps(plan)).payload(NAME).bitmask == grammar.bitmask
    assert build_sampling_plan(seqs[3:], vocab, llm.eos_token_ids, options=options).payload(NAME) is None
    # many rows at different places in several grammars: the threaded fill equals one by one
    prefixes = {"json": ['', '{"name": "ab', '{"name": "a", "age": 1'], "regex": ['', 'ab', 'ab@cd.c'],
                "choice": ['', 'Pa', 'São'], "grammar": ['', 'yes', 'no 1']}
    fake = []
    for kind, texts in prefixes.items():
        compiled = compiler.compile(StructuredOutputsParams(**KINDS[kind][0]))
        for text in texts:
            tokens = llm.tokenizer.encode(text, add_special_tokens=False)
            fake.append(SimpleNamespace(grammar=GrammarState(compiled, compiler.stop_token_ids),
                                        token_ids=[1] + tokens, num_prompt_tokens=1))
    assert len(fake) >= BATCH_FILL_MIN_ROWS
    batched = fill_bitmasks(fake, vocab)
    assert not any(f.grammar.broken for f in fake) and fake[2].grammar.consumed > 0
    one_by_one = b"".join(fill_bitmasks([f], vocab) for f in fake)
    assert batched == one_by_one and len(set(one_by_one[i:i + 52] for i in range(0, len(one_by_one), 52))) > 6


def test_compiled_grammars_are_cached(engines):
    llm = engines()
    llm.generate(PROMPTS[0], structured(json=PERSON, max_tokens=4), use_tqdm=False)
    compiler = llm.feature(StructuredFeature)._grammar_intake().compiler
    before = len(compiler.cache)
    key = StructuredOutputsParams(json=json.dumps(PERSON, indent=2)).cache_key()
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(PERSON))) is \
        compiler.compile(StructuredOutputsParams(json=PERSON))
    assert compiler.cache.get(key) is not None and len(compiler.cache) <= before + 1


def test_tensor_parallel_structured(tiny_qwen3):
    """tp=2 on CPU: greedy structured outputs and the unconstrained greedy rows beside them equal
    tp=1's (only rank 0 samples: the bitmask travels in the plan)."""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    params = [plain, structured(temperature=0, **KINDS["json"][0]), plain,
              structured(temperature=0, n=2, **KINDS["regex"][0])]
    runs = []
    for tp in (1, 2):
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=256, tensor_parallel_size=tp)
        try:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            llm.exit()
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        check_person(outs[1].outputs[0].text)
        assert all(re.fullmatch(EMAIL, c.text) for c in outs[3].outputs)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("vocab, width", [(70, 70), (64, 96), (384, 400)])
def test_bitmask_matches_xgrammar(vocab, width):
    """Our torch unpack (any device) against xgrammar's own apply on CPU; logits wider than the
    bitmask's vocabulary (padded) lose the extra columns."""
    from nanoinfer.sampling_options.token_mask import apply_token_bitmask
    from nanoinfer.structured.grammar_state import bitmask_width

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(vocab)), dtype=torch.int32, generator=g)
    logits = torch.randn(5, width, generator=g)
    rows = torch.tensor([4, 0, 2])
    ours = logits.clone()
    apply_token_bitmask(ours, rows, words)
    ref = logits.clone()
    for j, r in enumerate(rows.tolist()):
        xgr.apply_token_bitmask_inplace(ref[r:r + 1], words[j:j + 1], vocab_size=min(vocab, width))
    ref[rows[:, None], torch.arange(min(vocab, width), width)[None, :]] = float("-inf")
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # the other rows untouched


@pytest.mark.parametrize("vocab, width, dtype", [(70, 70, torch.float32), (64, 96, torch.float32),
                                                 (9000, 8999, torch.bfloat16), (384, 400, torch.float16)])
def test_bitmask_kernel_matches_the_torch_path(vocab, width, dtype):
    """The Triton kernel (the interpreter on CPU) equals the torch path: rows in any order, a row
    stride wider than the row, logits narrower or wider than the bitmask's vocabulary."""
    from nanoinfer.kernels.token_bitmask import apply_token_bitmask_triton
    from nanoinfer.sampling_options.token_mask import apply_token_bitmask
    from nanoinfer.structured.grammar_state import bitmask_width

    g = torch.Generator().manual_seed(1)
    words = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(vocab)), dtype=torch.int32, generator=g)
    words[1] = 0  # nothing allowed
    wide = torch.randn(5, width + 7, generator=g).to(dtype)
    logits, ours_wide = wide[:, :width], wide.clone()
    ours = ours_wide[:, :width]  # (a row stride of width + 7)
    rows = torch.tensor([4, 0, 2])
    ref = logits.float().clone()
    apply_token_bitmask_triton(ours, rows, words)
    apply_token_bitmask(ref, rows, words)
    assert torch.equal(ours.float(), ref) and torch.equal(ours_wide[:, width:], wide[:, width:])
    assert torch.isneginf(ours[0]).all() and torch.equal(ours[[1, 3]], logits[[1, 3]])
    apply_token_bitmask_triton(ours, rows[:0], words[:0])  # no rows: nothing to do


@pytest.mark.cuda
def test_structured_outputs_on_cuda(make_checkpoint, make_llm):
    """On the GPU (the bitmask copied and unpacked on the device, every sampling path): every kind
    matches in a batch mixed with unconstrained rows, sampled and greedy."""
    from nanoinfer.sampling_options.token_mask import apply_token_bitmask

    words = torch.randint(-2**31, 2**31 - 1, (3, 13), dtype=torch.int32)
    logits = torch.randn(4, 400)
    cpu, gpu = logits.clone(), logits.cuda()
    apply_token_bitmask(cpu, torch.tensor([0, 1, 3]), words)
    apply_token_bitmask(gpu, torch.tensor([0, 1, 3], device="cuda"), words.cuda())
    assert torch.equal(cpu, gpu.cpu())
    llm = make_llm(make_checkpoint(dtype="bfloat16"), kvcache_block_size=16, max_model_len=512)
    try:
        plain = [SamplingParams(temperature=0.7, max_tokens=16), SamplingParams(temperature=0, max_tokens=16)]
        params, checks = list(plain), [None, None]
        for i, (spec, check) in enumerate(KINDS.values()):
            filtered = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=120,
                                      structured_outputs=StructuredOutputsParams(**spec))
            params += [structured(seed=i, n=2, **spec), structured(temperature=0, **spec), filtered]
            checks += [check] * 3
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
        for out, check in zip(outs, checks):
            for c in out.outputs:
                if check is not None:
                    check(c.text)
                    assert c.finish_reason == "stop"
        # temperature alone (and greedy): the fused sampling kernel, after the bitmask
        fused = [structured(temperature=t, **spec) for spec, _ in KINDS.values() for t in (0.0, 0.7, 1.0)]
        fused_checks = [check for _, check in KINDS.values() for _ in range(3)]
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(fused))], fused, use_tqdm=False)
        for out, check in zip(outs, fused_checks):
            check(out.outputs[0].text)
            assert out.outputs[0].finish_reason == "stop"
    finally:
        llm.exit()

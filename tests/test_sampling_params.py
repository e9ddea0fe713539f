"""SamplingParams: vLLM's fields, defaults and validation rules."""
import math

import pytest

from nanoinfer.sampling_params import SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.stop == [] and sp.stop_token_ids == [] and not sp.ignore_eos
    assert (sp.max_tokens, sp.min_tokens, sp.logprobs) == (64, 0, None)
    assert sp.skip_special_tokens and not sp.include_stop_str_in_output


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)  # vLLM resets the filters
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize("field, value, allowed", [
    ("n", 0, "at least 1"),
    ("presence_penalty", 2.5, r"\[-2, 2\]"),
    ("presence_penalty", -2.01, r"\[-2, 2\]"),
    ("frequency_penalty", -3.0, r"\[-2, 2\]"),
    ("frequency_penalty", math.nan, r"\[-2, 2\]"),
    ("repetition_penalty", 0.0, r"\(0, inf\)"),
    ("repetition_penalty", -1.0, r"\(0, inf\)"),
    ("repetition_penalty", math.inf, r"\(0, inf\)"),
    ("temperature", -0.1, "non-negative"),
    ("temperature", math.inf, "non-negative"),
    ("temperature", math.nan, "non-negative"),
    ("top_p", 0.0, r"\(0, 1\]"),
    ("top_p", 1.5, r"\(0, 1\]"),
    ("top_p", -0.2, r"\(0, 1\]"),
    ("top_k", -2, "0 or -1"),
    ("min_p", -0.1, r"\[0, 1\]"),
    ("min_p", 1.1, r"\[0, 1\]"),
    ("max_tokens", 0, "at least 1"),
    ("min_tokens", -1, "at least 0"),
    ("logprobs", -2, "-1 \\(the whole vocabulary\\) or at least 0"),
])
def test_value_errors_name_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=allowed) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value)


def test_cross_field_and_list_rules():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens=4.*5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)
    with pytest.raises(ValueError, match="stop.*empty string"):
        SamplingParams(stop="")
    with pytest.raises(ValueError, match="stop.*empty string"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="stop_token_ids.*-3"):
        SamplingParams(stop_token_ids=[1, -3])


@pytest.mark.parametrize("field, value", [
    ("n", 2.0), ("n", True), ("top_k", 1.5), ("min_tokens", "3"),
    ("temperature", "0.5"), ("temperature", None), ("top_p", True), ("min_p", [0.1]),
    ("presence_penalty", "1"), ("frequency_penalty", None), ("repetition_penalty", "x"),
    ("seed", 1.0), ("seed", "7"), ("max_tokens", 2.5), ("logprobs", 2.0), ("logprobs", True),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
    ("stop", 5), ("stop", ["a", 3]), ("stop_token_ids", [1, "2"]), ("stop_token_ids", 3),
    ("stop_token_ids", [1.0]),
])
def test_type_errors(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})


def test_unknown_field():
    with pytest.raises(TypeError):
        SamplingParams(best_of_everything=3)


def test_numpy_numbers_are_accepted_and_converted():
    """numbers.Integral (not bool) for every int field and numbers.Real for every float field, as
    token-id prompts accept them; stored as plain int / float."""
    import numpy as np
    sp = SamplingParams(n=np.int64(2), top_k=np.int32(5), min_tokens=np.uint8(1), seed=np.int64(7),
                        max_tokens=np.int16(9), logprobs=np.int64(3), stop_token_ids=[np.int64(4), 5],
                        temperature=np.float32(0.5), top_p=np.float64(0.9), min_p=np.float16(0.25),
                        presence_penalty=np.int64(1), frequency_penalty=np.float32(-0.5),
                        repetition_penalty=np.float64(1.5))
    for name in ("n", "top_k", "min_tokens", "seed", "max_tokens", "logprobs"):
        assert type(getattr(sp, name)) is int, name
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert type(getattr(sp, name)) is float, name
    assert [type(t) for t in sp.stop_token_ids] == [int, int] and sp.stop_token_ids == [4, 5]
    assert (sp.n, sp.seed, sp.temperature, sp.min_p) == (2, 7, 0.5, 0.25)
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=np.bool_(True))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=10**400)  # beyond float range: infinite, not an OverflowError


def test_vllm_parity_fields_defaults_and_normalisation():
    sp = SamplingParams()
    assert (sp.prompt_logprobs, sp.logit_bias, sp.allowed_token_ids, sp.bad_words, sp.logits_processors) == \
        (None, None, None, None, None)
    assert sp.detokenize and sp.spaces_between_special_tokens and sp.truncate_prompt_tokens is None
    import numpy as np
    sp = SamplingParams(logit_bias={np.int64(3): 250, 4: np.float32(-0.5), 5: -1e9}, allowed_token_ids=(1, np.int32(2)),
                        bad_words=("a b",), prompt_logprobs=np.int64(2), truncate_prompt_tokens=-1)
    assert sp.logit_bias == {3: 100.0, 4: -0.5, 5: -100.0}  # clamped to [-100, 100] as vLLM does
    assert [type(t) for t in sp.logit_bias] == [int, int, int] and sp.allowed_token_ids == [1, 2]
    assert sp.bad_words == ["a b"] and type(sp.prompt_logprobs) is int and sp.truncate_prompt_tokens == -1


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_logprobs=-2), "prompt_logprobs must be None, -1"),
    (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens must be None, -1 \(max_model_len\) or at least 1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids.*non-negative"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys.*non-negative"),
    (dict(logit_bias={1: float("nan")}), "logit_bias values"),
    (dict(bad_words=["ok", " "]), "bad_words.*blank"),
    (dict(stop="x", detokenize=False), "detokenize"),
])
def test_vllm_parity_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("field, value", [
    ("prompt_logprobs", 1.0), ("truncate_prompt_tokens", "5"), ("logit_bias", [1, 2]),
    ("logit_bias", {"1": 1.0}), ("logit_bias", {1: "x"}), ("allowed_token_ids", 3), ("allowed_token_ids", [1.0]),
    ("bad_words", "word"), ("bad_words", [1]), ("logits_processors", [3]), ("logits_processors", len),
    ("detokenize", 1), ("spaces_between_special_tokens", None),
])
def test_vllm_parity_type_errors(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})


class WordTokenizer:
    """encode: one id per character, a leading space its own id 0 (to exercise vLLM's rule)."""
    def encode(self, text, add_special_tokens=False):
        return ([0] if text.startswith(" ") else []) + [ord(c) for c in text.lstrip()]


def test_bad_words_encoding_follows_vllm():
    sp = SamplingParams(bad_words=["ab", "  c"])
    enc = sp.with_bad_words_token_ids(WordTokenizer())
    # " ab" -> [0, 97, 98]: a different first token but a different length, so not added
    assert enc.bad_words_token_ids == [[97, 98], [99]] and sp.bad_words_token_ids is None  # a copy
    assert enc.needs_host_tokens and not SamplingParams(bad_words=["c"]).with_bad_words_token_ids(
        WordTokenizer()).needs_host_tokens
    assert SamplingParams(logits_processors=[lambda ids, row: row]).needs_host_tokens
    assert not SamplingParams().needs_host_tokens


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 2**64 - 1, 2**70])
def test_seed_outside_int64_is_refused_not_reduced(seed):
    """vLLM's range for seed is int64; beyond it a seed was reduced mod 2**64 (-1 and 2**64 - 1 gave
    the same text)."""
    with pytest.raises(ValueError, match=r"seed must be None or an int64, in \[-2\*\*63, 2\*\*63 - 1\]") as err:
        SamplingParams(seed=seed)
    assert repr(seed) in str(err.value)


def test_int64_seeds_are_kept_and_never_share_noise_keys():
    from nanoinfer.sampling.noise import seed_keys
    seeds = [-2**63, -2**32, -1, 0, 1, 2**32, 2**63 - 1]
    assert [SamplingParams(seed=s).seed for s in seeds] == seeds
    for step in (0, 5):
        keys = {tuple(seed_keys(s, step)) for s in seeds}
        assert len(keys) == len(seeds), "distinct int64 seeds must give distinct noise keys"

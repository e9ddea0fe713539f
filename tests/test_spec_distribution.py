"""Verification keeps the target's distribution: the first two sampled tokens (the second one
verified against an n-gram or a sampled draft-model proposal) follow HF's probabilities, by a chi-square test over many
requests, with and without speculation, on a vocabulary cut to a few tokens (allowed_token_ids).
A sampler that accepted proposals too often (or resampled the rejected token) fails it."""
import pytest
import torch

from hf_reference import hf_model
from nanoinfer import LLM, SamplingParams

ALLOWED = [40, 41, 42, 43, 44, 45]
PROMPT = [41, 43, 40, 45, 42, 44, 41]  # every allowed token, each followed by another: always a proposal
TEMPERATURE = 1.0
NUM_REQUESTS = 1500


def exact_joint(path) -> dict[tuple[int, int], float]:
    """P(t1, t2) over the allowed tokens, from HF's float32 logits."""
    model = hf_model(path)

    def probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        return torch.softmax(logits[ALLOWED] / TEMPERATURE, dim=0).tolist()

    p1 = probs(PROMPT)
    return {(a, b): p1[i] * q for i, a in enumerate(ALLOWED) for b, q in zip(ALLOWED, probs(PROMPT + [a]))}


def chi_square_p_value(counts: dict, expected_p: dict, n: int) -> float:
    """Goodness of fit; cells expected below 5 are pooled into one."""
    stat, small_obs, small_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected_p.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            small_obs, small_exp = small_obs + o, small_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_first_sampled_tokens_follow_the_target_distribution(tiny_qwen3, make_checkpoint, proposer):
    """n-gram proposals are made for sure; a draft model's are sampled (with noise of its own)."""
    expected = exact_joint(tiny_qwen3)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True, allowed_token_ids=ALLOWED)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    if proposer == "draft":
        spec = {"model": make_checkpoint(seed=1, num_layers=1), "num_speculative_tokens": 2}
    for options in ({}, {"speculative_config": spec}):
        torch.manual_seed(1234)  # (unseeded requests draw from torch's generator)
        llm = LLM(tiny_qwen3, kvcache_block_size=16, max_model_len=64, max_num_seqs=256, **options)
        try:
            outs = llm.generate([PROMPT] * NUM_REQUESTS, params, use_tqdm=False)
            if options:  # every second token was verified against a proposal
                assert llm.spec_stats.num_drafts == NUM_REQUESTS
                assert 0 < llm.spec_stats.num_accepted_tokens < NUM_REQUESTS
        finally:
            llm.exit()
        counts = {}
        for o in outs:
            cell = tuple(o.outputs[0].token_ids[:2])
            counts[cell] = counts.get(cell, 0) + 1
        p = chi_square_p_value(counts, expected, NUM_REQUESTS)
        assert p > 1e-3, f"{'speculative' if options else 'plain'} sampling is off the target distribution: p={p:.2e}"

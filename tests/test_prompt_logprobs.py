"""prompt_logprobs/rows.py: the rank's log-softmax of the prompt positions' logits, sliced for long
prompts, and the segments' results on the host; the step's positions read off a batch."""
import torch

from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.prompt_logprobs.rows import (PROMPT_LOGPROBS_SLICE, PromptLogprobsRequest, PromptSegment,
                                            prompt_logit_rows, prompt_logprobs, prompt_logprobs_request, to_host)
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.step.sequence import Sequence


def test_sliced_log_softmax_matches_the_whole_rows_and_splits_into_segments():
    torch.manual_seed(0)
    n, vocab = PROMPT_LOGPROBS_SLICE + 30, 50  # (a slice boundary inside the first segment)
    logits = torch.randn(n, vocab, dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (n,)).tolist()
    request = PromptLogprobsRequest([PromptSegment(0, 0, n - 7, 3), PromptSegment(2, 4, 7, 1)], targets, 3)
    out = to_host(request, prompt_logprobs(logits, request))
    lp = torch.log_softmax(logits.float(), dim=-1)
    assert [(s.row, s.start, len(s.entries)) for s in out] == [(0, 0, n - 7), (2, 4, 7)]
    entries = out[0].entries + out[1].entries
    for j in (0, PROMPT_LOGPROBS_SLICE - 1, PROMPT_LOGPROBS_SLICE, n - 7, n - 1):
        e, k = entries[j], 3 if j < n - 7 else 1
        assert e.logprob == lp[j, targets[j]].item()
        assert e.rank == int((lp[j] > lp[j, targets[j]]).sum()) + 1
        assert e.top_ids == lp[j].topk(k).indices.tolist() and len(e.top_logprobs) == k


def test_a_step_computes_the_positions_of_its_first_samples_prompt_chunks():
    """Position p predicts prompt token p + 1: a chunk ending at the prompt's last token computes one
    position fewer; a request's second sample and a request that did not ask compute none."""
    asked, plain = SamplingParams(prompt_logprobs=2), SamplingParams()
    first = Sequence([1, 2, 3, 4, 5, 6], asked, 16)
    second = Sequence([1, 2, 3, 4, 5, 6], asked, 16, request_id=first.seq_id, index=1)
    other = Sequence([7, 8, 9], plain, 16)
    decoding = Sequence([4, 4], asked, 16)
    batch = ScheduledBatch([decoding, first, second, other], [1, 2, 0, 0], [1, 4, 6, 3], [True] * 4, 1)
    request = prompt_logprobs_request(batch)
    assert [(s.row, s.start, s.count, s.top_k) for s in request.segments] == [(1, 2, 3, 2)]
    assert request.targets == [4, 5, 6]
    assert prompt_logit_rows(batch, request) == [1, 2, 3]  # (after the decode row's token)
    assert prompt_logprobs_request(ScheduledBatch([other], [0], [3], [True], 0)) is None

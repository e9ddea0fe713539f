"""Prompt logprobs' hooks (step/feature.py). Engine: a step whose rows cover prompt positions of a
request that asked for them asks for their logits (StepInput.extra_logit_rows, the work in
SampleInput.extra_logits); the results (StepResult.outputs) are recorded per request, a re-prefill
after preemption writing the same values, and added to its output. Rank: the sampling rank
computes them from those rows' full logits (rows.py)."""
import weakref

from nanoinfer.engine.output_processor import logprob_dicts
from nanoinfer.step.feature import EngineFeature, Intake, RankFeature
from nanoinfer.prompt_logprobs.rows import (PromptLogprobsRequest, prompt_logit_rows, prompt_logprobs,
                                            prompt_logprobs_request, to_host)

OUTPUT = "prompt_logprobs"  # the key of a step's results in StepResult.outputs: a PromptLogprobs per segment


class PromptLogprobsFeature(EngineFeature):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # a request's first sequence -> entry p (p >= 1): the TokenLogprobs of prompt token p
        self.recorded = weakref.WeakKeyDictionary()

    def prepare(self, intake: Intake) -> None:
        seq = intake.seqs[0]  # (a request's first sample computes them)
        if seq.sampling_params.prompt_logprobs is not None:
            self.recorded[seq] = [None] * seq.num_prompt_tokens

    def encode(self, batch, step, sample, sampling_seqs):
        request = prompt_logprobs_request(batch)
        if request is not None:
            sample.extra_logits = request
            step.extra_logit_rows = prompt_logit_rows(batch, request)

    def process(self, batch, result) -> None:
        """Before the step's tokens are appended: a sequence finished by then was aborted."""
        if not result.outputs or OUTPUT not in result.outputs:
            return
        for seg in result.outputs[OUTPUT]:  # entries[i] is from position start + i, for prompt token start + i + 1
            seq = batch.seqs[seg.row]
            entries = self.recorded.get(seq)
            if entries is not None and not seq.is_finished:
                entries[seg.start + 1:seg.start + 1 + len(seg.entries)] = seg.entries

    def add_output(self, request, output) -> None:
        """vLLM's shape: None for the first prompt token (and any position not computed, e.g. of an
        aborted request), then a dict of the prompt token and the top-k."""
        entries = self.recorded.get(request.seqs[0])
        if entries is None:
            return
        detok = request.seqs[0].sampling_params.detokenize
        output.prompt_logprobs = [None if e is None else logprob_dicts(self.tokenizer, [(tok, e)], detok)[0]
                                  for tok, e in zip(output.prompt_token_ids, entries)]


class PromptLogprobsRankFeature(RankFeature):
    """The sampling rank's log-softmax of the prompt positions' logits; the copies to the host start
    at once, the results are built once the step's tokens are there."""

    def __init__(self, runner):
        pass

    def read_logits(self, step, sample, logits):
        request = sample.extra_logits
        if not isinstance(request, PromptLogprobsRequest):
            return None
        tensors = [t.to("cpu", non_blocking=True) for t in prompt_logprobs(logits, request)]
        return {OUTPUT: lambda: to_host(request, tensors)}

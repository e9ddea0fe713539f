"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's RequestOutput.prompt_logprobs): the
logprob, rank and top-k of every prompt token but the first, from the model's raw logits.

- rows.py: a step's prompt positions that compute them (the engine's side of the step message),
  the rank's log-softmax over their logits, and the results on the host.
- feature.py: the engine hooks (each step asks for the positions' logits, the results are recorded
  per request and added to its output) and the rank hook (reading the logits, on the sampling rank).

The seam in the core: StepInput.extra_logit_rows (the LM head computes those rows' logits after
the sampling rows') and RankFeature.read_logits (the sampling rank hands them over, full rows);
the results return in StepResult.outputs. The request skips the prefix cache (every position is
computed), as in vLLM."""

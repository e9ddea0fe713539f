"""The engine's one handle on speculative decoding: how many tokens a sequence may propose
(`lookahead`, asked by the scheduler), the proposals of a scheduled step (`propose`), and the
accepted runs of a finished one (`verify`), with the acceptance counters.

A sequence gets proposals only when every one of its tokens is on the host (none in flight), so
with overlapped steps a speculative sequence runs every other step while the rest of the batch
overlaps (as requests that need host tokens do); requests with logits processors, multi-token bad
words or structured outputs get none.
"""
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.engine.step_message import StepResult
from nanoinfer.spec.config import SpeculativeConfig
from nanoinfer.spec.ngram import NgramProposer
from nanoinfer.spec.policy import SpeculationPolicy
from nanoinfer.spec.rows import accepted_runs, attach_drafts
from nanoinfer.spec.stats import SpecStats


class Speculator:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, proposer=None):
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
        self.policy = SpeculationPolicy(spec.disable_by_batch_size, spec.disable_below_acceptance)
        self.stats = SpecStats(self.k)
        self.device_proposals = False  # the target runs in this process: a step may read proposals on the device

    def speculates(self, seq, num_running: int) -> bool:
        """Whether the sequence gets proposals when its tokens are on the host (if not, it decodes
        plainly, overlapped)."""
        return not seq.sampling_params.needs_host_tokens and seq.pooling is None and \
            self.policy.allows(seq, num_running)

    def lookahead(self, seq, budget: int, num_running: int) -> int:
        """How many proposals the sequence's next decode row may score (0: a plain decode row)."""
        sp = seq.sampling_params
        if seq.num_inflight or not self.speculates(seq, num_running):
            return 0
        k = min(self.k, budget - 1, self.max_model_len - seq.num_tokens - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - seq.num_completion_tokens - 1)
        return max(k, 0)

    def propose(self, batch: ScheduledBatch):
        """Fill in the batch's speculative rows (the scheduler reserved their blocks). Proposals the
        proposer leaves on the device (`device_proposals`: one rank in this process) are read there
        by the step; until it is processed, the rows hold placeholders of their length."""
        if not batch.drafts:
            return
        rows = sorted(batch.drafts)
        seqs, max_lens = [batch.seqs[r] for r in rows], [batch.query_lens[r] - 1 for r in rows]
        on_device = self.proposer.launch(seqs, max_lens) if self.device_proposals else None
        if on_device is not None:
            # (the step's sampling plan is built from the placeholders: a proposer launches only for
            # requests whose plan does not read the proposals, greedy ones without token constraints)
            batch.proposals = on_device
            attach_drafts(batch, {r: [0] * m for r, m in zip(rows, max_lens)})  # (no row shortened)
            return
        proposals = self.proposer.propose(seqs, max_lens)
        for r, p in zip(rows, proposals):
            if not p:  # (see spec/policy.py)
                self.policy.record(batch.seqs[r], 1, 0)
        attach_drafts(batch, dict(zip(rows, proposals)))

    def verify(self, batch: ScheduledBatch, result: StepResult):
        """(one token per row, row -> accepted run, per-row logprobs) of a finished step."""
        if batch.proposals is not None:  # (the rows' order is the proposer's: attach_drafts kept it)
            proposed = batch.proposals.finish()
            for r, p in zip(sorted(batch.drafts), proposed):
                batch.drafts[r] = p
            batch.proposals = None
        tokens, runs, logprobs = accepted_runs(batch, result.tokens, result.logprobs)
        for row, run in runs.items():
            proposed, accepted = len(batch.drafts[row]), len(run) - 1
            self.stats.record(proposed, accepted)
            self.policy.record(batch.seqs[row], proposed, accepted)
        return tokens, runs, logprobs

    def allocate(self, num_blocks: int):
        """The proposer's KV cache, if it has one (a draft model's)."""
        if hasattr(self.proposer, "allocate"):
            self.proposer.allocate(num_blocks)

    def exit(self):
        self.proposer.exit()


def build_speculator(config, tokenizer, target_runner, num_blocks: int, eos_token_ids=frozenset()) -> Speculator:
    """The engine's Speculator for config.speculative_config: n-gram, or a draft model whose KV
    cache holds as many blocks as the target's, read through the target's block tables
    (`speculator.num_blocks`: the pool both fit, which the engine allocates)."""
    spec = config.speculative_config
    proposer = None
    if spec.method == "draft_model":
        from nanoinfer.spec.draft_model import DraftModelProposer
        proposer = DraftModelProposer(config, spec, tokenizer, target_runner, num_blocks, eos_token_ids)
        num_blocks = proposer.num_blocks
    speculator = Speculator(spec, config.max_model_len, proposer)
    speculator.num_blocks = num_blocks
    speculator.device_proposals = config.tensor_parallel_size == 1
    return speculator

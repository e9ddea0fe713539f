"""The engine's one handle on speculative decoding: how many tokens a sequence may propose
(`lookahead`, asked by the scheduler), the proposals of a scheduled step (`propose`), and the
accepted runs of a finished one (`verify`), with the acceptance counters.

A sequence gets proposals when every one of its tokens is on the host (none in flight), or, with
overlapped steps and a draft model on one rank, when its row still in flight had proposals the
draft left on the device: its next row is chained onto that one (speculative/chaining.py), so it runs
every step. Otherwise (n-gram, sampled requests, tensor parallelism) a speculative sequence runs
every other step while the rest of the batch overlaps, as requests that need host tokens do;
requests with logits processors, multi-token bad words or structured outputs get none.
"""
from nanoinfer.engine.forward_inputs import SHORT_ROWS_MAX_QUERY
from nanoinfer.engine.scheduler import ScheduledBatch
from nanoinfer.step.step_message import StepResult
from nanoinfer.speculative.chaining import ChainedRows, chained_inputs
from nanoinfer.speculative.config import SpeculativeConfig
from nanoinfer.speculative.draft_model import DraftModelProposer
from nanoinfer.speculative.ngram import NgramProposer
from nanoinfer.speculative.policy import SpeculationPolicy
from nanoinfer.speculative.rows import accepted_runs, attach_drafts
from nanoinfer.speculative.stats import SpecStats


class Speculator:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, proposer=None):
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer or NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
        self.policy = SpeculationPolicy(spec.disable_by_batch_size, spec.disable_below_acceptance)
        self.stats = SpecStats(self.k)
        self.device_proposals = False  # the target runs in this process: a step may read proposals on the device
        self.chaining = False  # a row may be chained onto its sequence's row in flight (build_speculator)
        self.in_flight = None  # the DeviceProposals of the step launched last (chaining)
        self.num_chained = 0  # rows chained so far

    def speculates(self, seq, num_running: int) -> bool:
        """Whether the sequence gets proposals when its tokens are on the host (if not, it decodes
        plainly, overlapped)."""
        return not seq.sampling_params.needs_host_tokens and seq.pooling is None and \
            self.policy.allows(seq, num_running)

    def chains(self, seq) -> bool:
        """Whether the sequence's next row may be chained onto its speculative row in flight: that
        row's proposals were left on the device by the step launched last."""
        return self.in_flight is not None and seq.seq_id in self.in_flight.index

    def lookahead(self, seq, budget: int, num_running: int, room: int | None = None) -> int:
        """How many proposals the sequence's next decode row may score (0: a plain decode row), at
        most `room` (the scheduler's, for a step that may chain rows: None, no such limit, and no
        row chains). Its length limits count its tokens in flight as if all were accepted."""
        sp = seq.sampling_params
        if (seq.num_inflight and (room is None or not self.chains(seq))) or not self.speculates(seq, num_running):
            return 0
        n = seq.num_tokens + seq.num_inflight
        k = min(self.k, budget - 1, self.max_model_len - n - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - (n - seq.num_prompt_tokens) - 1)
        if room is not None:
            k = min(k, room)
        return max(k, 0)

    def propose(self, batch: ScheduledBatch, prev_handle=None):
        """Fill in the batch's speculative rows (the scheduler reserved their blocks). Proposals the
        proposer leaves on the device (`device_proposals`: one rank in this process; the requests
        it `launches`) are read there by the step; until it is processed, the rows hold
        placeholders of their length. `prev_handle`: the runner's handle of the step in flight,
        whose sampled tokens chained rows read."""
        if not batch.drafts:
            return
        rows = sorted(batch.drafts)
        seqs, max_lens = [batch.seqs[r] for r in rows], [batch.query_lens[r] - 1 for r in rows]
        launched = [i for i, seq in enumerate(seqs) if self.device_proposals and self.proposer.launches(seq)]
        drafts = {}
        if launched:
            # (the step's sampling plan is built from the placeholders: see Proposer.launches)
            batch.proposals = self._launch(batch, [rows[i] for i in launched], prev_handle)
            drafts = {rows[i]: [0] * max_lens[i] for i in launched}  # (no such row is shortened)
        on_host = [i for i in range(len(rows)) if rows[i] not in drafts]
        if on_host:
            proposals = self.proposer.propose([seqs[i] for i in on_host], [max_lens[i] for i in on_host])
            for i, p in zip(on_host, proposals):
                if not p:  # (see speculative/policy.py)
                    self.policy.record(seqs[i], 1, 0)
                drafts[rows[i]] = p
        attach_drafts(batch, drafts)
        if batch.proposals is not None:  # each row's first sampling row: after the decode rows' and the rows' before
            props, first = batch.proposals, batch.num_decode
            props.first_samples = [0] * len(props.seq_ids)
            for r in sorted(batch.drafts):
                i = props.index.get(batch.seqs[r].seq_id)
                if i is not None:
                    props.first_samples[i] = first
                first += 1 + len(batch.drafts[r])

    def _launch(self, batch: ScheduledBatch, rows: list[int], prev_handle):
        """The proposer's launch for those rows; a row whose first query token is not on the host
        (it starts past the sequence's tokens) is chained onto the step in flight."""
        seqs = [batch.seqs[r] for r in rows]
        chained = [i for i, (r, seq) in enumerate(zip(rows, seqs)) if batch.starts[r] >= seq.num_tokens]
        links = None
        if chained:
            links = ChainedRows(chained, *chained_inputs(self.in_flight, prev_handle.tokens,
                                                         [seqs[i].seq_id for i in chained]))
            self.num_chained += len(chained)
        return self.proposer.launch(seqs, [batch.query_lens[r] - 1 for r in rows], [batch.starts[r] + 1 for r in rows],
                                    links)

    def launched(self, batch: ScheduledBatch):
        """The engine launched the batch: its device proposals are the ones in flight."""
        if self.chaining:
            self.in_flight = batch.proposals

    def verify(self, batch: ScheduledBatch, result: StepResult):
        """(one token per row, row -> accepted run, per-row logprobs) of a finished step."""
        if batch.proposals is not None:
            props = batch.proposals
            proposed = props.finish()
            for r in batch.drafts:
                i = props.index.get(batch.seqs[r].seq_id)
                if i is not None:
                    batch.drafts[r] = proposed[i]
            batch.proposals = None
        tokens, runs, logprobs = accepted_runs(batch, result.tokens, result.logprobs)
        for row, run in runs.items():
            if batch.seqs[row].is_finished:  # (a chained row of a sequence that ended meanwhile: wasted)
                continue
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
        proposer = DraftModelProposer(config, spec, tokenizer, target_runner, num_blocks, eos_token_ids)
        num_blocks = proposer.num_blocks
    speculator = Speculator(spec, config.max_model_len, proposer)
    speculator.num_blocks = num_blocks
    speculator.device_proposals = config.tensor_parallel_size == 1
    # chained rows run in decode steps of short rows, with overlapped steps; a draft model proposes
    # them (n-gram lookup reads the tokens on the host); M-RoPE positions are the host's
    speculator.chaining = speculator.device_proposals and config.async_scheduling and \
        spec.method == "draft_model" and speculator.k + 1 <= SHORT_ROWS_MAX_QUERY and \
        getattr(config.hf_config, "vision_config", None) is None
    return speculator

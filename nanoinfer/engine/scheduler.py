"""Continuous batching with a token budget, vLLM-V1 style: every running sequence's decode token
first, then prefill chunks fill the rest of `max_num_batched_tokens`; when a decode token finds no
free block, the newest running sequences are preempted (their KV freed; they recompute later). The
`order` (engine/wait_queue.py) decides which waiting sequence is served first, an optional
`admission` rule which may join the running ones, the row planner how long a decoding row is.

The scheduler owns the finish decision: `update` appends a step's tokens and stops sequences on
EOS, stop token ids and length; `finish_rows` adds the stop strings the output processor found;
`finish` is the one place that records `finish_reason`.

Steps overlap: progress (`num_computed_tokens`, `num_inflight`) advances when a step is scheduled,
tokens are appended when it is processed. A sequence whose in-flight token reaches a length limit
is not scheduled again; one whose next row needs its tokens on the host
(SamplingParams.needs_host_tokens) sits out the steps while its token is in flight. One whose
intake work still runs waits in `preparing` (vLLM's WAITING_FOR_FSM) until `admit_prepared`.
"""
from concurrent.futures import FIRST_COMPLETED, wait
from operator import attrgetter

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.step.row_planner import RowPlanner
from nanoinfer.engine.scheduled_batch import ScheduledBatch, StepUpdate, ending_of
from nanoinfer.step.sequence import Sequence, SequenceStatus
from nanoinfer.engine.wait_queue import FifoOrder
from nanoinfer.outputs import NON_FINITE_REASON

__all__ = ["Scheduler", "ScheduledBatch", "StepUpdate", "ending_of"]


class Scheduler:
    def __init__(self, config: Config, num_blocks: int, eos_token_ids: frozenset[int],
                 prefix_caching: bool = True, rows: RowPlanner | None = None, admission=None,
                 masks_later: bool = False, order: FifoOrder | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, prefix_caching)
        self.order = order or FifoOrder()
        self.waiting = self.order.queue()
        self.running: list[Sequence] = []  # holding blocks, in the order's order; some may be mid-prefill
        # n > 1: a prompt's other samples wait here (keyed by the first sample's seq_id; each group an
        # ordered set) until its prompt K/V are computed, then join waiting and hit the prefix cache
        self.held: dict[int, dict[Sequence, None]] = {}
        self.held_under: dict[int, int] = {}  # a held sequence's seq_id -> its group's key
        self.preparing: dict[Sequence, None] = {}  # (ordered set) waiting for their intake work
        self.num_preemptions = 0
        self.rows = rows or RowPlanner()
        self.admission = admission  # None: every waiting sequence may join the running ones
        # with masks_later (the engine fills token masks after the launch) a request whose masks alone
        # need the host's tokens does not wait for its token in flight
        self.waits_for_host = attrgetter("needs_host_tokens_to_launch" if masks_later else "needs_host_tokens")

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.held and not self.preparing

    def add(self, seq: Sequence, after: Sequence | None = None):
        """Queue a sequence; with `after` (another sample of the same prompt), hold it until `after`'s
        prompt is computed, to share its prompt blocks."""
        if after is None or after.is_finished or after.num_completion_tokens or after.num_inflight:
            if seq.intake is not None:
                self.preparing[seq] = None
            else:
                self.waiting.append(seq)
        else:
            self.held.setdefault(after.seq_id, {})[seq] = None
            self.held_under[seq.seq_id] = after.seq_id

    def _release_held(self, seq: Sequence):
        """Queue the samples held for `seq` ahead of other waiting prompts."""
        siblings = self.held.pop(seq.seq_id, None)
        if siblings:
            for sibling in siblings:
                del self.held_under[sibling.seq_id]
            self.waiting.extendleft_in_order(list(siblings))

    def admit_prepared(self) -> list[Sequence]:
        """Queue the preparing sequences whose intake work is done; finish those whose work failed (and
        the samples held for them) with "error", its message as stop_reason, and return them."""
        failed = []
        for seq in [s for s in self.preparing if s.intake.done()]:
            del self.preparing[seq]
            error = seq.intake.exception() if not seq.intake.cancelled() else RuntimeError("intake cancelled")
            group = [seq, *self.held.get(seq.seq_id, ())]
            if error is None:
                for member in group:
                    member.intake = None  # (done: its held samples need not wait for it either)
                self.waiting.append(seq)
                continue
            message = str(error) or type(error).__name__
            for member in group:
                self.finish(member, "error", message)
            failed += group
        return failed

    def wait_for_intake(self, timeout: float) -> None:
        """Block until a preparing sequence's intake work is done, at most `timeout` seconds."""
        if self.preparing:
            wait({seq.intake for seq in self.preparing}, timeout, return_when=FIRST_COMPLETED)

    # ---- planning a step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [], [])
        preempted = False
        longer = []  # (seq, extra tokens): the planner's rows of several tokens, after the decode rows
        self.order.start_step(self)
        # 1. one decode token for every running sequence that generates (oldest first)
        i, decode = 0, []
        self.rows.start_step(self)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if seq.num_computed_tokens != len(seq.token_ids) + seq.num_inflight - 1 or \
                    (seq.num_inflight and self._waits_for_inflight(seq)):
                continue  # mid-prefill (step 2), or its token in flight keeps it out of this step
            k = self.rows.extra_tokens(self, seq, budget, len(self.running) - i)
            if k is None:
                continue  # the planner keeps it out of this step
            while not self.block_manager.append_slot(seq):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if k:
                    longer.append((seq, k))
                else:
                    decode.append(seq)
                budget -= 1 + k
        self._add_decode_rows(batch, decode)
        for seq, k in longer:  # (preempted meanwhile: dropped; its blocks are gone)
            if seq.status == SequenceStatus.RUNNING:
                self.rows.add_row(batch, seq, k)
        # 2. prefill chunks: sequences mid-prefill, then new ones (none after a preemption: memory is short)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_computed_tokens < len(seq.token_ids) - 1:  # (from num_tokens - 1 on, a sequence decodes: step 1)
                budget -= self._add_row(batch, seq, budget)
        admission = self.admission
        if admission is not None:
            admission.start(self.running)
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.intake is not None:  # (a sample released by a sibling that finished before its intake did)
                self.preparing[self.waiting.popleft()] = None
                continue
            if admission is not None and not admission.admits(seq):
                break  # the rule keeps it waiting its turn
            if seq.num_inflight or not self.block_manager.allocate(seq, self.uses_cache(seq)):
                break  # a preempted sequence's last token is still in flight, or the pool is full
            if admission is not None:
                admission.admitted(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.order.place(self.running, seq)
            budget -= self._add_row(batch, seq, budget)
        return batch if batch.seqs else None

    @staticmethod
    def uses_cache(seq: Sequence) -> bool:
        """Whether a waiting sequence takes prefix-cache hits: not one whose every prompt position must be
        computed (`computes_whole_prompt`), unless it is a request's other sample."""
        return bool(seq.index) or not seq.computes_whole_prompt

    def unschedule(self, batch: ScheduledBatch):
        """Undo a step that could not be launched: its rows are scheduled again next time (blocks stay
        with their sequences). Progress is given back by each row's length, not reset to its start: a
        row of several tokens chained onto one in flight assumed its tokens all accepted, and
        processing that one may already have given back the rejected ones."""
        for row, (seq, samples) in enumerate(zip(batch.seqs, batch.samples)):
            if seq.status == SequenceStatus.RUNNING:  # (a preempted one starts over; a finished one is done)
                seq.num_computed_tokens -= batch.query_lens[row]
            seq.num_inflight -= batch.query_lens[row] if row in batch.drafts else samples

    def _waits_for_inflight(self, seq: Sequence) -> bool:
        """Whether a running sequence with tokens in flight sits out this step: they may end it by
        length, the host must see them, or the row planner keeps it out."""
        sp = seq.sampling_params
        n = len(seq.token_ids) + seq.num_inflight  # (a row of several in flight: as if all were accepted)
        return n >= self.max_model_len or (sp.max_tokens is not None and n - seq.num_prompt_tokens >= sp.max_tokens) \
            or (sp.has_token_constraints and self.waits_for_host(sp)) \
            or self.rows.waits(seq, len(self.running))

    @staticmethod
    def _add_decode_rows(batch: ScheduledBatch, seqs: list[Sequence]):
        """The step's decode rows, at once: each computes its newest token and samples the next."""
        n = len(seqs)
        batch.seqs, batch.query_lens, batch.samples = seqs, [1] * n, [True] * n
        batch.starts = [seq.num_computed_tokens for seq in seqs]
        batch.num_decode = n
        for seq in seqs:
            seq.num_computed_tokens += 1
            seq.num_inflight += 1

    @staticmethod
    def _add_row(batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """A prefill chunk of the sequence's next tokens, at most `budget`; returns its length."""
        start = seq.num_computed_tokens
        num_tokens = min(seq.num_tokens - start, budget)
        seq.num_computed_tokens += num_tokens
        samples = seq.num_computed_tokens == seq.num_tokens + seq.num_inflight
        if samples:
            seq.num_inflight += 1
        batch.seqs.append(seq)
        batch.starts.append(start)
        batch.query_lens.append(num_tokens)
        batch.samples.append(samples)
        return num_tokens

    def preempt(self, seq: Sequence):
        """Recompute preemption: drop its KV, put it first in line; it re-prefills prompt + output
        once its in-flight tokens (still valid) are appended."""
        self.num_preemptions += 1
        seq.num_preemptions += 1
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.block_manager.free(seq)

    # ---- processing a finished step -------------------------------------------------------------
    def update(self, batch: ScheduledBatch, token_ids: list[int],
               runs: dict[int, list[int]] | None = None) -> StepUpdate:
        """Record what a finished step computed: register its full blocks in the prefix cache, append the
        sampled tokens, release the samples held for a first token's prompt, and decide which rows end
        on EOS, stop token ids and length limits. `runs`: the row planner's rows of several tokens."""
        appended, ending, counts = [], {}, {}
        bm, eos, max_model_len = self.block_manager, self.eos_token_ids, self.max_model_len
        # a block is registered once full: most rows of most steps fill none and skip commit()
        caching, bs = bm.prefix_caching, bm.block_size
        drafts = batch.drafts
        for row, (seq, token_id, samples) in enumerate(zip(batch.seqs, token_ids, batch.samples)):
            seq.num_inflight -= batch.query_lens[row] if row in drafts else samples
            status = seq.status
            if status is SequenceStatus.FINISHED:
                continue  # aborted, or stopped while this step was in flight: a wasted row
            if token_id < 0 and samples:  # NON_FINITE: the row's logits were NaN / inf
                ending[row] = ("error", NON_FINITE_REASON)  # (its K/V are not cached either)
                continue
            if runs and row in runs:
                counts[row] = self.rows.append_run(self, seq, batch.query_lens[row], runs[row], row, ending)
                appended.append(row)
                continue
            if status is SequenceStatus.RUNNING and caching:
                # (at most what its current blocks hold: a prefill chunk's sequence may have been
                # preempted and re-admitted since, with new blocks the chunk never wrote)
                end = min(batch.starts[row] + batch.query_lens[row], seq.num_computed_tokens)
                if end // bs > len(seq.block_hashes):
                    bm.commit(seq, end)
            if not samples:
                continue
            tokens = seq.token_ids
            tokens.append(token_id)
            appended.append(row)
            num_completion = len(tokens) - seq.num_prompt_tokens
            if self.held and num_completion == 1:
                self._release_held(seq)
            reason, stop_reason = ending_of(seq.sampling_params, token_id, num_completion, len(tokens), eos,
                                            max_model_len)
            if reason is not None:
                ending[row] = (reason, stop_reason)
        return StepUpdate(appended, ending, counts)

    def finish_rows(self, batch: ScheduledBatch, update: StepUpdate, stop_strings: dict[int, str]) -> list[Sequence]:
        """Finish the step's ending rows in row order (their blocks are freed in that order), a stop
        string winning over a length limit (vLLM's rule); returns the sequences finished."""
        ending = update.ending
        for row, stop in stop_strings.items():
            ending[row] = ("stop", stop)
        rows = ending if not stop_strings else sorted(ending)
        for row in rows:
            self.finish(batch.seqs[row], *ending[row])
        return [batch.seqs[row] for row in rows]

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None):
        """End a sequence wherever it is and free its blocks; the one place that sets `finish_reason`
        ("stop", "length", "abort", or "error")."""
        if seq.is_finished:
            return
        if self.held:
            self._release_held(seq)  # its held samples go on without it
        # found by looking, not by status: an exception (Ctrl-C) may have left it between queues.
        # Each look is O(1) but `running`'s (at most max_num_seqs): finishing n samples is O(n).
        if seq in self.preparing:
            del self.preparing[seq]
        elif not self.waiting.discard(seq):
            key = self.held_under.pop(seq.seq_id, None)
            if key is not None:  # held for a sibling's prompt
                group = self.held[key]
                del group[seq]
                if not group:
                    del self.held[key]
            elif seq in self.running:
                self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free(seq)

    def abort(self, seq: Sequence):
        self.finish(seq, "abort")

"""Continuous batching: prefill first (chunked when a prompt outgrows the token budget), then decode,
with recompute preemption of the newest running sequences when decode runs out of blocks."""
from collections import deque

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config, num_blocks: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size)
        # waiting[0] may be a partly prefilled sequence that already holds its blocks
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        # n > 1: a prompt's other samples wait here (keyed by the first sample's seq_id) until its
        # prompt K/V are computed, then join waiting and hit the prefix cache for the full blocks
        self.held: dict[int, list[Sequence]] = {}
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.held

    def add(self, seq: Sequence, after: Sequence | None = None):
        """Queue a sequence; with `after` (another sample of the same prompt), hold it until
        `after`'s prompt is computed so that it shares `after`'s prompt blocks."""
        if after is None or after.is_finished:
            self.waiting.append(seq)
        else:
            self.held.setdefault(after.seq_id, []).append(seq)

    def _release_held(self, seq: Sequence):
        """Queue the samples held for `seq`, ahead of other waiting prompts (after a head that is
        mid-prefill and already holds blocks)."""
        siblings = self.held.pop(seq.seq_id, None)
        if siblings:
            at = 1 if self.waiting and self.waiting[0].block_table else 0
            for sibling in reversed(siblings):
                self.waiting.insert(at, sibling)

    def schedule(self) -> tuple[list[Sequence], bool]:
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        batch, budget = [], self.max_num_batched_tokens
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if not seq.block_table:  # not started yet: admit it if a slot and its blocks are free
                if len(self.running) + len(batch) >= self.max_num_seqs:
                    break
                if not self.block_manager.allocate(seq):
                    break
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            seq.num_scheduled_tokens = num_new
            budget -= num_new
            batch.append(seq)
            if seq.num_computed_tokens + num_new < len(seq):
                break  # chunked: the rest of this prompt goes in the next steps
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch = []
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                seq.num_scheduled_tokens = 1
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch

    def schedule_ahead(self, inflight: list[Sequence]) -> list[Sequence] | None:
        """Overlapped decode: plan the next decode step while `inflight` (the running decode batch)
        is still computing one token each, assuming none of them stops on EOS or a stop string (a
        row that does is wasted work, discarded in postprocess). Sequences that reach their length
        limit with the in-flight token are left out. Returns None when the step cannot be planned
        without the in-flight tokens: prompts are waiting, or a sequence would need preemption."""
        if self.waiting or self.held:
            return None
        batch = []
        for seq in inflight:
            if seq.is_finished:
                continue
            sp, length = seq.sampling_params, len(seq) + 1  # counting the in-flight token
            if (sp.max_tokens is not None and seq.num_completion_tokens + 1 >= sp.max_tokens) \
                    or length >= self.max_model_len:
                continue
            batch.append(seq)
        if sum(1 for s in inflight if not s.is_finished) != len(self.running):
            return None  # running sequences outside the in-flight batch
        bs = self.block_manager.block_size
        needed = sum(1 for s in batch if len(s) + 1 > len(s.block_table) * bs)
        if not batch or needed > self.block_manager.num_free_blocks:
            return None
        for seq in batch:
            self.block_manager.append_slot(seq, ahead=1)
        return batch

    def preempt(self, seq: Sequence):
        """Recompute preemption: drop its KV, put it first in line; it re-prefills prompt + output."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> list[Sequence]:
        """Advance each sequence by what this step computed (its scheduled prefill chunk, or the one
        decode token); returns the sequences that finished."""
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            if seq.is_finished:
                continue  # overlapped decode: it stopped while this step was in flight
            seq.num_computed_tokens += seq.num_scheduled_tokens if is_prefill else 1
            seq.num_scheduled_tokens = 0
            self.block_manager.commit(seq)
            if seq.num_computed_tokens < len(seq):
                continue  # a prefill chunk short of the prompt's end samples nothing
            if self.held:
                self._release_held(seq)
            seq.append_token(token_id)
            sp = seq.sampling_params
            stop_ok = seq.num_completion_tokens >= sp.min_tokens
            if not sp.ignore_eos and token_id in self.eos_token_ids and stop_ok:
                seq.finish_reason = "stop"
            elif sp.stop_token_ids and token_id in sp.stop_token_ids and stop_ok:
                seq.finish_reason = "stop"
            elif (sp.max_tokens is not None and seq.num_completion_tokens >= sp.max_tokens) \
                    or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            else:
                continue
            self._finish(seq)
            finished.append(seq)
        if finished:
            self.running = deque(s for s in self.running if not s.is_finished)
        return finished

    def _finish(self, seq: Sequence):
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def abort(self, seq: Sequence):
        """Drop a request wherever it is; its blocks are freed."""
        if seq.is_finished:
            return
        if self.held:
            self._release_held(seq)  # its held samples go on without it
        if seq.status == SequenceStatus.WAITING:
            if seq in self.waiting:
                self.waiting.remove(seq)
            else:  # held for a sibling's prompt
                for key, group in list(self.held.items()):
                    if seq in group:
                        group.remove(seq)
                        if not group:
                            del self.held[key]
        else:
            self.running.remove(seq)
        seq.finish_reason = "abort"
        self._finish(seq)

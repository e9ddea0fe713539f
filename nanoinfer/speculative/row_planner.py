"""Speculative decoding's row planner (step/row_planner.py): a decoding sequence's row also
scores up to k proposed tokens, placed after the decode rows, filled in before the launch
(Speculator.propose) and verified when the step is processed. With a draft model on one rank and
overlapped steps, a row may be chained onto its sequence's row still in flight (speculative/chaining.py);
such rows run in a decode step of short rows (engine/forward_inputs.py), which caps how many
proposals the step's rows may score in all (`room`)."""
from nanoinfer.engine.forward_inputs import SHORT_ROWS_MAX_TOKENS
from nanoinfer.step.row_planner import RowPlanner
from nanoinfer.engine.scheduler import ScheduledBatch, ending_of
from nanoinfer.step.sequence import SequenceStatus
from nanoinfer.speculative.device_inputs import verify_inputs
from nanoinfer.speculative.draft_rows import sampling_rows
from nanoinfer.speculative.speculator import Speculator


class SpeculativeRows(RowPlanner):
    def __init__(self, speculator: Speculator):
        self.speculator = speculator
        self.num_blocks = getattr(speculator, "num_blocks", None)
        self.stats = speculator.stats
        self.room: int | None = None  # this step's proposals left to score (see _chain_room)

    # ---- asked by the scheduler -----------------------------------------------------------------
    def start_step(self, scheduler) -> None:
        self.room = self._chain_room(scheduler)

    def waits(self, seq, num_running: int) -> bool:
        """A row in flight whose next one cannot be chained onto it (its length is unknown), when
        the sequence speculates."""
        return seq.num_inflight == 1 and self.speculator.speculates(seq, num_running)

    def extra_tokens(self, scheduler, seq, budget: int, num_after: int) -> int | None:
        k = self._lookahead(scheduler, seq, budget, num_after)
        if seq.num_inflight > 1 and not k:
            return None  # its speculative row in flight, and no room to chain the next one: it waits
        if self.room is not None:
            self.room -= k
        return k

    def _chain_room(self, scheduler) -> int | None:
        """With a speculative row in flight that the next one may chain onto (`Speculator.chains`):
        how many proposals this step's rows may score in all, so that it runs as a decode step of
        short rows, the only kind that places rows whose positions the device shifts. None (no
        row chains, and the other rows score up to k): there is no such row, a prompt chunk may
        join the step, or the step has no room for proposals."""
        spec, running = self.speculator, scheduler.running
        if not spec.chaining or not any(seq.num_inflight > 1 and spec.chains(seq) for seq in running) or \
                scheduler.waiting or any(seq.num_computed_tokens < len(seq.token_ids) - 1 for seq in running):
            return None
        room = min(SHORT_ROWS_MAX_TOKENS, scheduler.max_num_seqs) - len(running)  # (the largest decode graph)
        return room if room > 0 else None

    def _lookahead(self, scheduler, seq, budget: int, num_after: int) -> int:
        """How many proposals the sequence's row may score (at most `room`), with the blocks for
        them reserved; none when that would take a block one of the `num_after` sequences after it
        may need."""
        bm = scheduler.block_manager
        k = self.speculator.lookahead(seq, budget, len(scheduler.running), self.room)
        end = seq.num_tokens + seq.num_inflight + k
        if k and end > len(seq.block_table) * bm.block_size and bm.num_free_blocks <= num_after:
            return 0
        return k if k and bm.append_slot(seq, k) else 0

    def add_row(self, batch: ScheduledBatch, seq, extra: int) -> None:
        """A decode row that also scores `extra` proposed tokens (filled in before launch, and maybe
        shortened: speculative/rows.py). Processing appends the accepted run, up to 1 + extra tokens: until
        then they count in flight, as if all were accepted, and so does the row's progress. A row
        chained onto one still in flight starts where that one ends if all are accepted; the device
        shifts it back by what it rejected (speculative/chaining.py), processing the host's view."""
        batch.drafts[len(batch.seqs)] = None
        batch.seqs.append(seq)
        batch.starts.append(seq.num_computed_tokens)
        batch.query_lens.append(1 + extra)
        batch.samples.append(True)
        seq.num_computed_tokens += 1 + extra
        seq.num_inflight += 1 + extra

    def append_run(self, scheduler, seq, query_len: int, run: list[int], row: int, ending: dict) -> int:
        """Append a speculative row's accepted tokens until one ends the sequence; the K/V computed
        for the appended ones (all but the newest) are kept, those of rejected proposals are
        overwritten later. Its progress counted all query_len tokens: it gives back those not
        appended (a row chained after it was scheduled from there). Returns how many were appended."""
        num = 0
        for token_id in run:
            seq.append_token(token_id)
            num += 1
            reason, stop_reason = ending_of(seq.sampling_params, token_id, seq.num_completion_tokens, seq.num_tokens,
                                            scheduler.eos_token_ids, scheduler.max_model_len)
            if reason is not None:
                ending[row] = (reason, stop_reason)
                break
        if seq.status == SequenceStatus.RUNNING:
            seq.num_computed_tokens -= query_len - num
            scheduler.block_manager.commit(seq, seq.num_tokens - 1)
        return num

    # ---- asked by the engine --------------------------------------------------------------------
    def fills(self, batch) -> bool:
        return bool(batch.drafts)

    def fill(self, batch, prev_handle) -> None:
        if batch.drafts:
            self.speculator.propose(batch, prev_handle)

    def device_inputs(self, batch) -> tuple:
        return (verify_inputs(batch),) if batch.proposals is not None else ()

    def sampling_rows(self, batch) -> tuple[list, list[bool], list[int]]:
        return sampling_rows(batch)

    def launched(self, batch) -> None:
        self.speculator.launched(batch)

    def results(self, batch, result):
        if not batch.drafts:
            return result.tokens, None, result.logprobs
        return self.speculator.verify(batch, result)

    def allocate(self, num_blocks: int) -> None:
        self.speculator.allocate(num_blocks)

    def exit(self) -> None:
        self.speculator.exit()

"""How long each sequence's row of a step is, and how to undo it. The plain planner gives every
decoding sequence a row of one token; speculative decoding's (nanoinfer/speculative/row_planner.py)
gives rows extra tokens, filled in before the launch, the accepted run appended when processed."""


class RowPlanner:
    num_blocks: int | None = None  # the KV blocks the planner leaves the pool (None: the runner's)
    stats = None  # the planner's counters (engine metrics), if it keeps any

    # ---- asked by the scheduler -----------------------------------------------------------------
    def start_step(self, scheduler) -> None:
        """A step is being scheduled."""

    def waits(self, seq, num_running: int) -> bool:
        """Whether a decoding sequence with a token in flight sits this step out."""
        return False

    def extra_tokens(self, scheduler, seq, budget: int, num_after: int) -> int | None:
        """How many tokens past its next one the sequence's decode row computes (their blocks
        reserved), or None: it sits this step out. `num_after`: running sequences after it."""
        return 0

    def add_row(self, batch, seq, extra: int) -> None:
        """Place a row with `extra` > 0 tokens (after the decode rows)."""
        raise NotImplementedError

    def append_run(self, scheduler, seq, query_len: int, run: list[int], row: int, ending: dict) -> int:
        """Append the tokens a row of several accepted (see Scheduler.update); returns how many."""
        raise NotImplementedError

    # ---- asked by the engine --------------------------------------------------------------------
    def fills(self, batch) -> bool:
        """Whether `fill` has rows to fill in (they may read the tokens of the step in flight)."""
        return False

    def fill(self, batch, prev_handle) -> None:
        """Fill in the batch's rows before it is encoded."""

    def device_inputs(self, batch) -> tuple:
        """The runner's extra launch arguments for the batch (tokens left on the device)."""
        return ()

    def sampling_rows(self, batch) -> tuple[list, list[bool], list[int]]:
        """For a batch with rows of several tokens (`batch.drafts`): (the sequences, as the sampling
        plan sees each, their `samples` flags, their flat token rows), one per sampling row."""
        raise NotImplementedError

    def launched(self, batch) -> None:
        """The batch was launched."""

    def results(self, batch, result):
        """(one token per row, row -> run of tokens for a row of several, per-row logprobs)."""
        return result.tokens, None, result.logprobs

    def allocate(self, num_blocks: int) -> None:
        """The pool's size is final."""

    def exit(self) -> None:
        """The engine exits."""

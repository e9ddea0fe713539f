"""The one encoding of a step: what every rank needs to run it, built from the scheduled batch.
Rank 0 prepares its inputs from it, and tensor-parallel workers receive exactly this (pickled).

Each row is (start position, token ids to compute, block table). A decode row whose input token
was sampled by a step still in flight (overlapped steps, rank 0 only) carries None: the runner
takes that token from the previous step's device tensor."""
from dataclasses import dataclass

from nanoinfer.engine.scheduler import ScheduledBatch


@dataclass
class StepInput:
    rows: list[tuple[int, list[int] | None, list[int]]]
    num_decode: int                    # leading rows with one query token

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode == len(self.rows)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> "StepInput":
        rows = []
        for seq, start, n in zip(batch.seqs, batch.starts, batch.query_lens):
            tokens = seq.token_ids
            rows.append((start, tokens[start:start + n] if start + n <= len(tokens) else None, seq.block_table))
        return cls(rows, batch.num_decode)

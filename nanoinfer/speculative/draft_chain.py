"""A draft model's greedy proposals after the first: k - 1 one-token forwards, each reading the
previous one's argmax on the device, launched as one unit (a CUDA graph per batch bucket on CUDA).

Launched one by one, each forward paid the engine's whole launch (inputs staged and copied, a graph
replay, sampling, a copy to the host) while the device, waiting on the synchronous draft, idled.
Here only the tokens depend on the device: every forward's positions, cache slots and context
lengths follow from each row's length, so the host sends all of them at once and the chain runs
its forwards, LM heads and argmaxes back to back. A row allowed fewer proposals than the chain
has forwards sits out the rest of the chain: it attends to its first position alone, writes no
K/V (slot -1), and its tokens are dropped. Used for requests whose proposals are the draft's plain
argmax (draft_model.proposes_argmax).
"""
import numpy as np
import torch

from nanoinfer.engine.forward_inputs import cache_slots, padded_block_tables
from nanoinfer.speculative.device_inputs import device_cache_slots
from nanoinfer.engine.graph_runner import graph_batch_sizes
from nanoinfer.utils.context import reset_context, set_context
from nanoinfer.utils.staging import Staging


class GreedyDraftChain:
    def __init__(self, runner, num_forwards: int):
        self.runner, self.num_forwards = runner, num_forwards
        config, dev = runner.config, runner.device
        self.block_size = config.kvcache_block_size
        self.sorts_rows = runner.attention.sorts_decode_rows
        rows, width, f = config.max_num_seqs, runner.kv_cache.max_blocks_per_seq, num_forwards
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)  # the first proposals
        self.positions = torch.zeros(f, rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((f, rows), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(f, rows, dtype=torch.int32, device=dev)
        self.order = torch.arange(rows, dtype=torch.int32, device=dev).repeat(f, 1)
        self.block_tables = torch.full((rows, width), -1, dtype=torch.int32, device=dev)
        self.out = torch.zeros(f, rows, dtype=torch.int64, device=dev)  # the proposals after the first
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.buckets: list[int] = []

    @torch.inference_mode()
    def capture(self):
        """A graph per decode batch bucket (after the runner's own graphs: the same memory pool)."""
        if self.num_forwards < 1:
            return
        self.buckets = graph_batch_sizes(self.runner.config.max_num_seqs)
        own = self.runner.graph_runner.graphs
        pool = next(iter(own.values())).pool() if own else None
        for b in reversed(self.buckets):
            self._forwards(b)  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._forwards(b)
            torch.cuda.synchronize(self.runner.device)
            self.graphs[b] = graph
            pool = graph.pool()

    def _forwards(self, n: int, context_lens_cpu: list[list[int]] | None = None):
        """The chain over the buffers' first n rows."""
        model = self.runner.model
        tokens = self.tokens[:n]
        try:
            for j in range(self.num_forwards):
                set_context(is_prefill=False, slot_mapping=self.slots[j, :n], context_lens=self.context_lens[j, :n],
                            block_tables=self.block_tables[:n],
                            decode_order=self.order[j, :n] if self.sorts_rows else None,
                            context_lens_cpu=context_lens_cpu[j] if context_lens_cpu is not None else None)
                logits = model.compute_logits(model(tokens, self.positions[j, :n]))
                tokens = torch.argmax(logits, dim=-1)
                self.out[j, :n] = tokens
        finally:
            reset_context()

    @torch.inference_mode()
    def launch(self, first: torch.Tensor, lengths: list[int], max_lens: list[int], tables: list[list[int]],
               offsets: torch.Tensor | None = None):
        """Enqueue the chain: `first` [n] the first proposals on the device (row i's is at position
        lengths[i], moved by offsets[i] on the device if given: a chained row, speculative/chaining.py);
        row i proposes max_lens[i] tokens in all. Returns the host copy of the proposals after the
        first, [num_forwards, n] int64, and the event that marks it complete (None on CPU, where
        it is complete)."""
        n, f = len(lengths), self.num_forwards
        bucket = next((b for b in self.buckets if b >= n), None)
        width = bucket or n  # (a graph's padded rows: context 0, slot -1, ordered last)
        table = padded_block_tables(tables)
        j = np.arange(1, f + 1)[:, None]
        active = j < np.asarray(max_lens)[None, :]  # forward j computes proposal j + 1 of the row
        positions = np.where(active, np.asarray(lengths)[None, :] + j - 1, 0)
        rows = np.broadcast_to(np.arange(n), positions.shape)
        slots = np.full((f, width), -1, np.int64)
        slots[:, :n] = np.where(active, cache_slots(table, rows, positions, self.block_size), -1)
        context_lens = np.zeros((f, width), np.int64)
        context_lens[:, :n] = positions + 1  # (a row sitting out reads position 0 and writes nothing)
        order = np.argsort(-context_lens, axis=1, kind="stable")  # longest context first, ties in row order
        staged = Staging()
        parts = [staged.add(positions), staged.add(slots), staged.add(context_lens, np.int32),
                 staged.add(order, np.int32), staged.add(table, np.int32)]
        sent = staged.send(self.runner.device)
        positions_d, slots_d, context_d, order_d, table_d = (sent[i] for i in parts)
        self.tokens[:n] = first
        self.positions[:, :n] = positions_d
        self.slots[:, :width] = slots_d
        self.context_lens[:, :width] = context_d
        self.order[:, :width] = order_d
        self.block_tables[:n, :table.shape[1]] = table_d
        if offsets is not None:
            self._shift(n, offsets)
        if bucket is not None and bucket in self.graphs:
            self.graphs[bucket].replay()
        else:
            # (the torch backend's host context lengths: shifted ones are read back, on the CPU alone)
            lens = context_lens[:, :n].tolist() if offsets is None else \
                self.context_lens[:, :n].tolist() if self.runner.device.type == "cpu" else None
            self._forwards(n, lens)
        out = self.out[:, :n]
        if self.runner.device.type != "cuda":
            return out.clone(), None
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _shift(self, n: int, offsets: torch.Tensor):
        """Move the active forwards of the first n rows by offsets [n] positions, with their slots
        and context lengths (the order, longest context first, stays the scheduled one's: a hint)."""
        active = self.slots[:, :n] >= 0
        positions = self.positions[:, :n] + offsets[None, :] * active
        slots = device_cache_slots(self.block_tables[:n], positions.T, self.block_size).T
        self.positions[:, :n] = positions
        self.context_lens[:, :n] = positions + 1
        self.slots[:, :n] = torch.where(active, slots, -1)

    def release(self):
        self.graphs.clear()
        self.buckets = []

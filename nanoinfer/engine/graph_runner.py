"""CUDA graphs for one rank's forward: capture, static buffers, replay.

Decode-only steps replay the graph of the smallest batch bucket that holds them; with an attention
backend that can (`mixed_step_graphs`) and a dense model, steps with prompt chunks replay the graph
of the smallest token bucket. Padded rows and tokens have slot -1 (they write no K/V) and context
length 0. Larger steps run eagerly: their device time dwarfs the launches. The LM head runs outside
the graphs (the rows that need logits vary by step), except in a one-rank decode step sampled at
temperature alone (`sample_decode`): a second graph per batch bucket runs the head and the fused
sampling kernel, which saves the host their launches on the steps that are most of a run."""
import logging

import torch

from nanoinfer.kernels.graph_inputs import fill_decode_graph_inputs
from nanoinfer.kernels.sampling import sample_gumbel_argmax
from nanoinfer.utils.context import get_context, reset_context, set_context

logger = logging.getLogger("nanoinfer")

MIXED_GRAPH_MAX_TOKENS = 2048  # larger steps with prompt chunks run eagerly
MIXED_GRAPH_STRIDE = 256
MIXED_GRAPH_SMALLEST = 4


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token buckets of the graphs for steps with prompt chunks (or rows of several tokens): powers of
    two from MIXED_GRAPH_SMALLEST below MIXED_GRAPH_STRIDE, so that a small step does not pay a large
    bucket's GEMMs, then every MIXED_GRAPH_STRIDE tokens up to MIXED_GRAPH_MAX_TOKENS (or the budget)."""
    top = min(max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS)
    small = {1 << i for i in range(MIXED_GRAPH_SMALLEST.bit_length() - 1, MIXED_GRAPH_STRIDE.bit_length() - 1)}
    return sorted({t for t in small if t < top} | set(range(MIXED_GRAPH_STRIDE, top, MIXED_GRAPH_STRIDE)) | {top})


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then every 16, and max_num_seqs itself, so that every batch
    size up to max_num_seqs replays the smallest graph that holds it."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16))
                  | {max_num_seqs})


class StepForward:
    """A prepared step's forward, run when its sampling route asks (sampling/sampler.py). Its logits
    (this rank's vocabulary shard) are computed once: a step awaiting its grammar bitmask reuses them."""
    __slots__ = ("graphs", "input_ids", "positions", "decode_only", "_logits")

    def __init__(self, graphs: "GraphRunner", input_ids: torch.Tensor, positions: torch.Tensor):
        self.graphs, self.input_ids, self.positions = graphs, input_ids, positions
        self.decode_only = not get_context().is_prefill  # (a step of few short rows runs as decode too)
        self._logits: torch.Tensor | None = None

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.graphs.forward(self.input_ids, self.positions, self.decode_only)
        return self._logits

    def sample_in_graph(self, temperatures: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.graphs.sample_decode(self.input_ids, self.positions, temperatures, seed)

    def hidden(self) -> torch.Tensor:
        """The final hidden states, eager, without the LM head (a dispatch that reads them instead)."""
        return self.graphs.model(self.input_ids, self.positions)


class GraphRunner:
    """The forward of `model`, eager or through a captured graph. capture() needs the KV cache."""

    def __init__(self, model, max_num_seqs: int, max_num_batched_tokens: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, mixed_steps: bool,
                 sorts_decode_rows: bool, graph_inputs=(), sample_graphs: bool = False):
        self.model = model
        self.max_num_seqs, self.max_blocks_per_seq = max_num_seqs, max_blocks_per_seq
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.batch_sizes: list[int] = []
        self.mixed_sizes = mixed_graph_sizes(max_num_batched_tokens) if mixed_steps else []
        self.sorts_decode_rows = sorts_decode_rows
        # (context field, padding value): per-token inputs the features' layers read, static buffers too
        self.graph_inputs = tuple(graph_inputs)
        self.sample_graphs = sample_graphs  # capture the LM head + fused sampling of decode steps too
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sampling_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_replays = 0
        self.buffers: dict[str, torch.Tensor] | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, decode_only: bool) -> torch.Tensor:
        """The step's logits (this rank's vocabulary shard), under the context prepare_inputs set."""
        n = input_ids.shape[0]
        if decode_only and self._fits_decode_graph(n, positions):
            self._replay_decode(input_ids, positions)
            return self.model.compute_logits(self.buffers["outputs"][:n])
        if not decode_only and self.mixed_graphs and n <= self.mixed_sizes[-1] and self._graphable(positions):
            return self._replay_mixed(input_ids, positions)
        return self.model.compute_logits(self.model(input_ids, positions))

    @torch.inference_mode()
    def sample_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, temperatures: torch.Tensor,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step sampled inside the graphs: its tokens [n] (NON_FINITE where a row's logits
        are not finite) and the same clamped to >= 0 (the next step's in-flight inputs), copied out
        of the static buffers the next replay overwrites; None when no sampling graph holds it."""
        n, ctx = input_ids.shape[0], get_context()
        # (the sampling graph's LM head takes every row: no step that names its logit rows)
        if not self.sampling_graphs or ctx.is_prefill or ctx.logits_indices is not None \
                or not self._fits_decode_graph(n, positions):
            return None
        bucket = self._replay_decode(input_ids, positions, temperatures, seed)
        self.sampling_graphs[bucket].replay()
        out = self.buffers["sampled"][:, :n].clone()
        return out[0], out[1]

    @staticmethod
    def _graphable(positions: torch.Tensor) -> bool:
        # (a step with image embeddings or [3, N] M-RoPE positions runs eagerly)
        return positions.dim() == 1 and get_context().mm_embeds is None

    def _fits_decode_graph(self, n: int, positions: torch.Tensor) -> bool:
        return bool(self.graphs) and n <= self.batch_sizes[-1] and self._graphable(positions)

    def _replay_decode(self, input_ids, positions, temperatures=None, seed=0) -> int:
        n = input_ids.shape[0]
        bucket = next(b for b in self.batch_sizes if b >= n)
        ctx, g = get_context(), self.buffers
        # (padded rows: slot -1, context 0, last in the order)
        fill_decode_graph_inputs(g, bucket, input_ids, positions, ctx.slot_mapping, ctx.context_lens,
                                 ctx.block_tables, ctx.decode_order, temperatures, seed)
        if self.graph_inputs:
            self._fill_graph_inputs(g, n, ctx)
        self.graphs[bucket].replay()
        return bucket

    def _replay_mixed(self, input_ids, positions):
        """The graph's attention has max_num_seqs rows and the bucket's query length: rows past the
        step's have no query tokens, and padded tokens have slot -1, so they compute nothing that
        is kept."""
        n = input_ids.shape[0]
        bucket = next(b for b in self.mixed_sizes if b >= n)
        ctx, g = get_context(), self.buffers
        rows = ctx.context_lens.shape[0]
        self._fill_tokens(g, input_ids, positions, ctx)
        g["cu_seqlens_q"].fill_(n)
        g["cu_seqlens_q"][:rows + 1] = ctx.cu_seqlens_q
        g["context_lens"].zero_()
        g["context_lens"][:rows] = ctx.context_lens
        g["block_tables"][:rows, :ctx.block_tables.shape[1]] = ctx.block_tables
        self.mixed_graphs[bucket].replay()
        self.mixed_replays += 1
        return self.model.compute_logits(g["outputs"][:n])

    def _fill_tokens(self, g, input_ids, positions, ctx):
        n = input_ids.shape[0]
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"].fill_(-1)
        g["slot_mapping"][:n] = ctx.slot_mapping
        if self.graph_inputs:
            self._fill_graph_inputs(g, n, ctx)

    def _fill_graph_inputs(self, g, n, ctx):
        for name, padding in self.graph_inputs:  # (padded tokens, and every token of a step without it)
            g[name].fill_(padding)
            value = getattr(ctx, name)
            if value is not None:
                g[name][:n] = value

    def _allocate_buffers(self, tokens: int) -> dict[str, torch.Tensor]:
        max_bs, dev = self.max_num_seqs, self.device
        g = dict(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
            positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            block_tables=torch.full((max_bs, self.max_blocks_per_seq), -1, dtype=torch.int32, device=dev),
            outputs=torch.zeros(tokens, self.hidden_size, dtype=self.dtype, device=dev),
            # a decode step sampled in the graphs: its rows' temperatures and seed in, tokens out
            temperatures=torch.zeros(max_bs, dtype=torch.float32, device=dev),
            seed=torch.zeros(1, dtype=torch.int64, device=dev),
            sampled=torch.zeros(2, max_bs, dtype=torch.int64, device=dev),  # the tokens, then them >= 0
        )
        g["decode_order"] = torch.arange(max_bs, dtype=torch.int32, device=dev)
        for name, padding in self.graph_inputs:
            g[name] = torch.full((tokens,), padding, dtype=torch.int64, device=dev)
        return g

    def _capture_one(self, tokens: int, pool, context: dict):
        """Warm up, then capture the model over the first `tokens` rows of the buffers, under
        `context` (the buffers' views)."""
        g = self.buffers
        graph = torch.cuda.CUDAGraph()
        set_context(**context)
        g["outputs"][:tokens] = self.model(g["input_ids"][:tokens], g["positions"][:tokens])  # warm-up
        set_context(**context)  # (afresh: what the warm-up made in it outside the graph, the capture makes)
        with torch.cuda.graph(graph, pool):
            g["outputs"][:tokens] = self.model(g["input_ids"][:tokens], g["positions"][:tokens])
        torch.cuda.synchronize(self.device)
        reset_context()
        return graph

    def _capture_sampling(self, bs: int, pool):
        """The LM head over the first `bs` rows of the forward's outputs and the fused sampling
        kernel at the buffers' temperatures and seed, for a decode step (warmed up, then captured)."""
        g = self.buffers

        def head_and_sample():
            logits = self.model.compute_logits(g["outputs"][:bs])
            tokens = sample_gumbel_argmax(logits, g["temperatures"][:bs], g["seed"], out=g["sampled"][0, :bs])
            torch.clamp_min(tokens, 0, out=g["sampled"][1, :bs])

        set_context(is_prefill=False)  # (every row's logits)
        head_and_sample()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            head_and_sample()
        torch.cuda.synchronize(self.device)
        reset_context()
        return graph

    @torch.inference_mode()
    def capture(self):
        """Decode graphs for batch buckets covering 1..max_num_seqs, block tables as wide as
        max_model_len needs; then the mixed-step graphs (zero query lengths: the captures attend
        to nothing)."""
        self.batch_sizes = graph_batch_sizes(self.max_num_seqs)
        g = self.buffers = self._allocate_buffers(max([self.max_num_seqs, *self.mixed_sizes]))
        order = g["decode_order"] if self.sorts_decode_rows else None
        # (the inputs' kernel compiles now, not on the first step served: its buffers onto themselves)
        fill_decode_graph_inputs(g, 1, g["input_ids"][:1], g["positions"][:1], g["slot_mapping"][:1],
                                 g["context_lens"][:1], g["block_tables"][:1], None if order is None else order[:1])
        pool = None

        def inputs(n):  # the features' graph inputs
            return {name: g[name][:n] for name, _ in self.graph_inputs}
        for bs in reversed(self.batch_sizes):
            context = dict(is_prefill=False, slot_mapping=g["slot_mapping"][:bs], context_lens=g["context_lens"][:bs],
                           block_tables=g["block_tables"][:bs], decode_order=None if order is None else order[:bs])
            self.graphs[bs] = self._capture_one(bs, pool, context | inputs(bs))
            if pool is None:
                pool = self.graphs[bs].pool()
            if self.sample_graphs:
                self.sampling_graphs[bs] = self._capture_sampling(bs, pool)
        for t in reversed(self.mixed_sizes):
            context = dict(is_prefill=True, cu_seqlens_q=g["cu_seqlens_q"], max_seqlen_q=t,
                           context_lens=g["context_lens"], block_tables=g["block_tables"],
                           slot_mapping=g["slot_mapping"][:t])
            self.mixed_graphs[t] = self._capture_one(t, pool, context | inputs(t))
        for graph in (*self.graphs.values(), *self.sampling_graphs.values(), *self.mixed_graphs.values()):
            graph.replay()  # (a graph's first replay uploads it: not on a served step; the buffers are inert)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs for decode batch sizes up to %d and %d for steps with prompt chunks "
                    "up to %d tokens", len(self.graphs), self.max_num_seqs, len(self.mixed_graphs),
                    max(self.mixed_sizes, default=0))

    def release(self):
        self.graphs.clear()
        self.sampling_graphs.clear()
        self.mixed_graphs.clear()
        self.buffers = None

"""One per tensor-parallel rank: loads the model, sizes and allocates the paged KV cache, turns a
batch of sequences into flat input tensors, runs the forward (eagerly, or by replaying a CUDA graph
for decode), and samples on rank 0."""
import logging
from array import array
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.attention import select_backend
from nanoinfer.layers.linear import tp_shard
from nanoinfer.layers.sampler import Sampler, SamplingTensors
from nanoinfer.models import get_model_class
from nanoinfer.utils.context import get_context, reset_context, set_context
from nanoinfer.utils.loader import init_dummy_weights, load_model

logger = logging.getLogger("nanoinfer")

CPU_KV_BUDGET_BYTES = 1 << 30
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}  # array typecodes (8 and 4 bytes on our platforms)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """CUDA-graph buckets: 1, 2, 4, 8, then every 16, and max_num_seqs itself, so that every batch
    size up to max_num_seqs replays the smallest graph that holds it."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16))
                  | {max_num_seqs})


@dataclass
class PendingDecode:
    """A decode step launched but not yet collected (overlapped decode)."""
    seqs: list[Sequence]
    tokens: torch.Tensor          # [B] sampled ids, on the device
    host: torch.Tensor            # [B] pinned host copy, valid once `event` has completed
    event: "torch.cuda.Event | None"
    row_of: dict[int, int]        # seq_id -> row


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, dist_init_method: str | None = None):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.use_cuda_graph = config.device == "cuda" and not config.enforce_eager
        if self.world_size > 1:
            backend = "nccl" if config.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=dist_init_method, world_size=self.world_size, rank=rank)
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = select_backend(config.device, self.block_size)

        hf = config.hf_config
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device), tp_shard(rank, self.world_size):
                self.model = get_model_class(hf)(hf)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.sampler = Sampler()
        self.layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        attn = self.layers[0]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.num_blocks = self._measure_kv_capacity()
        self.graphs = {}

    # ---- KV cache -------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        dtype_size = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_dim * dtype_size

    def _measure_kv_capacity(self) -> int:
        """How many KV blocks this rank can hold (the engine takes the minimum over ranks)."""
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        one_seq = self.max_blocks_per_seq * self.block_bytes
        if self.device.type == "cpu":
            budget = min(max(CPU_KV_BUDGET_BYTES, one_seq), self.config.max_num_seqs * one_seq)
            return budget // self.block_bytes
        self._warmup()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        available = total * self.config.gpu_memory_utilization - (total - free) - peak + current
        return max(int(available) // self.block_bytes, 0)

    @torch.inference_mode()
    def _warmup(self):
        """A forward at the largest prefill the scheduler can build, to measure peak activation memory."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        max_len = self.config.max_model_len
        num_tokens = max(min(self.config.max_num_batched_tokens, self.config.max_num_seqs * max_len), 1)
        lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        cu = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        set_context(is_prefill=True, cu_seqlens_q=cu, max_seqlen_q=max(lens))
        self.model.compute_logits(self.model(input_ids, positions))
        reset_context()
        torch.cuda.synchronize(self.device)

    def allocate_kv_cache(self, num_blocks: int):
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty  # CPU: untouched until used
        for layer in self.layers:
            layer.k_cache = alloc(shape, dtype=self.config.torch_dtype, device=self.device)
            layer.v_cache = alloc(shape, dtype=self.config.torch_dtype, device=self.device)
        self.num_blocks = num_blocks
        if self.use_cuda_graph:
            self._capture_cuda_graphs()

    # ---- inputs ---------------------------------------------------------------------------------
    def _to_device(self, data, dtype):
        pin = self.device.type == "cuda"
        code = _ARRAY_CODES.get(dtype)
        if code and len(data) > 1024 and not isinstance(data[0], list):
            # a prefill's token-sized lists: through a C array, ~3x faster than torch.tensor(list)
            t = torch.frombuffer(array(code, data), dtype=dtype)
            t = t.pin_memory() if pin else t.clone()
        else:
            t = torch.tensor(data, dtype=dtype, pin_memory=pin)
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]):
        width = max(len(s.block_table) for s in seqs)
        return [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table, slots = self.block_size, seq.block_table, []
        for i in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            base = table[i] * bs - i * bs
            slots.extend(range(base + lo, base + hi))
        return slots

    def prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slot_mapping, query_lens, context_lens = [], [], [], [], []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq, start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        cu_q, cu_k = [0], [0]
        for q_len, k_len in zip(query_lens, context_lens):
            cu_q.append(cu_q[-1] + q_len)
            cu_k.append(cu_k[-1] + k_len)
        i32 = torch.int32
        set_context(is_prefill=True, cu_seqlens_q=self._to_device(cu_q, i32), cu_seqlens_k=self._to_device(cu_k, i32),
                    max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
                    slot_mapping=self._to_device(slot_mapping, torch.int64),
                    context_lens=self._to_device(context_lens, i32),
                    block_tables=self._to_device(self._block_tables(seqs), i32),
                    query_lens_cpu=query_lens, context_lens_cpu=context_lens)
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64)

    def prepare_decode(self, seqs: list[Sequence], ahead: int = 0):
        """ahead=1 (overlapped decode): each sequence has one sampled token the host has not seen
        yet; this step computes that token, at position len(seq), and its id comes from the device
        (the returned input ids are then None)."""
        input_ids, positions, slot_mapping, context_lens = [], [], [], []
        bs = self.block_size
        for seq in seqs:
            pos = len(seq) - 1 + ahead
            input_ids.append(seq.last_token)
            positions.append(pos)
            slot_mapping.append(seq.block_table[pos // bs] * bs + pos % bs)
            context_lens.append(pos + 1)
        order = None
        if self.backend == "triton":  # the decode kernel starts the longest contexts first
            order = self._to_device(sorted(range(len(seqs)), key=context_lens.__getitem__, reverse=True),
                                    torch.int32)
        set_context(is_prefill=False, slot_mapping=self._to_device(slot_mapping, torch.int64),
                    context_lens=self._to_device(context_lens, torch.int32),
                    block_tables=self._to_device(self._block_tables(seqs), torch.int32),
                    decode_order=order, context_lens_cpu=context_lens)
        ids = None if ahead else self._to_device(input_ids, torch.int64)
        return ids, self._to_device(positions, torch.int64)

    def prepare_sample(self, seqs: list[Sequence]) -> SamplingTensors:
        """The batch's sampling options as device tensors (rank 0 only)."""
        return SamplingTensors.build(seqs, self.config.hf_config.vocab_size, self.config.eos_token_ids, self.device)

    # ---- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids, positions, is_prefill: bool):
        n = input_ids.shape[0]
        if is_prefill or not self.graphs or n > self.graph_bs[-1]:
            return self.model.compute_logits(self.model(input_ids, positions))
        bucket = next(b for b in self.graph_bs if b >= n)
        ctx, g = get_context(), self.graph_vars
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"].fill_(-1)
        g["slot_mapping"][:n] = ctx.slot_mapping
        g["context_lens"].zero_()
        g["context_lens"][:n] = ctx.context_lens
        g["block_tables"][:n, :ctx.block_tables.shape[1]] = ctx.block_tables
        if ctx.decode_order is not None:
            g["decode_order"][:n] = ctx.decode_order
            if bucket > n:  # padded rows (context 0) last
                g["decode_order"][n:bucket] = g["rows"][n:bucket]
        self.graphs[bucket].replay()
        return self.model.compute_logits(g["outputs"][:n])

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """One engine step on this rank; returns sampled token ids on rank 0, None elsewhere."""
        input_ids, positions = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        sample_args = self.prepare_sample(seqs) if self.rank == 0 else None
        try:
            logits = self.run_model(input_ids, positions, is_prefill)
            # a list of token ids; its .logprobs carries the logprobs rows asked for
            token_ids = self.sampler(logits, sample_args) if self.rank == 0 else None
        finally:
            reset_context()
        return token_ids

    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], prev: "PendingDecode | None") -> "PendingDecode":
        """Overlapped decode (one rank): enqueue a decode step and return without waiting for it.
        With `prev`, the step's input tokens are `prev`'s sampled tokens, gathered on the device,
        so the host can plan this step before it has seen them."""
        input_ids, positions = self.prepare_decode(seqs, ahead=1 if prev is not None else 0)
        if prev is not None:
            rows = self._to_device([prev.row_of[s.seq_id] for s in seqs], torch.int64)
            input_ids = prev.tokens.index_select(0, rows)
        sample_args = self.prepare_sample(seqs)
        try:
            tokens, _ = self.sampler.sample(self.run_model(input_ids, positions, False), sample_args)
        finally:
            reset_context()
        host = torch.empty(len(seqs), dtype=tokens.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingDecode(seqs, tokens, host, event, {s.seq_id: i for i, s in enumerate(seqs)})

    def collect(self, pending: "PendingDecode") -> list[int]:
        """Wait for a launched decode step and return its sampled token ids."""
        if pending.event is not None:
            pending.event.synchronize()
        return pending.host.tolist()

    @torch.inference_mode()
    def _capture_cuda_graphs(self):
        """Decode graphs for batch buckets covering 1..max_num_seqs, block tables as wide as
        max_model_len needs; padded rows have slot -1 and context length 0."""
        max_bs = self.config.max_num_seqs
        self.graph_bs = graph_batch_sizes(max_bs)
        hidden = self.config.hf_config.hidden_size
        dev = self.device
        g = self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            block_tables=torch.full((max_bs, self.max_blocks_per_seq), -1, dtype=torch.int32, device=dev),
            outputs=torch.zeros(max_bs, hidden, dtype=self.config.torch_dtype, device=dev),
            rows=torch.arange(max_bs, dtype=torch.int32, device=dev),
        )
        g["decode_order"] = g["rows"].clone()
        order = g["decode_order"] if self.backend == "triton" else None
        pool = None
        for bs in reversed(self.graph_bs):
            graph = torch.cuda.CUDAGraph()
            set_context(is_prefill=False, slot_mapping=g["slot_mapping"][:bs], context_lens=g["context_lens"][:bs],
                        block_tables=g["block_tables"][:bs], decode_order=None if order is None else order[:bs])
            g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])  # warm-up
            with torch.cuda.graph(graph, pool):
                g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize(dev)
            reset_context()
        logger.info("captured %d CUDA graphs for decode batch sizes up to %d", len(self.graphs), max_bs)

    def exit(self):
        """Release the KV cache, graphs and weights now: the engine object may outlive exit()."""
        self.graphs.clear()
        self.graph_vars = None
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.layers = []
        self.model = None
        if self.device.type == "cuda" and self.world_size == 1:
            # (with tensor parallel a dead peer can leave a collective hanging: don't wait on it)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

"""One per tensor-parallel rank: loads the model, sizes and allocates the paged KV cache, turns a
step (engine/step_message.py) into flat input tensors, runs the forward (eagerly, or by replaying a
CUDA graph: decode-only steps by batch size, steps with prompt chunks by token count), and samples
on rank 0, or, for steps at temperature alone on CUDA, on every rank's vocabulary shard."""
import logging
from array import array
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.engine.step_message import SampleInput, StepInput, StepResult
from nanoinfer.layers.all_reduce import use_symmetric_memory
from nanoinfer.layers.attention import select_backend
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.layers.linear import tp_shard
from nanoinfer.layers.sampler import Sampler, sample_vocab_shard
from nanoinfer.layers.sampling_tensors import SamplingTensors
from nanoinfer.models import get_model_class
from nanoinfer.utils.context import get_context, reset_context, set_context
from nanoinfer.utils.loader import init_dummy_weights, load_model
from nanoinfer.utils.threads import cpu_threads

logger = logging.getLogger("nanoinfer")

CPU_KV_BUDGET_BYTES = 1 << 30
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}  # array typecodes (8 and 4 bytes on our platforms)


MIXED_GRAPH_MAX_TOKENS = 2048  # larger steps run eagerly: their device time dwarfs the launches


def mixed_graph_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token buckets of the CUDA graphs for steps that carry prompt chunks: every 256 tokens up to
    2048 (or the token budget). An eager step costs 14-19 ms of host launches for 28 layers on the
    H200, several times its device time at these sizes."""
    top = min(max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS)
    return sorted({*range(256, top, 256), top})


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """CUDA-graph buckets: 1, 2, 4, 8, then every 16, and max_num_seqs itself, so that every batch
    size up to max_num_seqs replays the smallest graph that holds it."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16))
                  | {max_num_seqs})


class SamplingFailed(Exception):
    """Sampling raised on rank 0 after the forward; the other ranks were kept in step."""


@dataclass
class InFlight:
    """A launched step whose results the host has not collected yet (on a rank that does not
    sample, only `tokens`: rank 0 broadcasts them, for the next step's in-flight rows)."""
    tokens: torch.Tensor                  # [rows] sampled ids, on the device
    host: torch.Tensor | None = None      # [rows] pinned host copy, valid once `event` has completed
    event: "torch.cuda.Event | None" = None
    sample_args: SamplingTensors | None = None
    logprobs: tuple | None = None         # device tensors from Sampler.sample, when a row asked
    prompt_logprobs: tuple | None = None  # (segments, device tensors), when a row asked (see _prompt_logprobs)


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
        else:  # torch's default (a thread per core, all waiting on each other) crawls on a busy machine
            torch.set_num_threads(cpu_threads(self.world_size))
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
        self.one_shot_all_reduce = self.world_size > 1 and self.device.type == "cuda" and \
            use_symmetric_memory(self.model, config.max_num_seqs, config.torch_dtype, self.device)
        self.sampler = Sampler()
        self.layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        attn = self.layers[0]
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.num_blocks = self._measure_kv_capacity()
        self.graphs, self.mixed_graphs = {}, {}
        self.mixed_graph_replays = 0

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

    @staticmethod
    def _block_tables(tables: list[list[int]]):
        width = max(len(t) for t in tables)
        return [t + [-1] * (width - len(t)) for t in tables]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs, slots = self.block_size, []
        for i in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            base = table[i] * bs - i * bs
            slots.extend(range(base + lo, base + hi))
        return slots

    def prepare(self, step: StepInput):
        """Flat inputs for one step and its attention context. Decode rows (one query token each)
        come first; a decode-only step can replay a CUDA graph, any other step runs every row as a
        prefill (a decode row is a query of length 1). Returns (input_ids, positions);
        rows whose token is on the device get a placeholder id, filled in by `launch`."""
        bs, nd = self.block_size, step.num_decode
        input_ids, positions, slots, context_lens = [], [], [], []
        for start, ids, table in step.rows[:nd]:
            input_ids.append(0 if isinstance(ids, int) else ids[0])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            context_lens.append(start + 1)
        tables = self._to_device(self._block_tables([table for _, _, table in step.rows]), torch.int32)
        i32 = torch.int32
        if step.is_decode_only:
            order = None
            if self.backend == "triton":  # the decode kernel starts the longest contexts first
                order = self._to_device(sorted(range(nd), key=context_lens.__getitem__, reverse=True), i32)
            set_context(is_prefill=False, slot_mapping=self._to_device(slots, torch.int64),
                        context_lens=self._to_device(context_lens, i32), block_tables=tables,
                        decode_order=order, context_lens_cpu=context_lens)
            return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64)
        query_lens = [1] * nd
        for start, ids, table in step.rows[nd:]:
            end = start + len(ids)
            input_ids.extend(ids)
            positions.extend(range(start, end))
            slots.extend(self._slots(table, start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        cu_q, cu_k = [0], [0]
        for q_len, k_len in zip(query_lens, context_lens):
            cu_q.append(cu_q[-1] + q_len)
            cu_k.append(cu_k[-1] + k_len)
        set_context(is_prefill=True, cu_seqlens_q=self._to_device(cu_q, i32), cu_seqlens_k=self._to_device(cu_k, i32),
                    max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
                    slot_mapping=self._to_device(slots, torch.int64), context_lens=self._to_device(context_lens, i32),
                    block_tables=tables, query_lens_cpu=query_lens, context_lens_cpu=context_lens)
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64)

    # ---- forward --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids, positions, decode_only: bool):
        n = input_ids.shape[0]
        if not decode_only:
            if not self.mixed_graphs or n > self.mixed_sizes[-1]:
                return self.model.compute_logits(self.model(input_ids, positions))
            return self._replay_mixed(input_ids, positions)
        if not self.graphs or n > self.graph_bs[-1]:
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

    def _replay_mixed(self, input_ids, positions):
        """A step with prompt chunks, through the graph of the smallest token bucket that holds it.
        The graph's attention has max_num_seqs rows and the bucket's query length: rows past the
        step's have no query tokens, and padded tokens have slot -1, so they compute nothing that
        is kept. The logits are taken outside, from the step's own context."""
        n = input_ids.shape[0]
        bucket = next(b for b in self.mixed_sizes if b >= n)
        ctx, g = get_context(), self.graph_vars
        rows = ctx.context_lens.shape[0]
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"].fill_(-1)
        g["slot_mapping"][:n] = ctx.slot_mapping
        g["cu_seqlens_q"].fill_(n)
        g["cu_seqlens_q"][:rows + 1] = ctx.cu_seqlens_q
        g["context_lens"].zero_()
        g["context_lens"][:rows] = ctx.context_lens
        g["block_tables"][:rows, :ctx.block_tables.shape[1]] = ctx.block_tables
        self.mixed_graphs[bucket].replay()
        self.mixed_graph_replays += 1
        return self.model.compute_logits(g["outputs"][:n])

    @torch.inference_mode()
    def launch(self, step: StepInput, sample: SampleInput | None, prev: InFlight | None) -> InFlight:
        """Enqueue one step and return without waiting for the device. Rank 0 (`sample` given)
        samples and starts a copy of the tokens to the host; with tensor parallelism it broadcasts
        them (or, for a step.plain_sample, every rank samples its vocabulary shard and all pick the
        same tokens), so that on every rank the next step's in-flight rows read their input token
        from `prev` (the step launched before this one) on the device."""
        input_ids, positions = self.prepare(step)
        on_device = [(row, ids) for row, (_, ids, _) in enumerate(step.rows) if isinstance(ids, int)]
        if on_device:
            dst, src = zip(*on_device)
            tokens = prev.tokens.index_select(0, self._to_device(list(src), torch.int64))
            if len(dst) == input_ids.shape[0]:  # every row: one gather
                input_ids = tokens
            else:
                input_ids[self._to_device(list(dst), torch.int64)] = tokens
        sample_args = prompt_logprobs = logprobs = None
        if sample is not None:
            sample_args = SamplingTensors.from_plan(sample.plan, self.device, prev.tokens if prev else None)
        try:
            if step.prompt_logit_rows:  # those prompt positions' logits too, after each row's last token
                nd = step.num_decode
                last = [end - 1 for end in accumulate([1] * nd + [len(ids) for _, ids, _ in step.rows[nd:]])]
                get_context().logits_indices = self._to_device(last + step.prompt_logit_rows, torch.int64)
            logits = self.run_model(input_ids, positions, step.is_decode_only)  # this rank's vocabulary shard
            if step.plain_sample is not None:
                temps, seed = step.plain_sample
                temps = sample_args.temperatures if sample_args is not None else self._to_device(temps, torch.float32)
                tokens = sample_vocab_shard(logits, temps, seed, self.model.lm_head.vocab_start)
            elif sample is None:  # a rank that does not sample: its shard goes to rank 0
                self.model.lm_head.gather(logits)
                tokens = torch.empty(len(step.rows), dtype=torch.int64, device=self.device)
            else:
                logits = self.model.lm_head.gather(logits)  # the full rows
                B = len(step.rows)
                if sample.prompt_logprobs is not None:
                    prompt_logprobs = self._prompt_logprobs(logits[B:], sample.prompt_logprobs)
                    logits = logits[:B]
                try:
                    tokens, logprobs = self.sampler.sample(logits, sample_args)
                except Exception as e:  # e.g. a user's logits processor
                    if self.world_size == 1:
                        raise
                    dist.broadcast(torch.zeros(B, dtype=torch.int64, device=self.device), 0)  # the others wait
                    raise SamplingFailed(f"{type(e).__name__}: {e}") from e
                tokens = tokens.to(torch.int64)
            if self.world_size > 1 and step.plain_sample is None:
                dist.broadcast(tokens, 0)
        finally:
            reset_context()
        if sample is None:
            return InFlight(tokens)
        host = torch.empty(len(step.rows), dtype=tokens.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(tokens, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return InFlight(tokens, host, event, sample_args, logprobs, prompt_logprobs)

    def _prompt_logprobs(self, logits: torch.Tensor, wanted) -> tuple:
        """Raw log-softmax of the prompt positions' logits: the next prompt token's logprob and
        rank, and the top-k. In slices, so the float32 copy stays small for long prompts."""
        segments, targets, k = wanted
        targets = self._to_device(targets, torch.int64)
        parts = []
        for lo in range(0, logits.shape[0], 1024):
            lp = torch.log_softmax(logits[lo:lo + 1024].float(), dim=-1)
            tok = lp.gather(1, targets[lo:lo + 1024, None])
            top = lp.topk(min(k, lp.shape[1]), dim=-1)
            parts.append((tok[:, 0], (lp > tok).sum(dim=-1) + 1, top.indices, top.values))
        return segments, *(torch.cat(x) for x in zip(*parts))

    def collect(self, inflight: InFlight) -> StepResult:
        """Rank 0: wait for a launched step and bring its results to the host (see StepResult;
        a prompt-logprob entry predicts the prompt token after its position)."""
        if inflight.event is not None:
            inflight.event.synchronize()
        tokens = inflight.host.tolist()
        logprobs = prompt_logprobs = None
        if inflight.logprobs is not None:
            logprobs = self.sampler.logprobs_to_host(inflight.sample_args, len(tokens), *inflight.logprobs)
        if inflight.prompt_logprobs is not None:
            segments, *tensors = inflight.prompt_logprobs
            tok_lp, rank, top_ids, top_lp = (x.tolist() for x in tensors)
            prompt_logprobs, i = [], 0
            for row, start, count, n in segments:
                prompt_logprobs.append((row, start, [(tok_lp[j], rank[j], top_ids[j][:n], top_lp[j][:n])
                                                     for j in range(i, i + count)]))
                i += count
        return StepResult(tokens, logprobs, prompt_logprobs)

    @torch.inference_mode()
    def _capture_cuda_graphs(self):
        """Decode graphs for batch buckets covering 1..max_num_seqs, block tables as wide as
        max_model_len needs; padded rows have slot -1 and context length 0. Then, with our Triton
        attention and a dense model, graphs for steps with prompt chunks (mixed_graph_sizes)."""
        max_bs = self.config.max_num_seqs
        self.graph_bs = graph_batch_sizes(max_bs)
        mixed = self.backend == "triton" and not any(isinstance(m, FusedMoE) for m in self.model.modules())
        self.mixed_sizes = mixed_graph_sizes(self.config.max_num_batched_tokens) if mixed else []
        tokens = max([max_bs, *self.mixed_sizes])
        hidden = self.config.hf_config.hidden_size
        dev = self.device
        g = self.graph_vars = dict(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
            positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            block_tables=torch.full((max_bs, self.max_blocks_per_seq), -1, dtype=torch.int32, device=dev),
            outputs=torch.zeros(tokens, hidden, dtype=self.config.torch_dtype, device=dev),
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
        for t in reversed(self.mixed_sizes):  # (zero query lengths: the captures attend to nothing)
            graph = torch.cuda.CUDAGraph()
            set_context(is_prefill=True, cu_seqlens_q=g["cu_seqlens_q"], max_seqlen_q=t, context_lens=g["context_lens"],
                        block_tables=g["block_tables"], slot_mapping=g["slot_mapping"][:t])
            g["outputs"][:t] = self.model(g["input_ids"][:t], g["positions"][:t])  # warm-up
            with torch.cuda.graph(graph, pool):
                g["outputs"][:t] = self.model(g["input_ids"][:t], g["positions"][:t])
            self.mixed_graphs[t] = graph
            torch.cuda.synchronize(dev)
            reset_context()
        logger.info("captured %d CUDA graphs for decode batch sizes up to %d and %d for steps with prompt chunks "
                    "up to %d tokens", len(self.graphs), max_bs, len(self.mixed_graphs),
                    max(self.mixed_sizes, default=0))

    def info(self) -> dict:
        """For benchmarks and tests: the attention backend, whether decode replays CUDA graphs, the
        token buckets of the graphs for steps with prompt chunks and how often they replayed,
        whether all-reduces of up to max_num_seqs rows go through symmetric memory, this rank's KV
        heads and parameter count (its shard)."""
        return dict(backend=self.backend, cuda_graphs=bool(self.graphs), mixed_graph_sizes=list(self.mixed_graphs),
                    mixed_graph_replays=self.mixed_graph_replays, num_kv_heads=self.num_kv_heads,
                    one_shot_all_reduce=self.one_shot_all_reduce,
                    num_parameters=sum(p.numel() for p in self.model.parameters()))

    def exit(self):
        """Release the KV cache, graphs and weights now: the engine object may outlive exit()."""
        self.graphs.clear()
        self.mixed_graphs.clear()
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

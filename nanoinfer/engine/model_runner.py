"""One tensor-parallel rank: its shard of the model, its KV cache, and a step's launch:
the features' before_forward -> prepare_inputs -> the sampler's route (it runs the forward) -> the
tokens' copy to the host. A launch never waits for the device; `collect` does. A step whose grammar
bitmask comes after the launch stops at its logits until `sample_launched` (structured/step_masks.py)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoinfer.config import Config
from nanoinfer.engine.forward_inputs import SHORT_ROWS_MAX_TOKENS, prepare_inputs
from nanoinfer.engine.graph_runner import GraphRunner, StepForward
from nanoinfer.engine.kv_cache import KVCache
from nanoinfer.step.step_message import SampleInput, StepInput, StepResult
from nanoinfer.engine.warm_up import warm_up
from nanoinfer.layers.all_reduce import use_symmetric_memory
from nanoinfer.layers.fused_moe import FusedMoE
from nanoinfer.models.build import build_model, model_attention_backend
from nanoinfer.sampling.sampler import Sampled, Sampler
from nanoinfer.utils.context import reset_context
from nanoinfer.utils.counters import model_counters
from nanoinfer.utils.threads import cpu_threads


@dataclass(slots=True)
class InFlight:
    """A launched step whose results the host has not collected yet (a rank that does not sample
    keeps only its tokens, which the next step's in-flight rows read)."""
    sampled: Sampled | None               # the tokens [rows] on the device, what logprobs and features need
    tokens: torch.Tensor | None           # them as the next step's inputs: NON_FINITE rows read token 0
    host: torch.Tensor | None = None      # [rows] pinned host copy, valid once `event` has completed
    event: "torch.cuda.Event | None" = None
    awaiting: tuple | None = None         # (step, sample, args, forward) until sample_launched


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, dist_init_method: str | None = None, rank_features=()):
        """rank_features: factories of this rank's RankFeatures (step/feature.py), each called with it."""
        self.config, self.rank, self.world_size = config, rank, config.tensor_parallel_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        if self.world_size > 1:
            backend = "nccl" if config.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=dist_init_method, world_size=self.world_size, rank=rank)
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        else:  # torch's default (a thread per core, all waiting on each other) crawls on a busy machine
            torch.set_num_threads(cpu_threads(self.world_size))
        self.attention = model_attention_backend(config)
        self.model = build_model(config, rank, self.world_size, self.device, self.attention)
        self.one_shot_all_reduce = self.world_size > 1 and self.device.type == "cuda" and \
            use_symmetric_memory(self.model, config.max_num_seqs, config.torch_dtype, self.device)
        self.features = [make(self) for make in rank_features]  # (their device memory before the pool's)
        dispatch = next((f.sampler_class for f in self.features if f.sampler_class is not None), Sampler)
        self.sampler = dispatch(self.model.lm_head, rank, self.world_size, self.device, self.features)
        self.kv_cache = KVCache(self.model, config, self.device)
        dense = not any(isinstance(m, FusedMoE) for m in self.model.modules())
        self.graph_runner = GraphRunner(
            self.model, config.max_num_seqs, config.max_num_batched_tokens, self.kv_cache.max_blocks_per_seq,
            config.hf_config.hidden_size, config.torch_dtype, self.device,
            mixed_steps=self.attention.mixed_step_graphs and dense, sorts_decode_rows=self.attention.sorts_decode_rows,
            graph_inputs=[field for f in self.features for field in f.graph_inputs],
            sample_graphs=self.sampler.samples_in_graphs)
        self.short_rows_tokens = min(SHORT_ROWS_MAX_TOKENS, config.max_num_seqs)  # (the largest decode graph's)
        self.num_blocks = self.kv_cache.measure_capacity()

    def feature(self, kind: type):
        """This rank's feature of class `kind`, or None."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    def allocate_kv_cache(self, num_blocks: int):
        self.kv_cache.allocate(num_blocks)
        self.num_blocks = num_blocks
        if self.device.type == "cuda" and not self.config.enforce_eager and \
                all(f.captures_graphs for f in self.features):
            self.graph_runner.capture()  # (a feature's steps may run eager: embeddings)
        # (one rank that samples; not for a feature whose steps the warm-up does not make: embeddings, images)
        if self.device.type == "cuda" and self.world_size == 1 and all(f.warms_up for f in self.features):
            warm_up(self, num_blocks)
            self.graph_runner.mixed_replays = 0

    @torch.inference_mode()
    def launch(self, step: StepInput, sample: SampleInput | None, prev: InFlight | None, on_device=None) -> InFlight:
        """Enqueue one step. Rank 0 (`sample` given) also starts the tokens' copy to the host. The
        step's in-flight rows read their token from `prev` on the device; `on_device`: tokens a
        proposer left there (prepare_inputs)."""
        prev_tokens = prev.tokens if prev is not None else None
        fields = {}  # (first: a later failure leaves the adapter slots as the message says)
        for feature in self.features:
            fields.update(feature.before_forward(step) or ())
        try:
            input_ids, positions = prepare_inputs(step, self.config.kvcache_block_size, self.device,
                                                  self.attention.sorts_decode_rows, prev_tokens,
                                                  self.short_rows_tokens, on_device, fields)
            forward = StepForward(self.graph_runner, input_ids, positions)
            args = self.sampler.prepare(sample, prev_tokens)
            sampled = self.sampler.sample(step, sample, args, forward)  # (its route runs the forward)
        finally:
            reset_context()
        if sampled.tokens is None:  # launched up to its logits: sample_launched gives the grammar bitmask
            return InFlight(None, None, awaiting=(step, sample, args, forward))
        return self._copy_to_host(sampled) if sample is not None else InFlight(sampled, sampled.inputs)

    @torch.inference_mode()
    def sample_launched(self, inflight: InFlight, bitmask: torch.Tensor) -> None:
        """Sample a step launched up to its logits under `bitmask` ([G, W] int32, on the host)."""
        step, sample, args, forward = inflight.awaiting
        inflight.awaiting = None
        args.set_grammar_bitmask(bitmask, self.device)
        self._copy_to_host(self.sampler.sample(step, sample, args, forward), inflight)

    def _copy_to_host(self, sampled: Sampled, inflight: InFlight | None = None) -> InFlight:
        inflight = inflight or InFlight(None, None)
        inflight.sampled, inflight.tokens = sampled, sampled.inputs
        tokens = sampled.tokens
        inflight.host = torch.empty(tokens.shape[0], dtype=tokens.dtype, pin_memory=self.device.type == "cuda")
        inflight.host.copy_(tokens, non_blocking=True)
        if self.device.type == "cuda":
            inflight.event = torch.cuda.Event()
            inflight.event.record()
        return inflight

    def collect(self, inflight: InFlight) -> StepResult:
        """Rank 0: wait for a launched step and bring its results to the host."""
        if inflight.awaiting is not None:
            raise RuntimeError("a step launched up to its logits was collected before sample_launched")
        if inflight.event is not None:
            inflight.event.synchronize()
        tokens = inflight.host.tolist()
        return StepResult(tokens, *self.sampler.to_host(inflight.sampled, len(tokens)))

    def info(self) -> dict:
        """For benchmarks and tests: the backend, the captured graphs, this rank's shard and counters."""
        graphs = self.graph_runner
        return dict(backend=self.attention.name, cuda_graphs=bool(graphs.graphs),
                    mixed_graph_sizes=list(graphs.mixed_graphs), mixed_graph_replays=graphs.mixed_replays,
                    num_kv_heads=self.kv_cache.num_kv_heads, one_shot_all_reduce=self.one_shot_all_reduce,
                    num_parameters=sum(p.numel() for p in self.model.parameters()),
                    counters=model_counters(self.model))

    def check_alive(self):
        """Alive as long as this process (TensorParallelExecutor checks its worker processes)."""

    def exit(self):
        """Release the KV cache, graphs and weights now: the engine object may outlive exit()."""
        self.graph_runner.release()
        self.kv_cache.release()
        self.graph_runner.model = self.sampler.lm_head = self.model = None
        for feature in self.features:
            feature.exit()
        if self.device.type == "cuda" and self.world_size == 1:
            # (with tensor parallel a dead peer can leave a collective hanging: don't wait on it)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

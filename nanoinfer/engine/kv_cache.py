"""One rank's paged KV cache: how many blocks fit, and their allocation.

Every attention layer holds a K and a V tensor of [num_blocks, block_size, num_kv_heads, head_dim]
(the one layout every backend reads). On CUDA the capacity is what gpu_memory_utilization leaves
after the weights and the peak activations of the largest step the scheduler can build; on CPU a
fixed budget, at least one max_model_len sequence."""
import torch

from nanoinfer.config import Config
from nanoinfer.kernels.kv_store import FP8_KV_DTYPE
from nanoinfer.utils.context import reset_context, set_context

CPU_KV_BUDGET_BYTES = 1 << 30


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores: the model's for "auto", e4m3 for "fp8" / "fp8_e4m3" (vLLM's names)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {kv_cache_dtype!r}")


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of K and V over every layer of one rank."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def blocks_that_fit(available_bytes: int, block_bytes: int) -> int:
    return max(int(available_bytes) // block_bytes, 0)


class KVCache:
    def __init__(self, model, config: Config, device: torch.device):
        self.model, self.config, self.device = model, config, device
        self.layers = [m for m in model.modules() if hasattr(m, "k_cache")]
        self.block_size = config.kvcache_block_size
        self.num_kv_heads, self.head_dim = self.layers[0].num_kv_heads, self.layers[0].head_dim
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.dtype = kv_cache_torch_dtype(config.kv_cache_dtype, config.torch_dtype)

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(len(self.layers), self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def measure_capacity(self) -> int:
        """How many blocks this rank can hold (the engine takes the minimum over ranks)."""
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        one_seq = self.max_blocks_per_seq * self.block_bytes
        if self.device.type == "cpu":
            budget = min(max(CPU_KV_BUDGET_BYTES, one_seq), self.config.max_num_seqs * one_seq)
            return blocks_that_fit(budget, self.block_bytes)
        self._largest_step()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        available = total * self.config.gpu_memory_utilization - (total - free) - peak + current
        return blocks_that_fit(available, self.block_bytes)

    @torch.inference_mode()
    def _largest_step(self):
        """A forward at the largest prefill the scheduler can build, to measure peak activation memory
        (before the cache exists, attention layers return zeros)."""
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
        if hasattr(self.model, "profile_encoder"):  # a vision tower's peak, for the images a step can cover
            self.model.profile_encoder(num_tokens)
        torch.cuda.synchronize(self.device)

    def allocate(self, num_blocks: int):
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty  # CPU: untouched until used
        for layer in self.layers:
            layer.k_cache = alloc(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = alloc(shape, dtype=self.dtype, device=self.device)

    def release(self):
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.layers = []
        self.model = None

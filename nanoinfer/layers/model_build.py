"""What every layer of one model is built with, passed down explicitly from the model's constructor:
this rank's place in tensor parallelism, the engine's attention backend, and the choice of weight
method for each linear layer (by its module name, as quantized checkpoints list the layers they
leave unquantized)."""
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoinfer.layers.attention_backend import AttentionBackend, TorchAttentionBackend
from nanoinfer.layers.linear_method import DenseLinearMethod, LinearMethod, dense_linear_method


@dataclass(frozen=True)
class TensorParallel:
    """This rank and the number of ranks a model is sharded over. Layers take it from here, never
    from torch.distributed: a tp=1 engine built in a process where the user initialised
    torch.distributed must not shard."""
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")


def whole_rows(product: Callable, x):
    """ModelBuild.rows_product's default: product(x), all the rows at once."""
    return product(x)


@dataclass(frozen=True)
class ModelBuild:
    """tp: the sharding; attention_backend: shared by every Attention layer; linear_method(prefix):
    the weight method of the linear layer named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj");
    max_model_len: the longest sequence the engine runs, which sizes the model's one RoPE cache
    (positions 0 .. max_model_len - 1; None: the model's max_position_embeddings); lm_head_method:
    the product of the LM head's dense weight (DenseLinearMethod's `apply`, or a wrapper of it);
    rows_product(product, x): how a product over a step-dependent set of rows (an expert's tokens
    on CPU) is taken (whole_rows: product(x) itself); fixed_kernels: a layer that picks its kernels
    or their tiles by the number of rows runs one choice for all, summing in one order (so a row's
    result never depends on the rows beside it)."""
    tp: TensorParallel = TensorParallel()
    attention_backend: AttentionBackend = field(default_factory=TorchAttentionBackend)
    linear_method: Callable[[str], LinearMethod] = dense_linear_method
    max_model_len: int | None = None
    lm_head_method: LinearMethod = field(default_factory=DenseLinearMethod)
    expert_parallel: bool = False  # MoE layers: whole experts spread over the tp ranks (nanoinfer/expert_parallel)
    rows_product: Callable = whole_rows
    fixed_kernels: bool = False

    def __post_init__(self):
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    def unsharded(self) -> "ModelBuild":
        """The build of a tower every rank holds whole, dense whatever the model's quantization or
        adapters (a vision encoder): each linear layer with lm_head_method (the dense product, or
        the wrapper of it this build uses), the same rows_product."""
        dense = self.lm_head_method
        return ModelBuild(linear_method=lambda prefix: dense, lm_head_method=dense, rows_product=self.rows_product,
                          fixed_kernels=self.fixed_kernels)

    def rope_positions(self, max_position_embeddings: int) -> int:
        """How many positions the RoPE cache holds: every one the engine can compute."""
        if self.max_model_len is None:
            return max_position_embeddings
        return min(max_position_embeddings, self.max_model_len)


def join(prefix: str, name: str) -> str:
    """The module name of child `name` under `prefix` ("" at the root)."""
    return f"{prefix}.{name}" if prefix else name

"""Every engine option, validated once, plus the Hugging Face config it loaded."""
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    async_scheduling: bool = True  # overlap host bookkeeping with the device's next decode step (tp=1)
    load_format: str = "auto"  # "dummy": random weights, no checkpoint read (benchmarks, as in vLLM)
    # Filled in by __post_init__, not user options.
    hf_config: PretrainedConfig | None = field(default=None, repr=False)
    torch_dtype: torch.dtype | None = field(default=None, repr=False)
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"model", "hf_config", "torch_dtype", "eos_token_ids"}

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        unknown = sorted(set(options) - cls.option_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; valid options are {sorted(cls.option_names())}")
        return cls(model, **options)

    def __post_init__(self):
        def check_int(name, low, high=None):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low or (high is not None and value > high):
                bound = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be {bound}, got {value}")

        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path or a Hugging Face repo id, got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
        check_int("max_num_batched_tokens", 1)
        check_int("max_num_seqs", 1, 65535)  # the attention kernels put sequences on a CUDA grid axis (<= 65535)
        check_int("max_model_len", 2)
        check_int("tensor_parallel_size", 1)
        check_int("kvcache_block_size", 16)
        check_int("seed", 0)
        if self.kvcache_block_size & (self.kvcache_block_size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {self.kvcache_block_size}")
        if self.num_kvcache_blocks is not None:
            check_int("num_kvcache_blocks", 1)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool):
            raise TypeError("gpu_memory_utilization must be a float")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, _DTYPES))}; got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                             f"{torch.cuda.device_count()} visible CUDA device(s)")

        if self.hf_config is None:
            self.model = resolve_model_path(self.model)
            self.hf_config = AutoConfig.from_pretrained(self.model)
        hf = self.hf_config
        from nanoinfer.models import check_architecture
        check_architecture(hf)
        self.max_model_len = min(self.max_model_len, hf.max_position_embeddings)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must fit one decode step
            self.max_num_seqs = self.max_num_batched_tokens
        tp = self.tensor_parallel_size
        if hf.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={hf.num_attention_heads}")
        if hf.num_key_value_heads % tp and tp % hf.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={hf.num_key_value_heads} "
                             "must divide one another")
        if hf.vocab_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide vocab_size={hf.vocab_size}")
        if getattr(hf, "intermediate_size", 0) % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size={hf.intermediate_size}")

        if self.dtype == "auto":
            if self.device == "cpu":
                self.torch_dtype = torch.float32
            else:
                ckpt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
                if isinstance(ckpt, str):
                    ckpt = _DTYPES.get(ckpt)
                self.torch_dtype = ckpt if ckpt in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        else:
            self.torch_dtype = _DTYPES[self.dtype]


def resolve_model_path(model: str) -> str:
    """A local checkpoint directory, or a Hugging Face repo id fetched into the local HF cache."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        return model
    if os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                        "tokenizer*", "generation_config.json"])
    except Exception as e:  # network or missing repo: say which model
        raise ValueError(f"could not fetch model {model!r} from the Hugging Face Hub: {e}") from e

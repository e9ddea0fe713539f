"""Every engine option, validated once, plus the Hugging Face config it loaded."""
import os
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import TYPE_CHECKING

# torch, transformers and the model registry are imported where they are used, so that reading the
# options (`nanoinfer serve --help` lists them from this class) stays fast
if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# vLLM's dtype names, "half" and "float" included -> torch's
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
# A sequence holds whole blocks and the prefix cache shares only full ones, so a block is useful up to
# about one context (vLLM offers <= 256; flash-attn wants multiples of 256); 2**16 tokens leaves room
# for the longest contexts while keeping one block's K/V per layer (256 MiB at 8 KV heads x 128 bf16)
# allocatable (far larger blocks also make a tiny request crawl on CPU).
MAX_KVCACHE_BLOCK_SIZE = 1 << 16
DEFAULT_MAX_MODEL_LEN = 4096
_MAX_SEED = 2**64 - 1  # torch.manual_seed takes at most an unsigned 64-bit seed


@dataclass
class Config:
    model: str
    tokenizer: str | None = None  # a tokenizer path or repo id; None: the model's
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None  # None: DEFAULT_MAX_MODEL_LEN, or the model's limit if lower
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # MoE models: each tensor-parallel rank holds E / tp whole experts instead of a slice of every
    # expert (nanoinfer/expert_parallel; vLLM's enable_expert_parallel). expert_parallel_size
    # (DeepInfer's name) turns it on too and must equal tensor_parallel_size; after init it holds
    # the number of ranks the experts are spread over (1: off)
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    enforce_eager: bool = False
    kvcache_block_size: int | None = None  # 256 unless given (here or as block_size)
    block_size: int | None = None  # vLLM's name for kvcache_block_size; both hold the same value after init
    num_kvcache_blocks: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False  # accepted for vLLM compatibility; True is refused
    async_scheduling: bool = True  # process each step on the host while the device computes the next (tp=1)
    load_format: str = "auto"  # "dummy": random weights, no checkpoint read (benchmarks, as in vLLM)
    # vLLM's names: None reads the checkpoint's quantization_config (if any); "fp8" quantizes a
    # bf16/fp32 checkpoint's linear layers at load time (per output channel)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" / "fp8_e4m3": K/V stored as e4m3
    scheduling_policy: str = "fcfs"  # or "priority": the lower `priority` first, ties by arrival (vLLM)
    runner: str = "auto"  # "generate", or "pooling" (embeddings: LLM.embed / encode / score); auto: generate
    task: str | None = None  # vLLM's older name: "embed" is runner="pooling", "generate" runner="generate"
    disable_log_stats: bool = True  # False: log the engine's statistics every few seconds (metrics/stats.py)
    # LoRA adapters per request (nanoinfer/lora; vLLM's names): max_loras device slots, adapters of
    # rank <= max_lora_rank, max_cpu_loras adapters cached on the host (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # images in chat content parts (multimodal/media.py): file:// URLs under this directory ("" refuses
    # them), http(s):// URLs of these hosts (None refuses them); data: URLs always
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    # vLLM's {"image": N}: at most N images a prompt (multimodal/limits.py; JSON on the command line)
    limit_mm_per_prompt: str | dict | None = None
    # most pixels an image may have (decoded; larger ones are refused before preprocessing)
    max_image_pixels: int = 1 << 26
    # compiled grammars of structured outputs kept for reuse, in bytes (structured/compiler.py)
    grammar_cache_bytes: int = 512 << 20
    # vLLM's speculative_config dict (nanoinfer/speculative/config.py), parsed into a SpeculativeConfig
    speculative_config: str | dict | None = None  # (a JSON string on the command line)
    # a request's tokens and logprobs bitwise the same in any batch (nanoinfer/batch_invariant; also
    # NANOINFER_BATCH_INVARIANT=1, read here once)
    batch_invariant: bool = False
    # Filled in by __post_init__, not user options.
    hf_config: "PretrainedConfig | None" = field(default=None, repr=False)
    torch_dtype: "torch.dtype | None" = field(default=None, repr=False)

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"model", "hf_config", "torch_dtype"}

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        unknown = sorted(set(options) - cls.option_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; valid options are {sorted(cls.option_names())}")
        return cls(model, **options)

    def __post_init__(self):
        self._check_options()
        self._check_device()
        self._check_model()
        self._resolve_dtype()

    def _check_int(self, name, low, high=None):
        """An int option in [low, high] (numpy integers too), stored as int."""
        value = getattr(self, name)
        if not isinstance(value, Integral) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        value = int(value)  # numpy integers too
        if value < low or (high is not None and value > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{name} must be {bound}, got {value}")
        setattr(self, name, value)

    def _check_options(self):
        """Each option's type and range, before anything is read from disk."""
        self.model = _path("model", self.model)
        if self.tokenizer is not None:
            self.tokenizer = _path("tokenizer", self.tokenizer)
        self._check_int("max_num_batched_tokens", 1)
        self._check_int("max_num_seqs", 1, 65535)  # the attention kernels put sequences on a CUDA grid axis (<= 65535)
        if self.max_model_len is not None:
            self._check_int("max_model_len", 2)
        self._check_int("tensor_parallel_size", 1)
        self._check_int("seed", 0, _MAX_SEED)
        self._check_block_size()
        if self.num_kvcache_blocks is not None:
            self._check_int("num_kvcache_blocks", 1)
        if not isinstance(self.gpu_memory_utilization, Real) or isinstance(self.gpu_memory_utilization, bool):
            raise TypeError(f"gpu_memory_utilization must be a float, got {type(self.gpu_memory_utilization).__name__}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.gpu_memory_utilization = float(self.gpu_memory_utilization)  # numpy floats too
        self._check_runner()
        self._check_lora_options()
        self._check_speculative()
        for name in ("enforce_eager", "async_scheduling", "enable_prefix_caching", "trust_remote_code",
                     "disable_log_stats", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.trust_remote_code:
            raise ValueError("trust_remote_code=True is not supported: nanoinfer never runs code from a checkpoint")
        if not isinstance(self.dtype, str) or self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, _DTYPES))}; got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        from nanoinfer.multimodal.media import MediaLoader
        MediaLoader(self.allowed_local_media_path, self.allowed_media_domains)  # raises on a bad path or host list
        from nanoinfer.multimodal.limits import parse_mm_limits
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        self._check_int("max_image_pixels", 1)
        self._check_int("grammar_cache_bytes", 0)
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")

    def _check_device(self):
        import torch
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        if self.device == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} exceeds the "
                             f"{torch.cuda.device_count()} visible CUDA device(s)")

    def _check_model(self):
        """The checkpoint's config, and the options that depend on it."""
        from nanoinfer.models import check_architecture
        from nanoinfer.multimodal.config import language_model_config
        if self.hf_config is None:
            self.model = resolve_model_path(self.model)
            self.hf_config = language_model_config(load_hf_config(self.model))
        self.tokenizer = self.model if self.tokenizer is None else resolve_model_path(self.tokenizer, "tokenizer")
        hf = self.hf_config
        check_architecture(hf)
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, hf.max_position_embeddings)
        elif self.max_model_len > hf.max_position_embeddings:  # (as vLLM: never clipped silently)
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{hf.max_position_embeddings}; give at most that")
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

        from nanoinfer.expert_parallel.options import resolve_expert_parallel
        resolve_expert_parallel(self)
        from nanoinfer.batch_invariant.options import resolve_batch_invariant
        resolve_batch_invariant(self)

        if self.enable_lora:
            from nanoinfer.lora.targets import check_lora_model
            check_lora_model(hf)

    def _resolve_dtype(self):
        import torch
        hf = self.hf_config
        if self.dtype == "auto":
            if self.device == "cpu":
                self.torch_dtype = torch.float32
            else:
                ckpt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
                if isinstance(ckpt, str):
                    ckpt = getattr(torch, _DTYPES.get(ckpt, ""), None)
                self.torch_dtype = ckpt if ckpt in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        else:
            self.torch_dtype = getattr(torch, _DTYPES[self.dtype])

    def _check_runner(self):
        """scheduling_policy, and runner with its older alias task."""
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.task is not None:
            aliases = {"embed": "pooling", "encode": "pooling", "generate": "generate"}
            if self.task not in aliases:
                raise ValueError(f"task must be one of {sorted(aliases)} (or give runner=), got {self.task!r}")
            if self.runner not in ("auto", aliases[self.task]):
                raise ValueError(f"task={self.task!r} contradicts runner={self.runner!r}; give one")
            self.runner = aliases[self.task]
        if self.runner == "auto":
            self.runner = "generate"
    def _check_speculative(self):
        from nanoinfer.speculative.config import SpeculativeConfig
        self.speculative_config = spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and self.runner == "pooling":
            raise ValueError("speculative_config is for generation; runner='pooling' takes none")
        if spec is not None and spec.model is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: a draft model runs with tensor_parallel_size=1 only")

    def _check_lora_options(self):
        self._check_int("max_loras", 1, 1024)
        self._check_int("max_lora_rank", 1, 1024)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        self._check_int("max_cpu_loras", self.max_loras)

    def _check_block_size(self):
        """kvcache_block_size, or its vLLM name block_size: a power of two in [16, 2**16]."""
        for name in ("kvcache_block_size", "block_size"):
            if getattr(self, name) is not None:
                self._check_int(name, 16, MAX_KVCACHE_BLOCK_SIZE)
        if None not in (self.kvcache_block_size, self.block_size) and self.kvcache_block_size != self.block_size:
            raise ValueError(f"block_size={self.block_size} and kvcache_block_size={self.kvcache_block_size} "
                             "name the same option; give one")
        size = self.kvcache_block_size or self.block_size or 256
        if size & (size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two in [16, {MAX_KVCACHE_BLOCK_SIZE}], got {size}")
        self.kvcache_block_size = self.block_size = size


def _path(name: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path or a Hugging Face repo id, got {type(value).__name__}")
    return os.path.expanduser(os.fspath(value))


def load_hf_config(path: str) -> "PretrainedConfig":
    """The checkpoint's config.json, never running code from the checkpoint (transformers would
    otherwise ask on stdin whether to run an auto_map's code)."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # unreadable, custom code, or refused by transformers' own validators
        raise ValueError(f"could not load the model config of {path!r} (nanoinfer runs no code from a "
                         f"checkpoint: trust_remote_code=False): {e}") from e


def resolve_model_path(model: str, what: str = "model") -> str:
    """A local checkpoint (or tokenizer) directory, or a Hugging Face repo id fetched into the local HF cache."""
    if os.path.isdir(model):
        if what == "model" and not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json")
        return model
    if os.path.exists(model) or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(f"{what} {model!r} is neither a directory nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    try:
        weights = ["*.safetensors"] if what == "model" else []
        return snapshot_download(model, allow_patterns=["*.json", *weights, "*.txt", "*.model", "tokenizer*"])
    except Exception as e:  # network or missing repo: say which model
        raise ValueError(f"could not fetch {what} {model!r} from the Hugging Face Hub: {e}") from e

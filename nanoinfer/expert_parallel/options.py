"""The Config's expert-parallel options: `enable_expert_parallel` (vLLM's name) and
`expert_parallel_size` (DeepInfer's; giving it turns expert parallelism on). In this version the
experts are spread over the tensor-parallel ranks, so the EP size is the TP size."""
from transformers import PretrainedConfig


def num_experts(hf: PretrainedConfig) -> int:
    """The routed experts per MoE layer (Qwen3-MoE's num_experts, Mixtral's num_local_experts); 0
    for a dense model."""
    return int(getattr(hf, "num_experts", 0) or getattr(hf, "num_local_experts", 0) or 0)


def resolve_expert_parallel(config) -> None:
    """Check the two options against each other, the tensor-parallel size and the model, then set
    config.expert_parallel_size to the number of ranks the experts are spread over (1: off)."""
    enable, size, tp = config.enable_expert_parallel, config.expert_parallel_size, config.tensor_parallel_size
    if not isinstance(enable, bool):
        raise TypeError(f"enable_expert_parallel must be a bool, got {type(enable).__name__}")
    if size is not None:
        config._check_int("expert_parallel_size", 1)
        size = config.expert_parallel_size
        if size != tp:
            raise ValueError(f"expert_parallel_size={size} must equal tensor_parallel_size={tp}: in this version "
                             "the experts are spread over the tensor-parallel ranks")
        enable = config.enable_expert_parallel = True
    config.expert_parallel_size = tp if enable else 1
    if not enable:
        return
    experts = num_experts(config.hf_config)
    if experts == 0:
        archs = getattr(config.hf_config, "architectures", None) or [config.hf_config.model_type]
        raise ValueError(f"enable_expert_parallel / expert_parallel_size: {archs[0]} is a dense model (no "
                         "experts); expert parallelism is for mixture-of-experts models (Qwen3-MoE, Mixtral)")
    if experts % tp:
        raise ValueError(f"expert_parallel_size={tp} (the tensor_parallel_size) must divide the model's "
                         f"{experts} experts")

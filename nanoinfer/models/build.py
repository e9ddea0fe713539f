"""`build_model`: one rank's model, built with each linear layer's weight method, then loaded."""
import torch
from torch import nn

from nanoinfer.batch_invariant import InvariantLinearMethod, fixed_rows, invariant_attention_backend, invariant_chooser
from nanoinfer.layers.all_reduce import AllReduce
from nanoinfer.layers.attention_backend import AttentionBackend, select_attention_backend
from nanoinfer.layers.linear import LinearBase
from nanoinfer.layers.linear_method import DenseLinearMethod
from nanoinfer.layers.model_build import ModelBuild, TensorParallel, whole_rows
from nanoinfer.lora.linear import lora_method_chooser
from nanoinfer.models import check_architecture, get_model_class
from nanoinfer.models.config_limits import check_fits_memory
from nanoinfer.quant import fp8_scheme, linear_method_chooser
from nanoinfer.utils import loader  # (looked up at call time: tests wrap loader.load_model)


def build_model(config, rank: int, world_size: int, device: torch.device,
                attention_backend: AttentionBackend) -> nn.Module:
    """The model of `config` (a nanoinfer Config) for tensor-parallel rank `rank` of `world_size`: built on `device` in
    config.torch_dtype (seeded: the same random values wherever nothing is loaded), each linear layer
    with the weight method of the checkpoint's quantization_config or of config.quantization
    (nanoinfer/quant; with enable_lora, wrapped by the LoRA method of nanoinfer/lora), then its
    weights loaded, or drawn at random for load_format="dummy", then each weight method (and each
    module that has one, as FP8 experts) told the weights are in. With batch_invariant, every
    product (the LM head's too) is batch-invariant (nanoinfer/batch_invariant), and so is every
    tensor-parallel all-reduce (in rank order)."""
    hf = config.hf_config
    scheme = fp8_scheme(config.quantization, hf)
    model_class = get_model_class(hf)
    fp8 = scheme is not None and torch.device(device).type == "cuda"  # (CPU dequantizes at load)
    check_fits_memory(hf, check_architecture(hf), config.torch_dtype, device, world_size, config.max_model_len,
                      fp8=fp8, fp8_experts=fp8)
    packed = getattr(model_class, "packed_modules_mapping", {})
    choose = linear_method_chooser(scheme, packed)
    lm_head_method, rows_product = DenseLinearMethod(), whole_rows
    invariant = getattr(config, "batch_invariant", False)
    if invariant:
        choose, lm_head_method = invariant_chooser(choose), InvariantLinearMethod(lm_head_method)
        rows_product = fixed_rows
    if config.enable_lora:  # adapters wrap each projection's method (nanoinfer/lora)
        choose = lora_method_chooser(choose, packed, config.max_loras, config.max_lora_rank,
                                    fixed_rows if invariant else None)
    build = ModelBuild(TensorParallel(rank, world_size), attention_backend, linear_method=choose,
                       lm_head_method=lm_head_method, rows_product=rows_product, fixed_kernels=invariant,
                       max_model_len=config.max_model_len,  # sizes the RoPE cache
                       expert_parallel=getattr(config, "expert_parallel_size", 1) > 1)
    torch.manual_seed(config.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.torch_dtype)
    try:
        with torch.device(device):
            model = model_class(hf, build)
    finally:
        torch.set_default_dtype(default_dtype)
    if getattr(config, "runner", "generate") == "pooling" and not getattr(model, "tie_word_embeddings", True):
        model.lm_head.weight.optional_in_checkpoint = True  # embeddings never use the LM head
        model.lm_head.weight.data.zero_()  # (absent from a base-model checkpoint: defined, so finite)
    if config.load_format == "dummy":
        loader.init_dummy_weights(model, config.seed)
    else:
        loader.load_model(model, config.model, config.kv_cache_dtype)
    for module in model.modules():
        if isinstance(module, AllReduce):
            module.in_rank_order = invariant
        if isinstance(module, LinearBase):
            module.method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model


def model_attention_backend(config) -> AttentionBackend:
    """The attention backend the engine's model runs with: the device's (select_attention_backend),
    or the batch-invariant one with config.batch_invariant."""
    if getattr(config, "batch_invariant", False):
        return invariant_attention_backend(config.device)
    return select_attention_backend(config.device, config.kvcache_block_size, config.kv_cache_dtype)

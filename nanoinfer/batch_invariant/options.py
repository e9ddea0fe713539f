"""The batch_invariant option: LLM(batch_invariant=True), NANOINFER_BATCH_INVARIANT=1 (read once,
when the Config is made, as vLLM reads VLLM_BATCH_INVARIANT), `nanoinfer serve --batch-invariant`.
What the invariant path does not cover yet is refused here, never run silently non-invariant."""
import os

ENV_VAR = "NANOINFER_BATCH_INVARIANT"
_ENV_VALUES = {"1": True, "true": True, "0": False, "false": False, "": False}


def env_batch_invariant() -> bool:
    """NANOINFER_BATCH_INVARIANT: 1/true turns the mode on, 0/false/unset leaves the option as given."""
    value = os.environ.get(ENV_VAR, "")
    if value.strip().lower() not in _ENV_VALUES:
        raise ValueError(f"{ENV_VAR} must be 1 or 0 (true or false), got {value!r}")
    return _ENV_VALUES[value.strip().lower()]


def resolve_batch_invariant(config) -> None:
    """Check config.batch_invariant (a bool), turn it on from the environment, and refuse the CUDA
    engines it cannot make invariant yet. Called once the device and the model's config are known."""
    if not isinstance(config.batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(config.batch_invariant).__name__}")
    config.batch_invariant = config.batch_invariant or env_batch_invariant()
    if not config.batch_invariant:
        return
    if config.device != "cuda":  # (on CPU every part of the engine runs invariant)
        return
    hf = config.hf_config
    refusals = [
        (config.quantization is not None or bool(getattr(hf, "quantization_config", None)),
         "quantized weights on CUDA: the FP8 GEMMs split K by the number of rows"),
        (config.tensor_parallel_size > 1,
         f"tensor_parallel_size={config.tensor_parallel_size} on CUDA: not verified batch-invariant there yet; use 1"),
        (config.enable_lora, "enable_lora on CUDA: the adapters' kernels are not batch-invariant yet"),
        (config.speculative_config is not None,
         "speculative_config on CUDA: speculative decoding is not verified batch-invariant there yet"),
        (getattr(hf, "vision_config", None) is not None,
         "vision-language models on CUDA: the image encoder is not verified batch-invariant there yet"),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"batch_invariant=True (or {ENV_VAR}=1) cannot run with {why}")

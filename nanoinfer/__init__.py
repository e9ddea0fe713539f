import importlib
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("nanoinfer")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0.1.0"

# The public names load on first use (PEP 562), so that `nanoinfer serve --help` and other light
# entry points do not import torch.
_PUBLIC = {"LLM": "nanoinfer.llm", "LoRARequest": "nanoinfer.lora", "CompletionOutput": "nanoinfer.outputs",
           "Logprob": "nanoinfer.outputs", "RequestOutput": "nanoinfer.outputs",
           "EmbeddingRequestOutput": "nanoinfer.pooling", "PoolingParams": "nanoinfer.pooling",
           "PoolingRequestOutput": "nanoinfer.pooling", "ScoringRequestOutput": "nanoinfer.pooling",
           "SamplingParams": "nanoinfer.sampling_params", "StructuredOutputsParams": "nanoinfer.sampling_params"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'nanoinfer' has no attribute {name!r}")
    module = importlib.import_module(_PUBLIC[name])
    if name == "LLM" and module.LLM.data_parallel_backend is None:
        from nanoinfer.data_parallel.llm import DataParallelEngines
        module.LLM.data_parallel_backend = DataParallelEngines  # LLM(model, data_parallel_size=N > 1)
    value = getattr(module, name)
    globals()[name] = value
    return value


__all__ = ["__version__", "LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ScoringRequestOutput"]

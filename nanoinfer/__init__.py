from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("nanoinfer")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0.1.0"

from nanoinfer.data_parallel.llm import DataParallelEngines  # noqa: E402
from nanoinfer.llm import LLM  # noqa: E402
from nanoinfer.lora import LoRARequest
from nanoinfer.outputs import CompletionOutput, Logprob, RequestOutput
from nanoinfer.pooling import EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, ScoringRequestOutput
from nanoinfer.sampling_params import SamplingParams, StructuredOutputsParams

LLM.data_parallel_backend = DataParallelEngines  # LLM(model, data_parallel_size=N > 1)

__all__ = ["__version__", "LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ScoringRequestOutput"]

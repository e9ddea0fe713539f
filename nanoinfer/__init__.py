from nanoinfer.llm import LLM
from nanoinfer.outputs import CompletionOutput, Logprob, RequestOutput
from nanoinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

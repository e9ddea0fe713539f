from nanoinfer.llm import LLM
from nanoinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]

"""What embed / encode / score return, shaped like vLLM's pooling outputs."""
from dataclasses import dataclass

import torch

from nanoinfer.outputs import RequestMetrics


@dataclass
class PoolingOutput:
    data: torch.Tensor                  # the pooled vector, float32 on the CPU


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled result (LLM.encode; the server's embeddings). `outputs.data` is the vector."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (LLM.embed): `outputs.embedding`, a list of floats."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool

    @classmethod
    def of(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, out.prompt, out.prompt_token_ids, EmbeddingOutput(out.outputs.data.tolist()),
                   out.finished)


@dataclass
class ScoringRequestOutput:
    """One pair's cosine similarity (LLM.score): `outputs.score`."""
    request_id: int
    prompt_token_ids: list[int]         # the pair's two prompts, concatenated
    outputs: ScoringOutput
    finished: bool = True


def pooling_output(req) -> PoolingRequestOutput:
    """The engine's Request of an embedding (its one sequence's PoolingState) as its output."""
    seq = req.seqs[0]
    done = req.finished and seq.finish_reason != "abort" and seq.pooling.value is not None
    data = seq.pooling.embedding() if done else torch.empty(0)
    metrics = RequestMetrics(req.arrival_time, req.completions[0].finished_time, req.completions[0].finished_time)
    return PoolingRequestOutput(req.request_id, req.prompt, req.prompt_token_ids, PoolingOutput(data), done,
                                metrics, req.completions[0].num_cached_tokens)

"""Pooling (runner="pooling"): embeddings from a decoder's final hidden states, vLLM's offline API
(LLM.embed / encode / score, PoolingParams) and the server's /v1/embeddings.

The seam in the core: an embedding is a request of one step past its prompt (intake.py); the step
encoder marks its rows (rows.py: StepInput.pooling), the runner sums their hidden states instead of
sampling, and the engine hands the sums back (StepResult.pooled) before the scheduler finishes the
request. Pooling type from the checkpoint (pooling_config.py); the per-request sums (state.py)."""
from nanoinfer.pooling.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                                       ScoringOutput, ScoringRequestOutput)
from nanoinfer.pooling.params import PoolingParams

__all__ = ["PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ScoringOutput", "ScoringRequestOutput"]

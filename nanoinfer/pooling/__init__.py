"""Pooling (runner="pooling"): embeddings from a decoder's final hidden states, vLLM's offline API
(LLM.embed / encode / score, PoolingParams) and the server's /v1/embeddings.

The seam in the core: the engine and rank hooks of feature.py, registered for runner="pooling". An
embedding is a request of one step past its prompt (intake.py); each step's message marks its rows
(rows.py: PoolingRows in StepInput.parts), the ranks sum their hidden states instead of sampling (dispatch.py,
the rank's dispatch), and the sums come back (StepResult.outputs) before the scheduler finishes
the request. Pooling type from the checkpoint (pooling_config.py); the per-request sums (state.py)."""
from nanoinfer.pooling.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                                       ScoringOutput, ScoringRequestOutput)
from nanoinfer.pooling.params import PoolingParams

__all__ = ["PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ScoringOutput", "ScoringRequestOutput"]

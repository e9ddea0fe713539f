"""An embedding engine's rank dispatch, in place of sampling (RankFeature.sampler_class): no LM
head, no sampling; a step's forward runs eager (no CUDA graphs are captured for an embedding
engine), rank 0 sums each segment's final hidden states (rows.py) and starts their copy to the
host with the step's tokens, which are zeros."""
import torch

from nanoinfer.pooling.rows import POOLING, pool_hidden
from nanoinfer.sampling.sampler import Sampled, Sampler

POOLED = "pooled"  # the key in StepResult.outputs: the PoolingRows' sums, a float32 CPU tensor [segments, hidden]


class PoolingDispatch(Sampler):
    def prepare(self, sample, prev_tokens) -> None:
        return None  # (nothing samples)

    def sample(self, step, sample, args, forward) -> Sampled:
        hidden = forward.hidden()  # (every rank: the forward's all-reduces)
        outputs = None
        if sample is not None:
            pooled = pool_hidden(hidden, step.part(POOLING)).to("cpu", non_blocking=True)
            outputs = {POOLED: lambda: pooled}
        return Sampled(torch.zeros(step.num_rows, dtype=torch.int64, device=self.device), outputs=outputs)

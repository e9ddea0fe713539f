"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.all_reduce import AllReduce
from nanoinfer.layers.linear_method import LinearMethod
from nanoinfer.layers.model_build import TensorParallel
from nanoinfer.utils.context import get_context
from nanoinfer.utils.loader import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.shard_size = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if self.tp_size > 1 and type(self) is VocabParallelEmbedding:  # (the LM head gathers instead)
            self.all_reduce = AllReduce(embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        check_shape(loaded, [self.num_embeddings, param.shape[1]])  # before narrow cuts a larger vocabulary
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """This rank's shard of the logits (columns from vocab_start) for the rows the context names
    (logits_indices), else each prefill sequence's last token, else every row (decode); the
    sampler gathers them or samples each shard. `method`: ModelBuild.lm_head_method."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TensorParallel, method: LinearMethod):
        super().__init__(num_embeddings, embedding_dim, tp=tp)
        self.method = method

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.logits_indices is not None:
            hidden = hidden[ctx.logits_indices]
        elif ctx.is_prefill:
            hidden = hidden[ctx.cu_seqlens_q[1:] - 1]
        return self.method.apply(self, hidden)

    def gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every rank's shard of the logits, as full rows on rank 0; None on the other ranks."""
        if self.tp_size == 1:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, shards, 0)
        return torch.cat(shards, -1) if self.tp_rank == 0 else None

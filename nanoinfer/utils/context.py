"""Per-step forward state, set by the model runner before a forward and cleared after it."""
from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_prefill: bool = False
    # prefill: query tokens of sequence i are rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None   # [num_tokens] cache slot of each new token, -1 = skip
    context_lens: torch.Tensor | None = None   # [num_seqs] tokens in the cache after this step
    block_tables: torch.Tensor | None = None   # [num_seqs, width] int32, -1 padded
    decode_order: torch.Tensor | None = None   # [num_seqs] int32, longest context first (Triton decode)
    # rows of the hidden states the LM head computes logits for; None: each sequence's last token
    # (prefill) or every row (decode). Set only for steps with prompt_logprobs rows.
    logits_indices: torch.Tensor | None = None
    # [num_tokens] LoRA slot of each token's row, -1 = the base model; None: no adapter this step
    lora_slots: torch.Tensor | None = None
    lora_mask: torch.Tensor | None = None  # [num_tokens, max_loras] one-hot of lora_slots, made once per forward
    # multimodal steps: (flat rows [K] int64, their embeddings [K, hidden]) replacing those rows'
    # token embeddings (images), set by the model runner; None: every row is a token embedding
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # host copies of the lengths, for the CPU reference path (no device sync)
    query_lens_cpu: list[int] | None = None
    context_lens_cpu: list[int] | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(**kwargs):
    global _CONTEXT
    _CONTEXT = Context(**kwargs)


def reset_context():
    global _CONTEXT
    _CONTEXT = Context()

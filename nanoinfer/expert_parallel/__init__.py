"""Expert parallelism for mixture-of-experts models (vLLM's enable_expert_parallel): each
tensor-parallel rank holds a contiguous block of whole experts instead of a slice of every expert.
Attention and the dense layers stay tensor-parallel. `options.py` checks the Config's options,
`placement.py` says which experts a rank holds and counts the tokens routed to each rank; the MoE
layer (layers/fused_moe.py) uses both."""

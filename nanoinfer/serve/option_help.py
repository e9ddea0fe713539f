"""The help text of each engine option's --flag, with the default it really has (an option whose
Config default is None is filled in later: its help says with what). tests/test_server.py checks
that every Config option has one."""

OPTION_HELP = {
    "tokenizer": "a tokenizer directory or repo id (default: the model's)",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks (default: 16384)",
    "max_num_seqs": "sequences running at once, in [1, 65535] (default: 512)",
    "max_model_len": "prompt + output limit, at most the model's max_position_embeddings (default: 4096, or the "
                     "model's limit if lower)",
    "gpu_memory_utilization": "share of GPU memory for weights, activations and the KV cache (default: 0.9)",
    "tensor_parallel_size": "GPUs (or CPU processes) the model is sharded over (default: 1)",
    "enable_expert_parallel": "MoE models: each tensor-parallel rank holds E / tp whole experts instead of a slice "
                              "of every expert (default: off)",
    "expert_parallel_size": "ranks the experts are spread over; must equal --tensor-parallel-size (giving it turns "
                            "--enable-expert-parallel on) (default: off)",
    "enforce_eager": "no CUDA graphs (default: off)",
    "kvcache_block_size": "tokens per KV-cache block, a power of two >= 16 (default: 256)",
    "block_size": "vLLM's name for --kvcache-block-size (default: 256)",
    "num_kvcache_blocks": "force the KV pool's size in blocks (default: sized from GPU memory)",
    "enable_prefix_caching": "reuse the KV blocks of earlier prompts' common prefixes (default: on)",
    "dtype": "auto, float32/float, bfloat16, float16/half (default: auto: the checkpoint's on CUDA, float32 on CPU)",
    "device": "auto, cuda or cpu (default: auto: cuda when available)",
    "seed": "seed for sampling and dummy weights (default: 0)",
    "trust_remote_code": "accepted for vLLM compatibility; on is refused (default: off)",
    "async_scheduling": "overlap the host's work on each step with the device's next step (default: on)",
    "load_format": "auto, or dummy: random weights, no checkpoint read (default: auto)",
    "quantization": "fp8: quantize a bf16 checkpoint's linear layers at load (default: the checkpoint's "
                    "quantization_config, if any)",
    "kv_cache_dtype": "auto (the model's dtype), or fp8 / fp8_e4m3 (default: auto)",
    "scheduling_policy": "fcfs, or priority: requests with a lower 'priority' run first, ties by arrival "
                         "(default: fcfs)",
    "runner": "generate, or pooling: serve /v1/embeddings instead of completions (default: generate)",
    "task": "vLLM's older name for --runner: embed (pooling) or generate (default: none)",
    "disable_log_stats": "do not log the engine's statistics every few seconds (default: logged by the server)",
    "enable_lora": "serve LoRA adapters per request (--lora-modules) (default: off)",
    "max_loras": "adapters on the device at once, and most distinct adapters in a batch (default: 1)",
    "limit_mm_per_prompt": "vLLM's JSON: '{\"image\": 2}' allows at most 2 images a prompt (0 refuses images; default: no limit)",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' or '{\"model\": DRAFT_PATH, \"num_speculative_tokens\": 3}' (default: off)",
    "max_image_pixels": "most pixels (width x height) an image may have; larger ones get a 400 before they are "
                        "decoded (default: 67108864, 8192 x 8192)",
    "grammar_cache_bytes": "bytes of compiled structured-output grammars kept for reuse, least recently used "
                           "dropped first (default: 536870912, vLLM's 512 MB)",
    "max_lora_rank": "highest adapter rank accepted (default: 16)",
    "max_cpu_loras": "adapters cached in host memory (default: max_loras)",
    "batch_invariant": "a request's tokens and logprobs bitwise the same whatever runs beside it, after a "
                       "prefix-cache hit or not, however its prompt is chunked (docs/batch-invariant.md); also "
                       "NANOINFER_BATCH_INVARIANT=1 (default: off)",
}

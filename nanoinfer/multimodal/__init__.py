"""Images in prompts (vLLM's multimodal input API), for vision-language models (Qwen2.5-VL,
Qwen3-VL: models/qwen2_5_vl.py, models/qwen3_vl.py).

How an image travels:
- the engine and rank hooks (`feature.py`) that carry all of the below.
- intake (`processor.py`, through the intake hooks): each `<|image_pad|>` placeholder of
  the prompt is expanded to the image's token count, known from its size; then, in an intake thread
  (off the engine loop), the checkpoint's Hugging Face image processor turns each image into
  patches, the request's M-RoPE positions are computed (`mrope.py`) and each image gets a content
  hash. All of it rides on the Sequence as one `MultiModalInputs` (`inputs.py`).
- scheduling: the prefix cache keys a block by its tokens and the hashes of the images it covers
  (Sequence.block_keys), so two different images never share K/V.
- each step (`step_planner.py`, engine side): the rows' rotary positions, and which images the step's
  prompt chunks cover: the runner encodes an image once, when a chunk first reaches it, and keeps its
  embeddings (`encoder_cache.py`, runner side) until no running prefill still needs them.
- chat (`chat_parts.py`, `media.py`): OpenAI image content parts, and the rules on which URLs may
  be fetched.
"""

"""Multi-LoRA: PEFT adapters chosen per request, many adapters mixed in one batch (vLLM's
`enable_lora`, `LoRARequest`).

- request.py: LoRARequest, the public handle (name, int id, path).
- targets.py: which projections take adapters, their full shapes, and our fused layer for each.
- peft_adapter.py: reading and validating a PEFT directory.
- intake.py: the engine's check of a request's adapter (ValueError naming the tensor).
- slot_table.py: the engine's choice of device slot for each adapter of a step (LRU).
- admission.py: the scheduler's rule, never more distinct adapters running than slots.
- feature.py: the engine hooks (intake check, each step's slots) and the rank hook (loading slots).
- linear.py: the linear-layer weight method that adds x @ A^T @ B^T per row by slot.
- device_adapters.py: one rank's slots and its host cache of adapters (LRU, max_cpu_loras).

A step's rows carry their slot (-1: the base model) in the step message; the runner loads the
adapters a step needs into their slots before its forward; the slots of each token reach the layers
through the forward context. The prefix cache salts the hash chain with the adapter id."""
from nanoinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]

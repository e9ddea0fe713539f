"""The scheduler's LoRA rule: the running sequences use at most max_loras distinct adapters, so no
step needs more adapters than there are device slots. A waiting sequence whose adapter would be one
too many waits (in order) until the running ones of another adapter finish."""


def running_adapters(running) -> set[int]:
    return {seq.lora_int_id for seq in running if seq.lora_int_id}


def admits(adapters: set[int], seq, max_loras: int) -> bool:
    lora_id = seq.lora_int_id
    return not lora_id or lora_id in adapters or len(adapters) < max_loras

"""The scheduler's LoRA rule (its `admission`): the running sequences use at most max_loras distinct
adapters, so no step needs more adapters than there are device slots. A waiting sequence whose
adapter would be one too many waits (in order) until the running ones of another adapter finish."""


def running_adapters(running) -> set[int]:
    return {seq.lora_int_id for seq in running if seq.lora_int_id}


def admits(adapters: set[int], seq, max_loras: int) -> bool:
    lora_id = seq.lora_int_id
    return not lora_id or lora_id in adapters or len(adapters) < max_loras


class AdapterAdmission:
    """Asked by the scheduler while it admits waiting sequences into a step."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.adapters: set[int] = set()

    def start(self, running) -> None:
        self.adapters = running_adapters(running)

    def admits(self, seq) -> bool:
        return admits(self.adapters, seq, self.max_loras)

    def admitted(self, seq) -> None:
        if seq.lora_int_id:
            self.adapters.add(seq.lora_int_id)

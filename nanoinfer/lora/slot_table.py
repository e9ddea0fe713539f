"""The engine's placement of a step's adapters in the device slots: an adapter keeps its slot while
it is used, and a new one takes a free slot or the least recently used one that the step does not
need. The step message lists every adapter the step uses with its slot and path; a rank loads those
its slot does not hold yet (device_adapters.py), so a failed or skipped launch never leaves the
engine and the ranks disagreeing about a slot."""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


LORA = "lora"  # the key of a step's LoRAStep in StepInput.parts


@dataclass(slots=True)
class LoRAStep:
    """A step's adapters (nanoinfer/lora): each row's device slot (-1: the base model), and every
    adapter the step uses as (slot, lora_int_id, path), which a rank loads if its slot holds another."""
    row_slots: list[int]
    adapters: list[tuple[int, int, str]]


class AdapterSlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.free = list(range(num_slots - 1, -1, -1))

    def assign(self, seqs) -> LoRAStep | None:
        """The step's row slots (-1: the base model) and adapters, or None when no row uses one."""
        requests = {}
        for seq in seqs:
            if seq.lora_request is not None:
                requests.setdefault(seq.lora_request.lora_int_id, seq.lora_request)
        if not requests:
            return None
        if len(requests) > self.num_slots:  # the scheduler's admission rule keeps this from happening
            raise RuntimeError(f"a step uses {len(requests)} adapters but there are {self.num_slots} slots")
        for lora_id in requests:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id in requests:
            if lora_id not in self.slot_of:
                # (the step's adapters are the most recent: the oldest entry is not one of them)
                slot = self.free.pop() if self.free else self.slot_of.pop(next(iter(self.slot_of)))
                self.slot_of[lora_id] = slot
        row_slots = [-1 if s.lora_request is None else self.slot_of[s.lora_request.lora_int_id] for s in seqs]
        return LoRAStep(row_slots, [(self.slot_of[i], i, r.lora_path) for i, r in requests.items()])


def token_slots(step, adapters: LoRAStep) -> list[int] | np.ndarray:
    """Each token's adapter slot in a step with adapters: its row's."""
    slots = adapters.row_slots
    return slots if step.is_decode_only else np.repeat(slots, step.query_lens)

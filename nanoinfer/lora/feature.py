"""LoRA's engine hooks (step/feature.py): at intake, the request's adapter is checked against the
model (intake.py) and rides on its sequences; each step's message places its adapters in device
slots (slot_table.py). The scheduler's rule on distinct adapters is admission.py."""
from nanoinfer.step.feature import EngineFeature, Intake, RankFeature
from nanoinfer.lora.device_adapters import DeviceAdapters
from nanoinfer.lora.intake import LoRAIntake
from nanoinfer.lora.slot_table import LORA, AdapterSlotTable, token_slots


class LoRAFeature(EngineFeature):
    def __init__(self, config):
        self.intake = LoRAIntake(config)
        self.slots = AdapterSlotTable(config.max_loras) if config.enable_lora else None

    def prepare(self, intake: Intake) -> None:
        lora_request = self.intake.check(intake.extras.get("lora_request"))
        for seq in intake.seqs:
            seq.lora_request = lora_request

    def encode(self, batch, step, sample, sampling_seqs):
        if self.slots is not None:  # (embeddings too: a request's adapter shapes its hidden states)
            adapters = self.slots.assign(batch.seqs)
            if adapters is not None:
                step.add_part(LORA, adapters)


class LoRARankFeature(RankFeature):
    """A rank's adapter slots: a step's adapters are loaded into them before its forward, and each
    token's slot reaches the layers through the forward context (lora_slots; a captured graph reads
    it from a static buffer, -1 for the base model)."""
    graph_inputs = (("lora_slots", -1),)

    def __init__(self, runner):
        self.adapters = DeviceAdapters(runner.model, runner.config, runner.device)

    def before_forward(self, step) -> dict | None:
        adapters = step.part(LORA)
        if adapters is None:
            return None
        self.adapters.ensure(adapters.adapters)
        return {"lora_slots": token_slots(step, adapters)}

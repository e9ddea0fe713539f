"""The engine's adapter placement (lora/slot_table.py) and the scheduler's admission rule
(lora/admission.py), on plain sequences."""
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from nanoinfer.lora.admission import AdapterAdmission
from nanoinfer import LoRARequest, SamplingParams
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.step.sequence import Sequence
from nanoinfer.lora.slot_table import AdapterSlotTable


def seq(lora_id: int | None, prompt_len: int = 4) -> Sequence:
    s = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=2, ignore_eos=True), 16)
    if lora_id:
        s.lora_request = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
    return s


def test_rows_get_their_adapters_slots_and_the_base_none():
    table = AdapterSlotTable(2)
    step = table.assign([seq(None), seq(5), seq(7), seq(5)])
    slot5, slot7 = step.row_slots[1], step.row_slots[2]
    assert step.row_slots == [-1, slot5, slot7, slot5] and {slot5, slot7} == {0, 1}
    assert sorted(step.adapters) == sorted([(slot5, 5, "/adapters/5"), (slot7, 7, "/adapters/7")])
    assert table.assign([seq(None)]) is None


def test_a_new_adapter_takes_the_least_recently_used_slot_the_step_does_not_need():
    table = AdapterSlotTable(2)
    s1 = table.assign([seq(1)]).row_slots[0]
    s2 = table.assign([seq(2)]).row_slots[0]
    table.assign([seq(1)])  # 2 is now the least recently used
    step = table.assign([seq(1), seq(3)])
    assert step.row_slots == [s1, s2], "3 replaced 2, and 1 kept its slot"
    with pytest.raises(RuntimeError, match="3 adapters but there are 2 slots"):
        table.assign([seq(1), seq(2), seq(3)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5]), min_size=1, max_size=6), min_size=1, max_size=30),
       st.integers(1, 4))
def test_slots_never_collide_within_a_step(steps, num_slots):
    table = AdapterSlotTable(num_slots)
    for ids in steps:
        if len({i for i in ids if i}) > num_slots:
            continue
        step = table.assign([seq(i) for i in ids])
        if step is None:
            assert not any(ids)
            continue
        slot_of = {}
        for lora_id, slot in zip(ids, step.row_slots):
            assert (slot == -1) == (lora_id == 0) and slot < num_slots
            if lora_id:
                assert slot_of.setdefault(slot, lora_id) == lora_id, "two adapters in one slot"
        assert {(s, i) for s, i, _ in step.adapters} == {(s, i) for s, i in slot_of.items()}


def scheduler(max_loras: int, max_num_seqs: int = 8) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=64,
                             kvcache_block_size=16, enable_lora=True, max_loras=max_loras)
    return Scheduler(config, 64, frozenset({0}), admission=AdapterAdmission(max_loras))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3, 4]), min_size=1, max_size=12), st.integers(1, 3))
def test_running_sequences_never_use_more_adapters_than_slots(ids, max_loras):
    sched = scheduler(max_loras)
    seqs = [seq(i) for i in ids]
    for s in seqs:
        sched.add(s)
    done = 0
    for _ in range(200):
        batch = sched.schedule()
        if batch is None:
            break
        assert len({s.lora_int_id for s in sched.running} - {0}) <= max_loras
        assert len({s.lora_int_id for s in batch.seqs} - {0}) <= max_loras
        update = sched.update(batch, [5] * len(batch.seqs))
        done += len(sched.finish_rows(batch, update, {}))
    assert done == len(seqs) and sched.is_finished(), "every sequence ran to its end"

"""bench.py --enable-expert-parallel's report (nanoinfer/bench/expert_parallel.py) on CPU: two gloo
ranks time dispatch and combine for one layer of a tiny MoE shape, and the share is of the steps
given."""
import re
from types import SimpleNamespace

import torch

from nanoinfer.bench import expert_parallel
from nanoinfer.engine.step_record import StepRecord


def test_report_on_two_cpu_ranks(capsys):
    hf = SimpleNamespace(hidden_size=64, num_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
                         mlp_only_layers=[1], decoder_sparse_step=1)
    assert expert_parallel.num_moe_layers(hf) == 2
    steps = [StepRecord([(30, 30), (20, 20)], 0, 0, 0, 0, 0)] + [StepRecord([(1, 31), (1, 21)], 2, 0, 0, 0, 0)] * 4
    expert_parallel.report(hf, 2, [60, 40], steps, [0.05] * 5, torch.float32, cuda=False)
    out = capsys.readouterr().out
    assert "tokens routed to each rank's experts [60, 40]" in out and "busiest rank 1.20x the mean" in out
    decode = re.search(r"decode steps \(mean 2 tokens, 50.00 ms a step\): 2 MoE layers x \(dispatch ([\d.]+) us "
                       r"\+ combine ([\d.]+) us\) = ([\d.]+) ms, ([\d.]+)% of a step", out)
    assert decode, out
    dispatch, combine, total, share = map(float, decode.groups())
    assert abs(total - 2 * (dispatch + combine) / 1e3) < 0.01 and abs(share - total / 50 * 100) < 0.1
    assert "all steps (mean 12 tokens" in out

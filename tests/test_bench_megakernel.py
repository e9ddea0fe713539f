"""The persistent-kernel probe (nanoinfer/bench/megakernel.py) computes what the chain of GEMVs
computes, so that its timings compare like with like. GPU only: its programs meet at grid-wide
barriers, which the interpreter (one program after another) cannot run."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("rows, per_sm", [(4, 1), (8, 2), (16, 1)])
def test_the_persistent_chain_equals_the_gemv_chain(rows, per_sm):
    from nanoinfer.bench.megakernel import CHECK_PHASES, Chain, relative_difference
    chain = Chain("0.6b", layers=2)
    chain.run_chain(CHECK_PHASES)
    ref = chain.output(CHECK_PHASES).clone()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(2):  # the second launch finds the barrier counters reset by the first
        chain.act.zero_()
        chain.run_persistent(CHECK_PHASES, per_sm * sms, rows, 1024, 4)
        torch.cuda.synchronize()
        assert relative_difference(chain.output(CHECK_PHASES), ref) < 2e-2
        assert chain.bar.tolist() == [0, 0]

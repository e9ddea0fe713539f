"""--data-parallel-backend ray (data_parallel/ray_replica.py): two CPU replicas as Ray actors on a
local Ray cluster serve the offline greedy text, both of them; a killed actor (a lost node) is
restarted; nothing is left behind."""
import asyncio
import time

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.process.engine_client import EngineDeadError
from nanoinfer.serve.replicas import ReplicaSet
from test_server import wait_until

ray = pytest.importorskip("ray")  # the `ray` extra (in `test` too)

OPTIONS = dict(max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8, device="cpu")
PROMPTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache stores", "Once upon a time"]


@pytest.mark.slow
def test_two_ray_replicas_serve_the_offline_greedy_text(tiny_qwen3):
    reference = LLM(tiny_qwen3, **OPTIONS)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = [out["text"] for out in reference.generate(PROMPTS, greedy, use_tqdm=False)]
    reference.exit()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        replicas = ReplicaSet(tiny_qwen3, OPTIONS, "warning", 2, backend="ray")

        async def generate():
            subs = [await replicas.submit([p], greedy, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
            texts = []
            for sub in subs:
                async for _, event in sub.results():
                    if hasattr(event, "outputs"):
                        texts.append(event.outputs[0].text)
            return texts

        async def serve():
            replicas.start()
            try:
                first = await generate()
                ray.kill(replicas.replicas[0].client._actor)  # as when its node is lost
                deadline = time.monotonic() + 300
                while replicas.replica_stats()[0]["restarts"] == 0:  # the watcher restarts it
                    assert time.monotonic() < deadline, "the killed replica was not restarted"
                    await asyncio.sleep(0.1)  # poll interval
                return first, await generate()
            finally:
                replicas.stop()

        assert asyncio.run(serve()) == (want, want)
        assert [r["requests_finished"] for r in replicas.replica_stats()] == [4, 4]
        with pytest.raises(EngineDeadError):  # stopped
            asyncio.run(replicas.submit([PROMPTS[0]], greedy, stream=False))
        assert {pg["state"] for pg in ray.util.placement_group_table().values()} == {"REMOVED"}
        wait_until(lambda: ray.available_resources().get("CPU") == 2, what="the actors' CPUs to be free")
    finally:
        ray.shutdown()

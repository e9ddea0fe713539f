"""Data parallelism: several engines, each with its own process (and tensor-parallel group), serving
one model. `nanoinfer serve --data-parallel-size N` routes requests over them (serve/replicas.py,
serve/router.py), as local processes or as Ray actors on a cluster (ray_replica.py);
`LLM(model, data_parallel_size=N)` splits generate's prompts over them (llm.py)."""

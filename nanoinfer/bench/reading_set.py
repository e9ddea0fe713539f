"""The core reading set of one plain request: the files a newcomer reads following the imports from
`LLM` (nanoinfer/llm.py) and the one model it loads by name (Qwen3), not entering the features'
folders, kernels/, the other models or the test checkpoints; --tp1 also leaves out the modules only
tensor parallelism runs (the executor, its worker group and rank calls, the all-reduce layer: at
tp=1 none of their functions is called) and the MoE layer; --core keeps the core's folders only
(llm.py, engine/, step/, sampling/, the model, layers/), which issue 52's line budget counts.

    python -m nanoinfer.bench.reading_set [--tp1] [--core] [--files]
"""
import argparse
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = ["nanoinfer/llm.py", "nanoinfer/models/qwen3.py"]  # qwen3 is imported by name (models.MODELS)
FEATURE_DIRS = ("nanoinfer/lora/", "nanoinfer/speculative/", "nanoinfer/structured/", "nanoinfer/pooling/",
                "nanoinfer/multimodal/", "nanoinfer/quant/", "nanoinfer/priority/", "nanoinfer/metrics/",
                "nanoinfer/data_parallel/", "nanoinfer/serve/", "nanoinfer/process/", "nanoinfer/kernels/",
                "nanoinfer/bench/", "nanoinfer/prompt_logprobs/", "nanoinfer/sampling_options/",
                "nanoinfer/expert_parallel/", "nanoinfer/batch_invariant/")
OTHER_FILES = {"nanoinfer/features.py", "nanoinfer/models/llama.py", "nanoinfer/models/mixtral.py",
               "nanoinfer/models/qwen3_moe.py", "nanoinfer/models/qwen2_5_vl.py", "nanoinfer/models/qwen3_vl.py",
               "nanoinfer/models/qwen2_5_vision.py", "nanoinfer/models/qwen3_vl_vision.py",
               "nanoinfer/models/vl_rope.py", "nanoinfer/utils/tiny_model.py", "nanoinfer/utils/tiny_moe.py"}
TP_ONLY = {"nanoinfer/engine/tp_executor.py", "nanoinfer/engine/worker_group.py", "nanoinfer/engine/rank_calls.py",
           "nanoinfer/layers/all_reduce.py", "nanoinfer/layers/fused_moe.py"}
CORE = ("nanoinfer/llm.py", "nanoinfer/engine/", "nanoinfer/step/", "nanoinfer/sampling/", "nanoinfer/models/qwen3.py",
        "nanoinfer/layers/")


def module_file(module: str) -> str | None:
    path = module.replace(".", "/")
    if os.path.isdir(os.path.join(ROOT, path)):
        return path + "/__init__.py"
    return path + ".py" if os.path.exists(os.path.join(ROOT, path + ".py")) else None


def imported_files(path: str) -> list[str]:
    package = path[:-len("/__init__.py")] if path.endswith("/__init__.py") else os.path.dirname(path)
    parts = package.split("/")
    found = []
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):  # every import, in functions too
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            modules = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [p for m in modules if m.startswith("nanoinfer") and (p := module_file(m))]
    return found


def reading_set(tp1: bool, core: bool = False) -> list[str]:
    left_out = OTHER_FILES | (TP_ONLY if tp1 else set())
    seen, todo = set(), list(SEEDS)
    while todo:
        path = todo.pop()
        if path in seen or path.startswith(FEATURE_DIRS) or path in left_out:
            continue
        seen.add(path)
        todo += imported_files(path)
    return sorted(p for p in seen if not core or p.startswith(CORE))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp1", action="store_true", help="leave out the modules only tensor parallelism runs")
    p.add_argument("--core", action="store_true", help="only the files in the core's folders")
    p.add_argument("--files", action="store_true", help="list each file with its lines")
    args = p.parse_args()
    files = reading_set(args.tp1, args.core)
    total = 0
    for path in files:
        with open(os.path.join(ROOT, path)) as f:
            lines = sum(1 for _ in f)
        total += lines
        if args.files:
            print(f"{lines:6d}  {path}")
    print(f"{len(files)} files, {total} lines")


if __name__ == "__main__":
    main()

"""Generate from a model. With no --model, builds (once) and uses a tiny random-weight Qwen3
checkpoint with a locally trained tokenizer: it runs anywhere, offline, and prints gibberish."""
import argparse
import os

from nanoinfer import LLM, SamplingParams


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: built-in tiny model)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    if args.model:
        path = os.path.expanduser(args.model)
    else:
        from nanoinfer.utils.tiny_model import default_tiny_model_dir
        # flushed before the progress bars (stderr) of building it on first use and of generating
        print("No --model given: using the built-in tiny random-weight Qwen3 (built on first use).\n"
              "Its weights are random, so the text below is gibberish; pass --model for a real model.", flush=True)
        path = default_tiny_model_dir()
        print(f"The tiny model: {path}\n", flush=True)

    llm = LLM(path, tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
              max_model_len=min(4096, 1024 + args.max_tokens))
    sampling_params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    if llm.tokenizer.chat_template:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        print("\n")
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")
    llm.exit()


if __name__ == "__main__":
    main()

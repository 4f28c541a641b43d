"""Check an exported checkpoint the way its users will load it: plugserve's engine serves it (its block-FP8 path,
the NextN layer included) and transformers loads it with its weights dequantized; both generate greedily from a
fixed prompt set and the report says where they agree.

    python -m training.verify MODEL_DIR [--device cpu] [--max-new-tokens 32] [--report verify.json]

transformers' own FP8 loader (FineGrainedFP8Config(dequantize=True)) needs accelerate; the dequantized copy is
written here with plugserve's dequantize_block_fp8 instead, into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plugserve.core.layers.quant import dequantize_block_fp8

# Prompts on the corpus' topics: plain text to continue, and chat turns (rendered with the chat template).
PLAIN_PROMPTS = (
    "The for statement in Python",
    "A decorator is",
    "Django's session framework",
    "To create a virtual environment,",
)
CHAT_PROMPTS = (
    "What is a list comprehension?",
    "Explain Django middleware.",
    "Tell me about the datetime module.",
    "How do I read a file line by line?",
)
SCALE_SUFFIX = "_scale_inv"


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint `src` with every block-FP8 weight dequantized to float32 and no quantization_config."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: t for path in sorted(src.glob("*.safetensors")) for name, t in load_file(path).items()}
    save_file({name: dequantize_block_fp8(t, tensors[name + SCALE_SUFFIX], block) if name + SCALE_SUFFIX in tensors
               else t.float() for name, t in tensors.items() if not name.endswith(SCALE_SUFFIX)},
              dst / "model.safetensors")
    return dst


def prompt_ids(model_dir: Path) -> list[list[int]]:
    """Token ids of the prompt set, as the engine tokenizes text prompts and chat requests."""
    from plugserve.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for p in CHAT_PROMPTS]
    return [tokenizer.encode(p) for p in PLAIN_PROMPTS] + [list(ids) for ids in chats]


def plugserve_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: str
                     ) -> list[list[int]]:
    """Greedy continuations [len(prompts)][max_new_tokens] from plugserve's engine (EOS ignored)."""
    from benchmarks.accuracy import greedy_continuations
    from plugserve.core.server_args import ServerArgs

    return greedy_continuations(ServerArgs(model_path=str(model_dir), device=device, log_level="warning"), prompts,
                                max_new_tokens)


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: str
                        ) -> list[list[int]]:
    """Greedy continuations from transformers' DeepseekV3ForCausalLM on the dequantized weights (float32)."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(dequantized_copy(model_dir, Path(tmp)), dtype=torch.float32)
    model = model.to(device).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def verify(model_dir: Path, max_new_tokens: int = 32, device: str = "cpu") -> dict:
    """Both loaders' greedy outputs on the prompt set, their texts, and the share of positions where they agree."""
    from plugserve.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = prompt_ids(model_dir)
    ours = plugserve_greedy(model_dir, prompts, max_new_tokens, device)
    theirs = transformers_greedy(model_dir, prompts, max_new_tokens, device)
    samples = []
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        samples.append({"prompt": tokenizer.decode(prompt), "plugserve": tokenizer.decode(a),
                        "transformers": tokenizer.decode(b), "identical_prefix": same})
    agreed = sum(s["identical_prefix"] for s in samples)
    return {"max_new_tokens": max_new_tokens, "greedy_prefix_agreement": agreed / (len(samples) * max_new_tokens),
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--report", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    report = verify(args.model_dir, args.max_new_tokens, args.device)
    for sample in report["samples"]:
        print(f"--- {sample['prompt']!r} (same for {sample['identical_prefix']} tokens)\n"
              f"plugserve:    {sample['plugserve']!r}\ntransformers: {sample['transformers']!r}")
    print(f"greedy tokens agreeing from the start: {report['greedy_prefix_agreement']:.1%}")
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

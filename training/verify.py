"""Check an exported checkpoint the way its users will load it, on a fixed prompt set, greedily:

- parity: transformers and plugserve (torch reference backends, float32) on the weights dequantized, the same math
  on both sides, must agree token for token;
- as served: plugserve's engine on the checkpoint itself (its block-FP8 path, activations quantized per 128-group
  as DeepSeek's inference does, the NextN layer loaded), against the dequantized run. Activation rounding moves
  logits a little and a greedy choice between near-equal tokens can flip, so this share is reported, not required;
  perplexity (benchmarks/accuracy.py) is the measure of what FP8 costs.

    python -m training.verify MODEL_DIR [--device cpu] [--max-new-tokens 32] [--report verify.json]

transformers' own FP8 loader (FineGrainedFP8Config(dequantize=True)) needs accelerate; the dequantized copy is
written here with plugserve's dequantize_block_fp8 instead, into a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plugserve.core.layers.quant import dequantize_block_fp8
from plugserve.core.tokenizer import TOKENIZER_FILES

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
# ServerArgs of the torch reference backends in float32: the same math as transformers' on the dequantized weights
# (which have no block-FP8 GEMM to name a backend for).
REFERENCE_FLAGS = {"attention_backend": "torch_ref", "moe_runner_backend": "torch_ref", "dtype": "float32"}


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint `src` with every block-FP8 weight dequantized to float32 and no quantization_config, and its
    tokenizer."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
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


def plugserve_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: str,
                     reference: bool = False) -> list[list[int]]:
    """Greedy continuations [len(prompts)][max_new_tokens] from plugserve's engine (EOS ignored): as served
    (auto backends and dtype), or with `reference` the torch reference backends in float32."""
    from plugserve.runtime.engine import Engine
    from plugserve.runtime.sampling import SamplingParams
    from plugserve.runtime.server_args import ServerArgs

    flags = REFERENCE_FLAGS if reference else {}
    engine = Engine(ServerArgs(model_path=str(model_dir), device=device, log_level="warning", **flags))
    try:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                                                          ignore_eos=True))
    finally:
        engine.shutdown()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"plugserve failed to generate: {errors[0]}")
    return [r.token_ids for r in results]


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: str
                        ) -> list[list[int]]:
    """Greedy continuations from transformers' DeepseekV3ForCausalLM on an unquantized checkpoint (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            # An explicit mask: with no mask generate infers one from pad_token_id, and a pad id equal to bos (0 here,
            # as in DeepSeek-V3) would mask the prompt's bos out.
            inputs = torch.tensor([ids], device=device)
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=model.config.eos_token_id)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def prefix_agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """The share of `reference`'s tokens that `ours` matches from the start of each continuation, before the first
    difference."""
    same = total = 0
    for a, b in zip(ours, reference, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        total += len(b)
    return same / total


def verify(model_dir: Path, max_new_tokens: int = 32, device: str = "cpu") -> dict:
    """Greedy outputs on the prompt set of transformers and plugserve on the dequantized weights, and of plugserve
    serving the checkpoint; their texts, and the shares of tokens that agree from the start of each continuation."""
    from plugserve.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prompts = prompt_ids(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        dequantized = dequantized_copy(model_dir, Path(tmp))
        theirs = transformers_greedy(dequantized, prompts, max_new_tokens, device)
        ours = plugserve_greedy(dequantized, prompts, max_new_tokens, device, reference=True)
    served = plugserve_greedy(model_dir, prompts, max_new_tokens, device)
    samples = [{"prompt": tokenizer.decode(p), "transformers": tokenizer.decode(t), "plugserve": tokenizer.decode(o),
                "served": tokenizer.decode(s)} for p, t, o, s in zip(prompts, theirs, ours, served, strict=True)]
    return {"max_new_tokens": max_new_tokens, "hf_parity": prefix_agreement(ours, theirs),
            "served_vs_dequantized": prefix_agreement(served, ours), "samples": samples}


def print_report(report: dict) -> None:
    for sample in report["samples"]:
        print(f"--- {sample['prompt']!r}\ntransformers: {sample['transformers']!r}\n"
              f"plugserve:    {sample['plugserve']!r}\nserved:       {sample['served']!r}")
    print(f"greedy tokens agreeing from the start of each continuation: transformers and plugserve on the dequantized "
          f"weights {report['hf_parity']:.1%}; plugserve serving the block-FP8 checkpoint against them "
          f"{report['served_vs_dequantized']:.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--report", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    report = verify(args.model_dir, args.max_new_tokens, args.device)
    print_report(report)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

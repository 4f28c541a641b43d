"""Train the model of training/model.py on the corpus of training/prepare_data.py, then export it in DeepSeek-V3's
block-FP8 format (training/export.py) and check the export (training/verify.py).

    python -m training.train --out OUT                      # GPU: bf16 autocast, ~4 minutes on one H100
    python -m training.train --out OUT --device cpu --steps 3 --batch-size 2 --seq-len 64   # a smoke test

Writes into OUT: losses.json (every logged training step, every evaluation, the run's settings, sizes and timing,
and with --verify the check of training/verify.py), loss_curve.png and model/ (the checkpoint).

The run ends at --steps (default: --epochs over the training split) or when --time-budget seconds of training
have passed, whichever comes first; the learning rate follows its schedule over that progress either way. The
held-out split is evaluated --evals times; the weights of the best evaluation are the ones exported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from training.export import export
from training.model import Losses, TrainingModel, model_config, parameter_counts

DEFAULT_DATA = Path(__file__).resolve().parent.parent / ".carry" / "training"
LOG_EVERY = 10  # steps between logged losses (reading them back from the GPU waits for it)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="prepare_data's output (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto", help="auto: cuda when there is one, else cpu")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=float, default=6.0, help="passes over the training split, sets --steps")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--time-budget", type=float, default=0.0, help="seconds of training at most (0: no limit)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, of --lr")
    parser.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of DeepSeek-V3's MTP loss")
    parser.add_argument("--balance-alpha", type=float, default=1e-4, help="weight of the sequence-wise balance loss")
    # DeepSeek-V3's gamma is 1e-3 over ~10^5 steps. Here, while the model is near its unigram stage, every token's
    # router input points the same way and each router sends all tokens to one expert; the biases must then move by
    # tenths within the run's ~1300 steps (at 1e-3 they had moved 0.06 after 60 steps, all routers still collapsed;
    # at 1e-2 every router was balanced again by step 110 of a small CPU run).
    parser.add_argument("--bias-rate", type=float, default=1e-2, help="gamma of the routers' bias updates")
    parser.add_argument("--evals", type=int, default=16, help="evaluations of the held-out split over the run")
    parser.add_argument("--eval-windows", type=int, default=256, help="held-out windows per evaluation at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="load the export with plugserve and transformers")
    parser.add_argument("--verify-device", default="cpu")
    return parser.parse_args(argv)


def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    """A token file of prepare_data (uint16) -> [N] int64 on `device`."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64)).to(device)


def random_windows(tokens: torch.Tensor, batch: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, width] int64: windows of `tokens` at random offsets."""
    starts = torch.randint(0, tokens.numel() - width, (batch, 1), device=tokens.device, generator=generator)
    return tokens[starts + torch.arange(width, device=tokens.device)]


def learning_rate(args: argparse.Namespace, step: int, progress: float) -> float:
    """Linear warm-up over --warmup steps, then a cosine from --lr to --lr * --min-lr-ratio over `progress` [0, 1]."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * min(1.0, (step + 1) / args.warmup) * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=next(model.parameters()).is_cuda)


@torch.no_grad()
def evaluate(model: TrainingModel, windows: torch.Tensor, batch: int, device: torch.device) -> dict[str, float]:
    """Mean losses over held-out windows [n, T + 2]: cross entropy (and perplexity) of the main model and of the
    MTP module, and the MTP's agreement with the main model's greedy choice."""
    model.eval()
    totals = torch.zeros(3, device=device)
    for chunk in windows.split(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses: Losses = model(chunk)
        totals += torch.stack([losses.main, losses.mtp, losses.mtp_agreement]) * len(chunk)
    model.train()
    main, mtp, agreement = (totals / len(windows)).tolist()
    return {"main": main, "mtp": mtp, "perplexity": math.exp(main), "mtp_perplexity": math.exp(mtp),
            "mtp_agreement": agreement}


def plot(history: dict, unigram_perplexity: float | None, path: Path) -> None:
    """Loss curve: training losses (main and MTP) and held-out evaluations against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    train, evals = history["train"], history["eval"]
    tokens = [r["tokens"] / 1e6 for r in train]
    ax.plot(tokens, [r["main"] for r in train], lw=1, alpha=0.7, label="train: next token")
    ax.plot(tokens, [r["mtp"] for r in train], lw=1, alpha=0.7, label="train: MTP (token after next)")
    ax.plot([r["tokens"] / 1e6 for r in evals], [r["main"] for r in evals], "o-", label="held-out: next token")
    ax.plot([r["tokens"] / 1e6 for r in evals], [r["mtp"] for r in evals], "s-", label="held-out: MTP")
    if unigram_perplexity:
        ax.axhline(math.log(unigram_perplexity), color="gray", ls="--", label="unigram baseline (held-out)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross entropy (nats)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(history["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    corpus = json.loads((args.data / "corpus.json").read_text())
    train_tokens = load_tokens(args.data / "train.bin", device)
    width = args.seq_len + 2  # inputs, plus the next token and the one after for the two losses
    val = load_tokens(args.data / "val.bin", device)
    val_windows = val[: val.numel() // width * width].view(-1, width)[: args.eval_windows]
    if not len(val_windows):
        raise ValueError(f"the held-out split ({val.numel()} tokens) is shorter than one window of {width}")

    model = TrainingModel(model_config(corpus["vocab_size"], args.seq_len), args.mtp_weight, args.balance_alpha)
    model.to(device).train()
    counts = parameter_counts(model)
    tokens_per_step = args.batch_size * args.seq_len
    steps = args.steps or max(1, round(args.epochs * train_tokens.numel() / tokens_per_step))
    eval_every = max(1, steps // args.evals)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
          f"parameters {counts}; {train_tokens.numel():,} training tokens; {steps} steps of {tokens_per_step:,} "
          f"tokens; time budget {args.time_budget or 'none'} s", flush=True)

    opt = optimizer(model, args)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    history: dict = {"train": [], "eval": []}
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    train_started = time.perf_counter()
    bar = tqdm(range(steps), desc="training", unit="step", dynamic_ncols=True, mininterval=5.0)
    steps_done = 0
    for step in bar:
        elapsed = time.perf_counter() - train_started
        progress = max(step / steps, elapsed / args.time_budget if args.time_budget else 0.0)
        if progress >= 1:
            break
        lr = learning_rate(args, step, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses = model(random_windows(train_tokens, args.batch_size, width, generator))
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        load = model.update_routing_bias(args.bias_rate)
        steps_done, tokens = step + 1, (step + 1) * tokens_per_step
        if step % LOG_EVERY == 0 or step == steps - 1:
            row = {"step": step + 1, "tokens": tokens, "lr": lr, "seconds": round(elapsed, 2),
                   "loss": losses.total.item(), "main": losses.main.item(), "mtp": losses.mtp.item(),
                   "balance": losses.balance.item(), "mtp_agreement": losses.mtp_agreement.item(),
                   "max_load": load.max().item()}
            history["train"].append(row)
            bar.set_postfix(loss=f"{row['main']:.3f}", mtp=f"{row['mtp']:.3f}", lr=f"{lr:.1e}",
                            tok_s=f"{tokens / max(elapsed, 1e-9):,.0f}")
        if (step + 1) % eval_every == 0 or step == steps - 1:
            result = evaluate(model, val_windows, args.batch_size, device) | {"step": step + 1, "tokens": tokens}
            history["eval"].append(result)
            tqdm.write(f"step {step + 1}: held-out loss {result['main']:.3f} (perplexity {result['perplexity']:.1f}),"
                       f" MTP {result['mtp']:.3f}, MTP agrees with greedy {result['mtp_agreement']:.1%}")
            if best is None or result["main"] < best[0]:
                best = (result["main"], {k: v.detach().clone() for k, v in model.state_dict().items()})
    bar.close()
    train_seconds = time.perf_counter() - train_started
    if not history["eval"] or history["eval"][-1]["step"] != steps_done:  # stopped by the time budget
        history["eval"].append(evaluate(model, val_windows, args.batch_size, device)
                               | {"step": steps_done, "tokens": steps_done * tokens_per_step})
        if best is None or history["eval"][-1]["main"] < best[0]:
            best = None
    if best is not None:
        model.load_state_dict(best[1])
    chosen = min(history["eval"], key=lambda r: r["main"])

    args.out.mkdir(parents=True, exist_ok=True)
    sizes = export(model, args.data / "tokenizer", args.out / "model")
    history |= {
        "title": f"DeepSeek-V3 structure, {counts['total'] / 1e6:.1f} M parameters, {steps_done} steps",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "parameters": counts, "corpus": corpus, "steps": steps_done,
        "epochs": steps_done * tokens_per_step / train_tokens.numel(),
        "train_seconds": round(train_seconds, 1), "chosen_eval": chosen, "export_bytes": sizes,
        "unigram_perplexity_heldout": corpus.get("unigram_perplexity_heldout"),
    }
    plot(history, history["unigram_perplexity_heldout"], args.out / "loss_curve.png")
    history["total_seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "losses.json").write_text(json.dumps(history, indent=1) + "\n")
    print(f"exported step {chosen['step']}: held-out perplexity {chosen['perplexity']:.2f} (unigram baseline "
          f"{history['unigram_perplexity_heldout']:.1f}), MTP agreement {chosen['mtp_agreement']:.1%}; "
          f"{sum(sizes.values()) / 1e6:.1f} MB in {args.out / 'model'}; {train_seconds:.0f} s of training",
          flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    if args.verify:
        from training.verify import print_report, verify

        history["verify"] = verify(args.out / "model", device=args.verify_device)
        (args.out / "losses.json").write_text(json.dumps(history, indent=1) + "\n")
        print_report(history["verify"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

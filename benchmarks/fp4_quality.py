"""fp4 weights' accuracy at model level (issue 18): a small GPT trained here in 16 bits, evaluated as it is and
with the fp4 pass, perplexity on held-out sequences and top-1 agreement of next-token predictions.

    python -m benchmarks.fp4_quality --out DIR                       (CUDA: bf16, the fp8 loss curve's GPT)
    python -m benchmarks.fp4_quality --device cpu --tiny --steps 30  (CPU: TRITON_INTERPRET=1 is set here, so the
                                                                     fp4 kernel runs in Triton's interpreter)

The model, task and training are benchmarks/fp8_loss_curve.py's (its ``bf16`` run: 4 layers, 512 wide, the
order-2 Markov task, 200 steps; --tiny: its small model). On the CPU it trains in float32 and is evaluated in
float16 (fp4 takes 16-bit layers; the interpreter's bf16 dot is unreliable). Then, under no_grad, on the
evaluation sequences (the task's, never trained on):
  - the 16-bit model compiled with default options: the reference;
  - the same model compiled with ``{"fp4": {"decide": "always", "format": F}}`` for F in --formats
    (``min_features`` lowered to the model's width with --tiny).
Per row: cross-entropy (nats) and perplexity (its exp), the difference from the reference, top-1 agreement
(the share of positions where the argmax of the logits is the reference's), the task's loss floor (the
Bayes-optimal cross-entropy), and from the fp4 pass's record the layers rewritten, their SQNR (dB) and any
backed out. Writes DIR/fp4_quality.json and .md (card, date, commit, command).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys

if "--device" in sys.argv and "cpu" in sys.argv:  # before triton is imported: the kernel's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from . import fp8_loss_curve as lc  # noqa: E402


def evaluate(model, options: dict, data: torch.Tensor, batch: int, vocab: int, device: str):
    """(mean cross-entropy, the argmax per position, the fp4 pass's record or None)."""
    import kpt_compiler

    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    if device == "cpu":
        options = {"codegen": "eager", **options}
    compiled = torch.compile(model, backend="kernelpytorch", dynamic=False, options=options)
    losses, top = [], []
    with torch.no_grad():
        for i in range(0, data.shape[0], batch):
            chunk = data[i:i + batch].to(device)
            logits = compiled(chunk[:, :-1]).float()
            losses.append(F.cross_entropy(logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1)).item())
            top.append(logits.argmax(-1).cpu())
    records = [p for r in kpt_compiler.reports() for p in r.passes() if p.name == "fp4"]
    return sum(losses) / len(losses), torch.cat(top), records[-1] if records else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp4_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--formats", default="nvfp4,mxfp4")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--task-seed", type=int, default=0)
    args = p.parse_args(argv)
    from kpt_compiler.bench import git_commit

    cfg = lc.TINY if args.tiny else lc.FULL
    vocab, T, B = cfg["model"]["vocab_size"], cfg["model"]["block_size"], cfg["batch"]
    task = lc.MarkovTask(vocab, args.task_seed)
    eval_data = task.sample(cfg["eval_batches"] * B, T + 1, seed=args.task_seed + 10_000)
    train_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    trained: list = []
    run = lc.train_run("bf16", lc.BASE_SEED, {}, cfg=cfg, steps=args.steps, eval_every=args.steps,
                       device=args.device, dtype=train_dtype, task=task, eval_data=eval_data, trained=trained)
    model = trained[0].eval().to(torch.bfloat16 if args.device == "cuda" else torch.float16)
    ref_loss, ref_top, _ = evaluate(model, {}, eval_data, B, vocab, args.device)
    rows = [{"run": "16-bit", "loss": ref_loss, "perplexity": math.exp(ref_loss), "top1_agreement": 1.0}]
    for f in [f for f in args.formats.split(",") if f]:
        fp4 = {"decide": "always", "format": f, **({"min_features": 32} if args.tiny else {})}
        loss, top, rec = evaluate(model, {"fp4": fp4}, eval_data, B, vocab, args.device)
        rows.append({"run": f"fp4 {f}", "loss": loss, "perplexity": math.exp(loss),
                     "top1_agreement": (top == ref_top).float().mean().item(),
                     "layers": rec.matches if rec else 0, "layer_db": dict(rec.layer_db) if rec else {},
                     "backed_out": dict(rec.backed_out) if rec else {}})
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    command = shlex.join(["python", "-m", "benchmarks.fp4_quality", *argv])
    floor = task.floor(eval_data)
    lines = [f"# fp4 weights at model level on {card}", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; torch {torch.__version__}",
             f"- command: `{command}`",
             f"- model: the fp8 loss curve's GPT {cfg['model']}, trained {args.steps} steps (final train loss "
             f"{run.get('final_train_loss')}); evaluated in {str(model.lm_head.weight.dtype).replace('torch.', '')}"
             f" on {eval_data.shape[0]} held-out sequences; the task's loss floor {floor:.4f}", "",
             "| run | loss (nats) | perplexity | vs 16-bit | top-1 agreement | fp4 layers | layer SQNR dB (min, "
             "median) | backed out |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        dbs = sorted(r.get("layer_db", {}).values())
        lines.append(f"| {r['run']} | {r['loss']:.4f} | {r['perplexity']:.3f} | {r['loss'] - ref_loss:+.4f} | "
                     f"{100 * r['top1_agreement']:.2f}% | {r.get('layers', '-')} | "
                     + (f"{dbs[0]:.1f}, {dbs[len(dbs) // 2]:.1f}" if dbs else "-") + f" | "
                     f"{len(r.get('backed_out', {})) if 'backed_out' in r else '-'} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        import json

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp4_quality.json"), "w") as fh:
            json.dump({"card": card, "date": str(datetime.date.today()), "commit": git_commit(),
                       "command": command, "config": cfg, "steps": args.steps, "floor": floor, "rows": rows}, fh,
                      indent=1)
        with open(os.path.join(args.out, "fp4_quality.md"), "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

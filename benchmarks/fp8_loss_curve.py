"""fp8 training accuracy: a small GPT trained in bf16 and in fp8 on one synthetic task, the loss curves side by side.

    python -m benchmarks.fp8_loss_curve --out DIR           (CUDA with fp8: compute capability 8.9 or newer)
    python -m benchmarks.fp8_loss_curve --plot DIR/fp8_loss_curve.json     (the PNG from a run's JSON)
    python -m benchmarks.fp8_loss_curve --device cpu --tiny --steps 20 --out DIR    (a small check on the CPU)

The model is the project's own GPT (kpt_compiler/models/gpt.py; 4 layers, 512 wide, 8 heads, a 512-token
vocabulary, 256 positions: every linear's dimensions are multiples of 16, so the fp8 pass can take all 17,
the tied lm_head included), parameters in bf16, GPT-2's initialisation, AdamW (lr 1e-3, betas 0.9/0.95,
weight decay 0.1, linear warm-up over the first tenth, cosine decay to a tenth), gradients clipped at 1,
batch 32 x 256 tokens, 200 steps. Each run starts from ``torch._dynamo.reset()`` and compiles the model with
``torch.compile(model, backend="kernelpytorch", dynamic=False, options=...)``; the loss (cross-entropy in
float32) is computed outside the compiled model.

The task: a sparse order-2 Markov chain over the vocabulary, drawn from ``--task-seed`` (the same for every
run). Each token b has 8 possible successors; their probabilities (Dirichlet(0.5)) depend on b and on which
of 4 groups the token before b falls in. A model learns the successor sets first (the loss falls from
ln 512 = 6.24 towards the order-1 entropy), then the dependence on the earlier token, down to the chain's
conditional entropy: the loss floor, computed exactly for the evaluation batches (their Bayes-optimal
cross-entropy) and drawn as a dashed line. The sequences are sampled on the CPU from a seeded generator (the
same data on any device), the training stream from the run's seed, the evaluation batches (4 x 32 x 256
tokens, the same for every run) from the task seed.

Runs (``--runs``; all by default):
  - ``bf16``: default options, seed 1;
  - ``bf16-seed2``, ``bf16-seed3`` (``--noise-seeds``, default 2): the same with another seed for the
    initialisation and the training data, which measures the run-to-run noise;
  - ``fp8``: ``{"fp8": {"decide": "always"}}`` (tensorwise scaling), seed 1: the same initial weights and
    data as ``bf16``. ``decide="always"`` because the cost model declines fp8 at these small shapes; the
    question here is accuracy, not speed;
  - ``fp8-rowwise``: ``{"fp8": {"granularity": "rowwise", "decide": "always"}}``, seed 1.
Per run: the training loss of every step, the evaluation loss every ``--eval-every`` steps (and before the
first), the final loss (mean training loss of the last 10 steps; the last evaluation loss), wall time, the
first call's time (the compile), the median step, and from ``kpt_compiler.reports()`` the passes that fired and the fp8 pass's record
(layers rewritten, its SQNR against the unmodified graph, layers the lossy guard backed out), which shows
that fp8 did run. The evaluation runs the training graph's forward (no backward): no second compile.

Writes DIR/fp8_loss_curve.json, DIR/fp8_loss_curve.md (final losses, the bf16 spread: the largest difference
between two bf16 seeds, and each fp8 run's difference from ``bf16`` against it) and, where matplotlib is
installed, DIR/fp8_loss_curve.png (``--plot`` makes it later from the JSON). On the CPU (``--device cpu``) the
code is generated eagerly (``codegen="eager"``; ``torch._scaled_mm`` runs there in recent torch); ``--tiny``
shrinks model, task and batch for a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fp8_loss_curve_report import FINAL_STEPS, NAME, markdown, plot, summarize

RUN_OPTIONS: dict[str, dict] = {
    "bf16": {},
    "fp8": {"fp8": {"decide": "always"}},
    "fp8-rowwise": {"fp8": {"granularity": "rowwise", "decide": "always"}},
}
BASE_SEED = 1
FULL = {"model": {"vocab_size": 512, "block_size": 256, "n_layer": 4, "n_head": 8, "n_embd": 512},
        "batch": 32, "lr": 1e-3, "eval_batches": 4}
TINY = {"model": {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64},
        "batch": 8, "lr": 3e-3, "eval_batches": 2}
SUCCESSORS, GROUPS, ALPHA = 8, 4, 0.5  # the task: successors per token, groups of the token before, Dirichlet
# (ALPHA is fixed at 0.5 by the way MarkovTask draws the rows)


# ----------------------------------------------------------------------------------------------------- task
class MarkovTask:
    """A sparse order-2 Markov chain over ``vocab`` tokens: P(c | a, b) is non-zero for the 8 successors of b
    only, with probabilities that depend on b and on the group of a (one of 4)."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        k = min(SUCCESSORS, vocab)
        self.succ = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(vocab)])  # [V, k]
        self.group = torch.randint(0, GROUPS, (vocab,), generator=g)  # [V]
        # Dirichlet(0.5) rows: normalised Gamma(0.5) draws, and Gamma(0.5) is Z^2 / 2 for a standard normal Z
        gamma = torch.randn(GROUPS * vocab, k, generator=g, dtype=torch.float64).square()
        self.probs = gamma / gamma.sum(-1, keepdim=True)  # [G*V, k], row = group(a) * V + b
        self.cdf = self.probs.cumsum(-1)
        self.row_entropy = -(self.probs * self.probs.clamp_min(1e-300).log()).sum(-1)  # nats

    def sample(self, n: int, length: int, seed: int) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens (int64, CPU): the first two uniform, then the chain."""
        g = torch.Generator().manual_seed(seed)
        x = torch.empty(n, length, dtype=torch.long)
        x[:, :2] = torch.randint(0, self.vocab, (n, 2), generator=g)
        u = torch.rand(n, length, generator=g, dtype=torch.float64)
        k = self.succ.shape[1]
        for t in range(2, length):
            rows = self.group[x[:, t - 2]] * self.vocab + x[:, t - 1]
            j = (u[:, t:t + 1] > self.cdf[rows]).sum(-1).clamp_max(k - 1)
            x[:, t] = self.succ[x[:, t - 1], j]
        return x

    def floor(self, x: torch.Tensor) -> float:
        """The Bayes-optimal cross-entropy of predicting x[:, 1:] from the tokens before (nats): ln V for the
        second token (independent of the first), the row's entropy for each later one."""
        rows = self.group[x[:, :-2]] * self.vocab + x[:, 1:-1]
        per_seq = math.log(self.vocab) + self.row_entropy[rows].sum(-1)
        return (per_seq / (x.shape[1] - 1)).mean().item()

    def order1_entropy(self) -> float:
        """H(c | b) once the group of a is not known (groups taken as equally likely): the plateau a model
        reaches when it has learned the successor sets but not yet the dependence on a."""
        p = self.probs.view(GROUPS, self.vocab, -1).mean(0)
        return (-(p * p.clamp_min(1e-300).log()).sum(-1)).mean().item()


# ---------------------------------------------------------------------------------------------------- model
def _init_weights(model: nn.Module, n_layer: int, seed: int) -> None:
    """GPT-2's initialisation (normal 0.02, residual projections scaled by 1/sqrt(2 n_layer), zero biases):
    the module's defaults give the tied lm_head logits of standard deviation sqrt(n_embd)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 2:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _fp8_summary(reports: list) -> dict[str, Any]:
    """What the compiler did over a run's graphs: the passes that fired, and the fp8 pass's record per graph."""
    fired: list[str] = []
    graphs = []
    for r in reports:
        fired += [p for p in r.fired() if p not in fired]
        entry: dict[str, Any] = {"index": r.index, "codegen": r.codegen, "fired": r.fired()}
        try:
            rec = r.pass_record("fp8")
        except KeyError:
            rec = None
        if rec is not None:
            s = rec.summary()
            entry["fp8"] = {k: s[k] for k in ("status", "matches", "reason", "error_db", "error_bound_db",
                                             "backed_out", "layer_db") if k in s}
            entry["fp8"]["notes"] = s.get("notes", [])[:40]
        graphs.append(entry)
    fp8 = [g["fp8"] for g in graphs if "fp8" in g]
    return {"graphs": len(reports), "fired": fired, "fp8_fired": "fp8" in fired,
            "fp8_matches": max((f["matches"] for f in fp8 if f["status"] == "applied"), default=0),
            "fp8_backed_out": sorted({k for f in fp8 for k in f.get("backed_out") or {}}),
            "per_graph": graphs}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no NaN


def train_run(name: str, seed: int, options: dict, *, cfg: dict, steps: int, eval_every: int, device: str,
              dtype: torch.dtype, task: MarkovTask, eval_data: torch.Tensor,
              trained: list | None = None) -> dict[str, Any]:
    """One training run from a fresh compile: losses, times and what the compiler did (and the trained model
    appended to ``trained`` where given: benchmarks/fp4_quality.py evaluates it)."""
    import kpt_compiler
    from kpt_compiler.models.gpt import GPT, GPTConfig

    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    mcfg = GPTConfig(**cfg["model"])
    T, B = mcfg.block_size, cfg["batch"]
    model = GPT(mcfg)
    _init_weights(model, mcfg.n_layer, seed)
    model = model.to(device=device, dtype=dtype)
    if device == "cpu":
        options = {"codegen": "eager", **options}
    compiled = torch.compile(model, backend="kernelpytorch", dynamic=False, options=options)
    fused = {"fused": True} if device == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1, **fused)
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:  # step counts from 0
        if step < warmup:
            return cfg["lr"] * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    data = task.sample(steps * B, T + 1, seed=1000 + seed).to(device)
    eval_dev = eval_data.to(device)
    V = mcfg.vocab_size

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        logits = compiled(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, V), batch[:, 1:].reshape(-1))

    def evaluate() -> float:
        # the training graph's forward (grad mode on, no backward): no second compile for an inference graph
        total = 0.0
        for i in range(0, eval_dev.shape[0], B):
            total += loss_of(eval_dev[i:i + B]).detach().item()
        return total / (eval_dev.shape[0] // B)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    train_losses: list[float] = []
    step_times: list[float] = []
    sync()
    start = time.perf_counter()
    evals: list[tuple[int, float]] = [(0, evaluate())]  # on the initial weights; the first call compiles
    first_call_s = time.perf_counter() - start
    for step in range(steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = loss_of(data[step * B:(step + 1) * B])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_losses.append(loss.item())  # synchronizes
        step_times.append(time.perf_counter() - t0)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evals.append((step + 1, evaluate()))
        if (step + 1) % max(1, steps // 4) == 0 or step == 0:
            last = evals[-1][1] if evals[-1][0] == step + 1 else None
            print(f"  {name}: step {step + 1}/{steps} loss {train_losses[-1]:.4f}"
                  + (f" eval {last:.4f}" if last is not None else ""), flush=True)
    wall_s = time.perf_counter() - start
    if trained is not None:
        trained.append(model)
    final_train = statistics.fmean(train_losses[-FINAL_STEPS:])
    return {
        "seed": seed,
        "options": options,
        "train_loss": [_finite(x) for x in train_losses],
        "eval": [[s, _finite(x)] for s, x in evals],
        "final_train_loss": _finite(final_train),
        "final_eval_loss": _finite(evals[-1][1]),
        "wall_s": round(wall_s, 2),
        "compile_s": round(first_call_s, 2),  # the first call: the evaluation before training, compile included
        # the median training step (synchronized), the first one (its backward compiles) left out
        "step_ms": round(1e3 * statistics.median(step_times[1:] or step_times), 3),
        "compiler": _fp8_summary(kpt_compiler.reports()),
    }


# ----------------------------------------------------------------------------------------------------- main
def _card(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def main(argv: list[str] | None = None) -> int:
    from_cli = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_loss_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for fp8_loss_curve.{json,md,png}")
    p.add_argument("--plot", default=None, metavar="FILE.json", help="only draw the PNG from a run's JSON")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--runs", default="bf16,bf16-seeds,fp8,fp8-rowwise",
                   help="comma-separated: bf16, bf16-seeds (the --noise-seeds runs), fp8, fp8-rowwise")
    p.add_argument("--noise-seeds", type=int, default=2, help="bf16 runs with other seeds, for the noise")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a small model, vocabulary and batch (for tests)")
    args = p.parse_args(argv)

    if args.plot:
        path = plot(args.plot)
        if path:
            print(f"wrote {path}")
        return 0 if path else 1
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: use --device cpu")
            return 1
        if torch.cuda.get_device_capability() < (8, 9) and any(r.startswith("fp8") for r in args.runs.split(",")):
            print("the fp8 runs need a CUDA GPU with fp8 (compute capability 8.9 or newer)")
            return 1
    from kpt_compiler.bench import git_commit

    command = shlex.join(sys.orig_argv if from_cli else ["python", "-m", "benchmarks.fp8_loss_curve", *argv])
    cfg = TINY if args.tiny else FULL
    dtype = getattr(torch, args.dtype)
    wanted = [r.strip() for r in args.runs.split(",") if r.strip()]
    plan: list[tuple[str, int, dict]] = []
    for r in wanted:
        if r == "bf16-seeds":
            plan += [(f"bf16-seed{BASE_SEED + i}", BASE_SEED + i, {}) for i in range(1, args.noise_seeds + 1)]
        elif r in RUN_OPTIONS:
            plan.append((r, BASE_SEED, RUN_OPTIONS[r]))
        else:
            p.error(f"unknown run {r!r}; known: {', '.join([*RUN_OPTIONS, 'bf16-seeds'])}")
    plan.sort(key=lambda x: (not x[0].startswith("bf16"), x[0] != "bf16"))  # bf16 first, then its seeds

    task = MarkovTask(cfg["model"]["vocab_size"], args.task_seed)
    T = cfg["model"]["block_size"]
    eval_data = task.sample(cfg["eval_batches"] * cfg["batch"], T + 1, seed=args.task_seed + 10_000)
    floor = task.floor(eval_data)
    card = _card(args.device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    print(f"fp8 loss curve on {card}: GPT {cfg['model']}, batch {cfg['batch']}, {args.steps} steps, "
          f"{args.dtype}; loss floor {floor:.4f} (order-1 plateau {task.order1_entropy():.4f}, uniform "
          f"{math.log(task.vocab):.4f})", flush=True)

    runs: dict[str, dict] = {}
    started = time.perf_counter()
    for name, seed, options in plan:
        print(f"{name}: seed {seed}, options {json.dumps(options)}", flush=True)
        try:
            runs[name] = train_run(name, seed, options, cfg=cfg, steps=args.steps, eval_every=args.eval_every,
                                   device=args.device, dtype=dtype, task=task, eval_data=eval_data)
            r = runs[name]
            print(f"{name}: final train {r['final_train_loss']}, eval {r['final_eval_loss']}, {r['wall_s']} s "
                  f"(compile {r['compile_s']} s), fired {r['compiler']['fired']}, fp8 layers "
                  f"{r['compiler']['fp8_matches']}", flush=True)
        except Exception as e:  # a run that fails is recorded and the others go on
            runs[name] = {"seed": seed, "options": options, "error": f"{type(e).__name__}: {e}"}
            print(f"{name}: error: {type(e).__name__}: {e}", flush=True)

    record = {
        "card": card,
        "device": args.device,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "command": command,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "config": {"model": cfg["model"], "batch": cfg["batch"], "lr": cfg["lr"], "steps": args.steps,
                   "eval_every": args.eval_every, "eval_tokens": cfg["eval_batches"] * cfg["batch"] * T,
                   "dtype": args.dtype, "optimizer": "AdamW betas (0.9, 0.95), weight decay 0.1, clip 1.0, "
                   "warm-up steps/10, cosine to lr/10", "final_steps": FINAL_STEPS},
        "task": {"kind": "sparse order-2 Markov chain", "vocab": task.vocab, "successors": SUCCESSORS,
                 "groups": GROUPS, "dirichlet_alpha": ALPHA, "seed": args.task_seed, "floor": floor,
                 "order1_entropy": task.order1_entropy(), "uniform": math.log(task.vocab)},
        "runs": runs,
    }
    record["summary"] = summarize(runs)
    # write_bench stamps torch, date and commit; the markdown needs them before
    record_md = {**record, "torch": torch.__version__, "date": str(datetime.date.today()), "commit": git_commit()}
    text = markdown(record_md)
    print(text, flush=True)
    if args.out:
        from benchmarks.outputs import write_bench

        write_bench(args.out, NAME, record, text)
        png = plot(os.path.join(args.out, f"{NAME}.json"))
        print(f"wrote {os.path.join(args.out, NAME)}.{{json,md}}" + (f" and {png}" if png else ""), flush=True)
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

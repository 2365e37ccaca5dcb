"""Usage: python -m benchmarks.diag_generate_host [--device cuda|cpu] [--new-tokens 64] [--repeats 5] [--out DIR]

How much of a decoded token is ``generate()``'s own host work, whatever the model costs (issue 17's 1.6 ms per
token: the H100's weight floor is 1.34 ms, and generate waits for the device at every token, so its own steps
add to the device time instead of hiding behind it). The model's forward is replaced by one that returns a
preallocated logits tensor (the same token each step) and does nothing else, so the time per token is
generate's: preparing the inputs, the static cache's bookkeeping, logits processing, the stopping check and its
sync. ms per token: (T(new) - T(1)) / (new - 1), as bench_decode measures it. For scale, the same with the real
forward of a tiny eager Llama (2 layers, hidden 64: its modules' host time, almost no device time).

Split for the stub: per decode step, the host time from the loop's condition (``_has_unfinished_sequences``,
returning after the step's sync) to the forward's call ("before the forward": on a real step this delays the
device, which waits for the next replay) and from the forward's return to the next condition's return ("after":
on a real step it overlaps the device's work, up to the sync), medians over the steps of one generate()."""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from . import measure, outputs
from .bench_decode import TINY, build_model


def per_token_ms(model, ids, new: int, repeats: int, device: str) -> list[float]:
    def generate(n: int) -> float:
        measure.sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static")
        measure.sync(device)
        return time.perf_counter() - t0

    for _ in range(2):
        generate(new)
    out = []
    for _ in range(repeats):
        t1, tn = generate(1), generate(new)
        out.append((tn - t1) / (new - 1) * 1e3)
    return out


def split_ms(model, ids, new: int, device: str) -> dict:
    """Medians over one generate()'s decode steps of the host time before and after the (stub) forward."""
    marks: list[tuple[str, float]] = []
    forward, condition = model.forward, model._has_unfinished_sequences

    def timed_forward(*a, **k):
        marks.append(("in", time.perf_counter()))
        out = forward(*a, **k)
        marks.append(("out", time.perf_counter()))
        return out

    def timed_condition(*a, **k):
        going = condition(*a, **k)
        marks.append(("cond", time.perf_counter()))
        return going

    model.forward, model._has_unfinished_sequences = timed_forward, timed_condition
    try:
        measure.sync(device)
        model.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static")
        measure.sync(device)
    finally:
        model.forward, model._has_unfinished_sequences = forward, condition
    before, after = [], []
    for (k0, t0), (k1, t1), (k2, t2) in zip(marks, marks[1:], marks[2:]):
        if (k0, k1, k2) == ("cond", "in", "out"):
            before.append((t1 - t0) * 1e3)
        if (k0, k1) == ("out", "cond") and k2 == "in":  # a decode step's forward followed by another
            after.append((t1 - t0) * 1e3)
    return {"before_forward_ms": statistics.median(before) if before else None,
            "after_forward_ms": statistics.median(after) if after else None, "steps_split": len(before)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(TINY, args.device, dtype)
    ids = torch.randint(0, TINY["vocab_size"], (1, 16), device=args.device)
    rows = []
    real = per_token_ms(model, ids, args.new_tokens, args.repeats, args.device)
    rows.append({"forward": "tiny eager Llama (2 layers, hidden 64)", "per_token_ms": real})
    logits = torch.zeros(1, 1, TINY["vocab_size"], device=args.device, dtype=dtype)

    # what generate reads of a forward: the last position's logits. The forward's signature kept: generate() reads
    # it to decide which inputs to prepare (attention mask, position ids, logits_to_keep)
    @functools.wraps(model.forward)
    def stub(*_args, **_kwargs):
        return CausalLMOutputWithPast(logits=logits)

    model.forward = stub
    rows.append({"forward": "none (preallocated logits)", "per_token_ms": per_token_ms(
        model, ids, args.new_tokens, args.repeats, args.device)})
    rows[-1].update(split_ms(model, ids, args.new_tokens, args.device))
    meta = outputs.run_meta("diag_generate_host", argv, args.device)
    lines = [f"# generate()'s own host time per token on {meta['card']}", "",
             f"- date: {meta['date']}; commit: {meta['commit']}; torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- batch 1, prompt 16, {args.new_tokens} new tokens, static cache, greedy; ms per token: median "
             f"[min, max] of {args.repeats}", "", "| forward | ms per token |", "| --- | --- |"]
    for r in rows:
        t = r["per_token_ms"]
        r["median_ms"] = statistics.median(t)
        lines.append(f"| {r['forward']} | {r['median_ms']:.3f} [{min(t):.3f}, {max(t):.3f}] |")
    stub = rows[-1]
    if stub.get("before_forward_ms") is not None and stub.get("after_forward_ms") is not None:
        lines += ["", f"Without a forward, per decode step (medians over {stub['steps_split']} steps of one call): "
                      f"{stub['before_forward_ms']:.3f} ms from the loop's condition (after its sync) to the forward, "
                      f"{stub['after_forward_ms']:.3f} ms from the forward's return to the next condition's return "
                      "(the sync included)"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        outputs.write_bench(args.out, "diag_generate_host", {**meta, "rows": rows}, table)


if __name__ == "__main__":
    main()

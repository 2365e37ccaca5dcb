"""Attention microbenchmark: hand-written attention under kernelpytorch against every SDPA backend.

    python -m benchmarks.bench_attention [--out DIR]    (CUDA only)

For each shape (batch, heads, sequence, head dim; causal or not) it times, in one run on one card:
  - SDPA with each backend forced (flash, cudnn, efficient): the ceiling kernelpytorch should reach;
  - the same attention written by hand (q @ k^T * scale, a causal mask built from arange, softmax, @ v)
    compiled by Inductor (which leaves it unfused) and by kernelpytorch (whose attention pass fuses it).
TFLOP/s counts 4*B*H*L*S*D for the forward, half of it when causal. The last column is kernelpytorch's
fraction of the best SDPA backend. Short sequences are included to set the attention pass's min_seq_len.

A second table does the same for the forms kernelpytorch sends to FlexAttention: soft-capped causal
attention (Gemma-2's tanh(s / 30) * 30) and causal ALiBi (slope_h * (j - i)), which SDPA cannot express
(ALiBi only as a dense additive mask it reads from memory), and a causal sliding window, which SDPA
takes only as a dense mask: the hand-written form under Inductor and under kernelpytorch, against
torch.compile(flex_attention) called directly with the same score_mod and mask, and (window, ALiBi) SDPA with the
dense mask.

A third table takes the mask forms models hand to F.scaled_dot_product_attention: the all-true boolean mask
transformers 5.17 builds for BERT and ViT (expanded, its last stride 0) and the same mask made contiguous; no mask;
a key-padding boolean mask expanded from the input; and T5's learned relative-position bias, table[bucket] of shape
[L, S, H] permuted to [1, H, L, S] (last stride H; buckets here are the clamped distance j - i), and the same bias
made contiguous. For each it names the backend SDPA's dispatcher picks (torch._fused_sdp_choice) under the priority
cuDNN, flash, efficient, math, times that SDPA call under the same priority, and times the same attention written
by hand (a boolean mask by masked_fill(~m, -inf), an additive one added; softmax in float32) under
torch.compile(dynamic=False), i.e. Inductor, with the ratio of the two.
"""

from __future__ import annotations

import argparse
import math
import datetime

import torch
import torch.nn.functional as F

from benchmarks.outputs import write_bench
from kpt_compiler.bench import git_commit, median_ms

SHAPES = [  # (B, H, L, D, causal)
    (8, 16, 4096, 128, True),
    (8, 16, 4096, 128, False),
    (16, 12, 1024, 64, True),
    (8, 12, 1024, 64, True),  # GPT-2 small at 8 x 1024
    (1, 12, 512, 64, True),
    (1, 12, 128, 64, True),
    (1, 12, 64, 64, True),
]


def hand_written(q, k, v, causal: bool):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        i = torch.arange(q.shape[-2], device=q.device)
        mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)
        scores = scores + mask.masked_fill(i[None, :] > i[:, None], torch.finfo(q.dtype).min)
    return F.softmax(scores, dim=-1) @ v


FLEX_CASES = [  # (B, H, L, D, soft-cap, window, ALiBi)
    (8, 16, 4096, 128, 30.0, None, False),
    (16, 12, 1024, 64, 30.0, None, False),
    (8, 12, 1024, 64, 30.0, None, False),
    (8, 16, 4096, 128, None, 512, False),
    (8, 12, 1024, 64, None, 256, False),
    (8, 16, 4096, 128, None, None, True),
    (8, 12, 1024, 64, None, None, True),
]


def alibi_slopes(heads: int, device) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device)


def hand_written_flex_form(q, k, v, softcap, window, alibi=False):
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[-2], device=q.device)
    blocked = i[None, :] > i[:, None]
    if window is not None:
        blocked = blocked | (i[:, None] - i[None, :] >= window)
    mask = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)
    if alibi:  # slope_h * (j - i), as MPT and BLOOM-style models add it
        mask = (alibi_slopes(q.shape[1], q.device).view(-1, 1, 1) * (i[None, :] - i[:, None])).to(q.dtype)
    scores = scores + mask.masked_fill(blocked, float("-inf"))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _flex_rows() -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from kpt_compiler.kernels.flex_attention import _mask_mod, _score_mod

    flex = torch.compile(flex_attention)
    rows = []
    for B, H, L, D, softcap, window, alibi in FLEX_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        block = create_block_mask(_mask_mod(True, window), None, None, L, L, device="cuda")
        slopes = alibi_slopes(H, "cuda")

        def alibi_mod(score, b, h, q_idx, kv_idx):
            return score + (slopes[h] * (kv_idx - q_idx)).to(torch.bfloat16).to(score.dtype)

        score_mod = alibi_mod if alibi else _score_mod(softcap)
        times = {"flex (direct)": median_ms(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block), "cuda")}
        if window is not None or alibi:
            i = torch.arange(L, device="cuda")
            keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < (window or L))
            mask = keep
            if alibi:
                mask = (slopes.view(-1, 1, 1) * (i[None, :] - i[:, None])).to(q.dtype).masked_fill(~keep, -math.inf)
            times["sdpa (dense mask)"] = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                                                   "cuda")
        fn = lambda q, k, v: hand_written_flex_form(q, k, v, softcap, window, alibi)  # noqa: E731
        compiled, rec = _time_compiled(fn, q, k, v, times)
        with torch.no_grad():
            ref = fn(q.float(), k.float(), v.float())
            err = ((compiled(q, k, v).float() - ref).norm() / ref.norm()).item()
        allowed = L * (L + 1) / 2 if window is None else window * L - window * (window - 1) / 2
        flop = 4 * B * H * D * allowed
        form = f"soft-cap {softcap:g}" if softcap is not None else f"window {window}" if window else "ALiBi, causal"
        rows.append({"shape": [B, H, L, D], "form": form, "ms": times,
                     "tflops": {n: flop / t / 1e9 for n, t in times.items()},
                     "kpt_vs_flex": times["flex (direct)"] / times["kpt"],
                     "kpt_vs_inductor": times["inductor"] / times["kpt"], "matched": rec.matches, "rel_err": err,
                     "note": rec.notes[-1] if rec.notes else ""})
        print(f"{form} {B}x{H}x{L}x{D}: " + "  ".join(f"{n} {t:.3f}ms" for n, t in times.items()), flush=True)
    return rows


_BERT, _VIT, _T5 = (32, 12, 512, 64), (64, 12, 197, 64), (16, 12, 512, 64)
MASK_FORM_CASES = [  # (form, (B, H, L, D))
    *[(form, shape) for form in ("all-true bool, expanded (transformers 5.17 BERT/ViT)", "all-true bool, contiguous",
                                 "no mask") for shape in (_BERT, _VIT)],
    ("padding bool, expanded from the input", _BERT),
    ("T5 relative-position bias, [L,S,H] permuted", _T5),
    ("T5 relative-position bias, contiguous", _T5),
]


def t5_bias(table: torch.Tensor, L: int, S: int) -> torch.Tensor:
    """table[bucket] ([L, S, H]) permuted to [1, H, L, S] as T5 builds its position bias: last stride H, not 1."""
    n = table.shape[0]
    rel = torch.arange(S, device=table.device)[None, :] - torch.arange(L, device=table.device)[:, None]
    return table[rel.clamp(-(n // 2), n // 2 - 1) + n // 2].permute(2, 0, 1).unsqueeze(0)


def mask_form(form: str, B: int, H: int, L: int, device, generator=None):
    """The attn_mask (None, bool, or bf16 additive) and SDPA scale (None: D ** -0.5) of one MASK_FORM_CASES form."""
    if form.startswith("all-true"):
        mask = (torch.arange(L, device=device)[None, None, :, None] >= 0).expand(B, 1, L, L)
    elif form.startswith("padding"):  # half the batch rows padded beyond L / 2
        keep = torch.ones(B, L, dtype=torch.bool, device=device)
        keep[B // 2:, L // 2:] = False
        mask = keep[:, None, None, :].expand(B, 1, L, L)
    elif form.startswith("T5"):  # T5 does not scale its scores
        table = torch.randn(32, H, device=device, dtype=torch.bfloat16, generator=generator)
        return (t5_bias(table, L, L).contiguous() if "contiguous" in form else t5_bias(table, L, L)), 1.0
    else:
        return None, None
    return (mask.contiguous() if "contiguous" in form else mask), None


def hand_written_masked(q, k, v, mask, scale):
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _mask_form_rows() -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    rows = []
    for form, (B, H, L, D) in MASK_FORM_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        mask, scale = mask_form(form, B, H, L, "cuda", g)
        times, note = {}, ""
        with sdpa_kernel(order, set_priority=True):
            picked = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=scale)).name
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # noqa: E731
            try:
                sdpa()
                times["sdpa"] = median_ms(sdpa, "cuda")
            except RuntimeError as e:  # keep the run: the other rows and tables still get written
                times["sdpa"], note = None, str(e).splitlines()[0][:200]
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v, m: hand_written_masked(q, k, v, m, scale), dynamic=False)
        with torch.no_grad():
            compiled(q, k, v, mask)
            times["inductor"] = median_ms(lambda: compiled(q, k, v, mask), "cuda")
        rows.append({"shape": [B, H, L, D], "form": form,
                     "mask_shape": None if mask is None else list(mask.shape),
                     "mask_stride": None if mask is None else list(mask.stride()), "backend": picked, "ms": times,
                     "sdpa_vs_inductor": times["inductor"] / times["sdpa"] if times["sdpa"] else None, "note": note})
        print(f"{form} {B}x{H}x{L}x{D}: {picked} " + "  ".join(
            f"{n} {t:.3f}ms" if t else f"{n} failed" for n, t in times.items()), flush=True)
    return rows


def _time_compiled(fn, q, k, v, times: dict):
    """Time ``fn`` compiled by Inductor and by kernelpytorch into ``times``; the latter and its attention record."""
    import kpt_compiler

    for mode, backend in (("inductor", "inductor"), ("kpt", "kernelpytorch")):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend)
        with torch.no_grad():
            compiled(q, k, v)
            times[mode] = median_ms(lambda: compiled(q, k, v), "cuda")
    return compiled, kpt_compiler.last_report().pass_record("attention")


def _sdpa_ms(backend, q, k, v, causal) -> float | None:
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel([backend]):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            fn()
            return median_ms(fn, "cuda")
    except RuntimeError:  # this backend does not support the case
        return None


def main(argv=None) -> int:
    from torch.nn.attention import SDPBackend


    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "bench_attention needs a CUDA GPU"
    rows = []
    for B, H, L, D, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        flop = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
        times = {name: _sdpa_ms(b, q, k, v, causal) for name, b in (
            ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
        fn = lambda q, k, v: hand_written(q, k, v, causal)  # noqa: E731
        compiled, rec = _time_compiled(fn, q, k, v, times)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            err = ((compiled(q, k, v).float() - ref).norm() / ref.norm()).item()
        best = min(t for n, t in times.items() if n in ("flash", "cudnn", "efficient") and t is not None)
        row = {"shape": [B, H, L, D], "causal": causal, "ms": times,
               "tflops": {n: (flop / t / 1e9 if t else None) for n, t in times.items()},
               "kpt_vs_best_sdpa": best / times["kpt"], "kpt_vs_inductor": times["inductor"] / times["kpt"],
               "matched": rec.matches, "note": rec.notes[-1] if rec.notes else "", "rel_err": err}
        rows.append(row)
        print(f"{B}x{H}x{L}x{D} {'causal' if causal else 'full  '}: " + "  ".join(
            f"{n} {t:.3f}ms" if t else f"{n} n/a" for n, t in times.items()) + f"  kpt/best {row['kpt_vs_best_sdpa']:.2f}",
            flush=True)
    card, commit = torch.cuda.get_device_name(), git_commit()
    lines = [f"Attention, bf16 forward, {card}, torch {torch.__version__}, {datetime.date.today()}, commit {commit}; "
             "command: python -m benchmarks.bench_attention", "",
             "| B,H,L,D | causal | flash | cudnn | efficient | inductor (hand-written) | kernelpytorch (hand-written) "
             "| kpt / best SDPA | kpt vs Inductor | rel. err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        tf = r["tflops"]
        cell = lambda n: f"{tf[n]:.0f}" if tf.get(n) else "n/a"  # noqa: E731
        lines.append(f"| {','.join(map(str, r['shape']))} | {'yes' if r['causal'] else 'no'} | {cell('flash')} | "
                     f"{cell('cudnn')} | {cell('efficient')} | {cell('inductor')} | {cell('kpt')} | "
                     f"{r['kpt_vs_best_sdpa']:.0%} | {r['kpt_vs_inductor']:.2f}x | {r['rel_err']:.1e} |")
    lines.append("\nTFLOP/s (causal counts half the FLOPs).")
    flex_rows = _flex_rows()
    lines += ["", "Causal forms sent to FlexAttention, bf16 forward, TFLOP/s of the allowed positions:", "",
              "| B,H,L,D | form | flex_attention, compiled directly | SDPA, dense mask | Inductor (hand-written) "
              "| kernelpytorch (hand-written) | kpt / flex | kpt vs Inductor | rel. err |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in flex_rows:
        tf = r["tflops"]
        dense = f"{tf['sdpa (dense mask)']:.0f}" if "sdpa (dense mask)" in tf else "-"
        lines.append(f"| {','.join(map(str, r['shape']))} | {r['form']} | {tf['flex (direct)']:.0f} | {dense} | "
                     f"{tf['inductor']:.0f} | {tf['kpt']:.0f} | {r['kpt_vs_flex']:.0%} | {r['kpt_vs_inductor']:.2f}x | "
                     f"{r['rel_err']:.1e} |")
    mask_rows = _mask_form_rows()
    lines += ["", "Mask forms handed to SDPA, bf16 forward, ms; the backend SDPA picks under the priority cuDNN, "
              "flash, efficient, math:", "",
              "| form | B,H,L,D | mask shape / strides | backend picked | SDPA ms | Inductor (hand-written) ms "
              "| Inductor / SDPA |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in mask_rows:
        m = "-" if r["mask_shape"] is None else f"{r['mask_shape']} / {r['mask_stride']}"
        sdpa = f"{r['ms']['sdpa']:.3f}" if r["ms"]["sdpa"] else f"failed: {r['note'].replace('|', '/')}"
        ratio = f"{r['sdpa_vs_inductor']:.2f}x" if r["sdpa_vs_inductor"] else "-"
        lines.append(f"| {r['form']} | {','.join(map(str, r['shape']))} | {m} | {r['backend']} | {sdpa} | "
                     f"{r['ms']['inductor']:.3f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_bench(args.out, "bench_attention", {"card": card, "rows": rows, "flex_rows": flex_rows,
                                                  "mask_form_rows": mask_rows}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

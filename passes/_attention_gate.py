"""Profit gating for the attention pass: is the SDPA call a rewrite would make faster than what runs instead?

What decides the speed of an SDPA call is the backend the dispatcher picks for it. A fused one (cuDNN, flash,
memory-efficient) reads q, k and v once and never writes the scores; the math backend is the decomposed
attention (in float32 for 16-bit inputs), which Inductor's own fused softmax beats. On an H100 the choice
turned on the mask's layout: transformers 5.17 hands BERT and ViT an all-true mask expanded from
``[1, 1, L, 1]`` (last-dimension stride 0), T5 a relative-position bias permuted from ``[L, S, H]`` (stride
H), and every fused kernel needs stride 1 there, so SDPA ran math: 2.5 ms against 0.07 ms with no mask
(``python -m benchmarks.bench_attention``, its mask-forms table). Hence:

- ``decide="auto"`` (the default) on CUDA: ask the dispatcher, under the pass's backend priority, which
  backend the planned call gets (``torch._fused_sdp_choice`` on empty tensors of the call's shapes, strides
  and dtypes), and rewrite only if it is a fused one; on other devices rewrite (the CPU's tests and eager
  route; no figure says otherwise there);
- ``"measure"`` (the default under ``mode="max-autotune"``): time the planned call on the device against
  what runs instead (the original SDPA call where it already gets a fused backend, else Inductor at its best
  on the decomposed form: its two cuBLAS products timed, its softmax's bytes at the card's copy bandwidth);
- ``"always"``: every candidate.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from kpt_compiler import torch_ir as ir
from kpt_compiler.cost_model import Candidate, CostModel, Decision
from kpt_compiler.registry import PassContext

FUSED = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


class Call:
    """An SDPA call as planned (or as found), described by the graph's example values."""

    def __init__(self, q: fx.Node, k: fx.Node, v: fx.Node, mask: fx.Node | None, dropout: float, causal: bool,
                 scale: float | None, gqa: bool = False):
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.dropout, self.causal, self.scale, self.gqa = dropout, causal, scale, gqa

    def values(self) -> list[Any]:
        return [ir.example_value(n) if n is not None else None for n in (self.q, self.k, self.v, self.mask)]

    def static(self) -> bool:
        return all(all(isinstance(s, int) for s in (*t.shape, *t.stride())) for t in self.values() if t is not None)

    def describe(self) -> str:
        q, k, _, m = self.values()
        mask = "no mask" if m is None else f"{str(m.dtype).replace('torch.', '')} mask {list(m.shape)} strides " \
                                           f"{list(m.stride())}"
        return f"q {list(q.shape)}, k {list(k.shape)}, {mask}{', causal' if self.causal else ''}"

    def run(self, device) -> Callable[[], Any]:
        """A closure making this call on random tensors of its shapes, strides and dtypes."""
        tensors = [None if t is None else _random(t, device) for t in self.values()]
        q, k, v, m = tensors
        kwargs = {"attn_mask": m, "dropout_p": self.dropout, "is_causal": self.causal, "scale": self.scale}
        if self.gqa:
            kwargs["enable_gqa"] = True
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def _empty(t: torch.Tensor, device) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def _stored(t: torch.Tensor) -> int:
    """How many elements ``t`` reads from memory (a broadcast dimension, stride 0, once)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _random(t: torch.Tensor, device) -> torch.Tensor:
    """A tensor with ``t``'s shape, strides and dtype (stride 0 included), random (all true if boolean)."""
    size = _stored(t)
    flat = torch.ones(size, dtype=torch.bool, device=device) if t.dtype == torch.bool else \
        torch.randn(size, dtype=t.dtype, device=device)
    return flat.as_strided(t.shape, t.stride())


def backend(call: Call, device, order) -> str | None:
    """The SDPA backend the dispatcher picks for ``call`` under the priority ``order`` (None: torch's default
    order), e.g. "CUDNN_ATTENTION" or "MATH"; None where the shapes are dynamic."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not call.static():
        return None
    q, k, v, m = (None if t is None else _empty(t, device) for t in call.values())
    with sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext():
        choice = torch._fused_sdp_choice(q, k, v, m, call.dropout, call.causal, scale=call.scale,
                                         enable_gqa=call.gqa)
    return SDPBackend(choice).name


def decide(ctx: PassContext, how: str, planned: Call, original: Call | None, order) -> Decision:
    """Whether to make ``planned`` (replacing ``original``, an SDPA call, or hand-written attention if None)."""
    if how == "always":
        return Decision(True, "decide='always'")
    if not ctx.target.is_cuda:
        return Decision(True, "")  # the fused-backend rule is CUDA's; no figure says otherwise elsewhere
    device = ir.example_value(planned.q).device  # the graph's fake tensors carry the device
    ours = backend(planned, device, order)
    if ours is None:
        return Decision(True, "dynamic shapes: the backend is picked at run time")
    picked = ours.lower().replace("_attention", "")
    if how != "measure":
        if ours in FUSED:
            return Decision(True, f"SDPA runs its {picked} kernel here")
        return Decision(False, f"SDPA would run its math backend for {planned.describe()}, the decomposed "
                               "attention Inductor's own fused softmax beats; decide='measure' times it")
    theirs = backend(original, device, order) if original is not None else None
    if theirs in FUSED:
        baseline = lambda: _ms(original.run(device))  # noqa: E731 - the original call, as it runs
    else:
        baseline = _decomposed_ms(planned, device)
    candidate = Candidate("attention", int(ir.example_value(planned.q).shape[:-1].numel()),
                          {"call": planned.describe(), "original": original.describe() if original else "hand-written"},
                          ir.example_value(planned.q).dtype, decide, ours=planned.run(device),
                          baseline_ms=baseline)
    d = (ctx.cost_model or CostModel(ctx.target, ctx.mode, ctx.codegen)).decide("measure", candidate)
    return Decision(d.rewrite, f"{d.why} (SDPA {picked}; Inductor's side: "
                               f"{'the original call, ' + theirs.lower() if theirs in FUSED else 'decomposed'})")


def _ms(fn: Callable[[], Any]) -> float:
    from kpt_compiler.bench import median_ms

    return median_ms(fn, "cuda", warmup_ms=25, rep_ms=100)


def _decomposed_ms(call: Call, device) -> Callable[[], float]:
    """Inductor at its best on attention it leaves decomposed: the two cuBLAS products, timed, and its fused
    softmax reading the scores (and the mask) and writing the probabilities at the card's copy bandwidth."""
    def ms():
        from kpt_compiler.bench import copy_bandwidth

        q, k, v, m = call.values()
        lead = tuple(q.shape[:-2])  # grouped-query: the products run on the repeated heads
        qr, kr, vr = (torch.randn(*lead, *t.shape[-2:], dtype=q.dtype, device=device) for t in (q, k, v))
        products = _ms(lambda: torch.matmul(torch.matmul(qr, kr.transpose(-2, -1)), vr))
        scores = q.shape[:-1].numel() * k.shape[-2]
        nbytes = 2 * scores * q.element_size() + (_stored(m) * m.element_size() if m is not None else 0)
        return products + nbytes / (copy_bandwidth(device="cuda") * 1e12) * 1e3
    return ms

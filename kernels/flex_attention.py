"""FlexAttention for the attention forms SDPA cannot express, or cannot make fast.

Math (per batch and head)::

    s[i, j] = scale * (q[i] . k[j])
    s[i, j] = cap * tanh(s[i, j] / cap)                  with logit soft-capping (Gemma-2)
    s[i, j] = s[i, j] + (a_h * j + b_h * i + c_h)        with a bias linear in the positions: ALiBi
                                                         (slope_h * (j - i)) and its spellings (MPT's
                                                         slope_h * (j - S + 1), BLOOM's slope_h * j)
    allowed = all j | j <= i (causal) | i - window < j <= i (sliding window)
    out[i]  = sum_{j allowed} softmax_j(s[i, :]) v[j]

``flex_sdpa`` calls torch's ``flex_attention`` higher-order op directly: the soft-cap and the bias are its
``score_mod`` (the bias's per-head coefficients a buffer the score_mod reads, rounded to the dtype the model
computed the bias in, so the bias added is the model's),
the allowed set its ``mask_mod``, and the block mask built from it skips every block with nothing allowed
(above the diagonal; outside the window), which a dense SDPA mask cannot. Inside a graph, AOTAutograd traces
the two functions into subgraphs and Inductor generates fused Triton kernels for the forward and the backward
(the op's own autograd); run eagerly, the op computes the same thing unfused. ``flex_sdpa`` builds its block
mask in the call, so in a graph it is a few small ops on constants rather than tensors the graph would have to
take as inputs; ``flex_masked_sdpa`` (a dense mask from the inputs, grouped-query heads) takes its full block
mask as the graph's constants. The attention pass inserts both (passes/attention.py, passes/_attention_gqa.py);
``reference`` is the unfused math.
"""

from __future__ import annotations

import math

import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import _apply_kernel_options, create_block_mask, noop_mask

__all__ = ["flex_sdpa", "flex_masked_sdpa", "reference", "split_kv"]


def _mask_mod(causal: bool, window: int | None):
    if window is not None:
        def sliding_window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

        return sliding_window
    if causal:
        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return causal_mask
    return noop_mask


def _score_mod(softcap: float | None, bias_dtype: torch.dtype | None = None):
    """score_mod(score, b, h, q_idx, kv_idx[, coefficients]): soft-cap, then the linear position bias."""
    def cap(score):
        return score if softcap is None else torch.tanh(score / softcap) * softcap

    if bias_dtype is None:
        def soft_cap(score, b, h, q_idx, kv_idx):
            return cap(score)

        return soft_cap

    def linear_bias(score, b, h, q_idx, kv_idx, coef):
        bias = coef[h, 0] * kv_idx + coef[h, 1] * q_idx + coef[h, 2]
        return cap(score) + bias.to(bias_dtype).to(score.dtype)

    return linear_bias


def flex_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, softcap: float | None = None,
              causal: bool = False, window: int | None = None,
              bias: tuple[tuple[float, float, float], ...] | None = None,
              bias_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused attention over [batch, heads, seq, dim] inputs; see the module docstring for the math.

    ``bias``: one (a_h, b_h, c_h) per query head, the bias a_h * j + b_h * i + c_h computed in float32 and
    rounded to ``bias_dtype`` (the dtype the model's bias tensor had).
    """
    block = create_block_mask(_mask_mod(causal, window), None, None, q.shape[-2], k.shape[-2], device=q.device)
    kernel_options = _apply_kernel_options(q, k, v, False, None)
    buffers = ()
    if bias is not None:
        if len(bias) != q.shape[1]:
            raise ValueError(f"bias has coefficients for {len(bias)} heads, the query has {q.shape[1]}")
        buffers = (torch.tensor(bias, dtype=torch.float32, device=q.device),)
    score_mod = _score_mod(softcap, (bias_dtype or torch.float32) if bias is not None else None)
    out, *_ = flex_attention_hop(q, k, v, score_mod, block.as_tuple(), scale, kernel_options, buffers)
    return out


def _dense_mask_score_mod(boolean: bool, per_head: bool):
    """score_mod reading a dense mask, [B, H, T, S] per head, else [B, T, S] (indexed by tensors alone: torch 2.9's
    eager FlexAttention cannot take an int among them): boolean keeps where true, floating is added."""
    def value(mask, b, h, q_idx, kv_idx):
        return mask[b, h, q_idx, kv_idx] if per_head else mask[b, q_idx, kv_idx]

    if boolean:
        def keep(score, b, h, q_idx, kv_idx, mask):
            return torch.where(value(mask, b, h, q_idx, kv_idx), score, -math.inf)

        return keep

    def add(score, b, h, q_idx, kv_idx, mask):
        return score + value(mask, b, h, q_idx, kv_idx).to(score.dtype)

    return add


def full_blocks(t: int, s: int, device) -> tuple[tuple, list[torch.Tensor]]:
    """The full block mask of a t x s attention, computed now: ``flex_masked_sdpa``'s ``block_spec`` (the higher-
    order op's block tuple, "tensor" where it holds a tensor) and those tensors, for a graph to hold as constants
    (built in the graph, it is a few kernels a call: sorts among them)."""
    *items, mask_mod = create_block_mask(noop_mask, None, None, t, s, device=device).as_tuple()
    assert callable(mask_mod), "the block tuple's last item is its mask_mod"
    return tuple("tensor" if isinstance(x, torch.Tensor) else x for x in items), \
        [x for x in items if isinstance(x, torch.Tensor)]


def flex_masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     blocks: tuple[torch.Tensor, ...] = (), *, scale: float, block_spec: tuple | None = None
                     ) -> torch.Tensor:
    """SDPA with ``attn_mask=mask`` (boolean: keep where true; floating: added to the scores), as FlexAttention.

    q [B, Hq, T, D]; k and v [B, Hkv, S, D] with Hq a multiple of Hkv: query head h reads key/value head h // (Hq //
    Hkv) (SDPA's ``enable_gqa``), so k and v are read as they are, never repeated. The mask is a score_mod buffer,
    broadcast to [B, Hq, T, S] or [B, T, S] (a view), and the block mask is full. Under Inductor, at query lengths
    under 128 with static batch and heads and a power-of-two head ratio, this is Inductor's FlexAttention decoding
    kernel: it splits the keys across blocks and runs a key/value head's query heads in one block
    (passes/_attention_gqa.py uses it for decode steps under ``gqa_kernel='flex'``). ``blocks`` and ``block_spec``:
    the full block mask from ``full_blocks`` (else it is built here).
    """
    b, hq, t, _ = q.shape
    s = k.shape[-2]
    score_mod, buffers = _score_mod(None), ()
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        per_head = mask.shape[1] != 1
        mask = mask.expand(b, hq, t, s) if per_head else mask.expand(b, 1, t, s)[:, 0]
        score_mod, buffers = _dense_mask_score_mod(mask.dtype == torch.bool, per_head), (mask,)
    if block_spec is None:
        block = create_block_mask(noop_mask, None, None, t, s, device=q.device).as_tuple()
    else:
        tensors = iter(blocks)
        block = tuple(next(tensors) if x == "tensor" else x for x in block_spec) + (noop_mask,)
    kernel_options = _apply_kernel_options(q, k, v, False, None)
    if q.is_cuda and all(isinstance(x, int) for x in (b, hq, t, s, k.shape[1])) and 0 < t < 128 \
            and hq % k.shape[1] == 0 and (hq // k.shape[1]) & (hq // k.shape[1] - 1) == 0:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count  # Inductor's decoding kernel runs
        kernel_options["SPLIT_KV"] = split_kv(s, b * k.shape[1], sms)
    out, *_ = flex_attention_hop(q, k, v, score_mod, block, scale, kernel_options, buffers)
    return out


def split_kv(s: int, pairs: int, sms: int, block_n: int = 64) -> int:
    """How many parts Inductor's FlexAttention decoding kernel splits s keys into: as many as its own rule (twice
    the SMs over the (batch, key/value head) pairs, ``get_split_k`` in torch/_inductor/kernel/flex/
    flex_decoding.py), but no more than the tiles of ``block_n`` keys its parts are rounded to fill. Its rule
    ignores the length: at 80 keys, a batch of one and 8 key/value heads, 32 parts, 30 of them empty, and its
    combine reads all 32; here 2. At 2080 keys its parts are 128 keys, 17 of them with work; here 17 (a batch of
    one, 8 key/value heads, 132 SMs). Exact at ``block_n`` 64, Inductor's default decoding config on CUDA; under
    max-autotune it also tries 32 and 128 keys a tile, where a part may get a tile more or none."""
    parts = max(2 * (sms // max(pairs, 1)), 1)
    tiles = max(-(-s // block_n), 1)
    return -(-tiles // -(-tiles // parts))


def _sdpa_flops(q, k, v, mask=None, blocks=(), **_):
    """What torch's FLOP counter cannot run (the higher-order op under it, torch 2.11-2.13) counted as SDPA's
    over k and v repeated to the query's heads (the counter's SDPA formulas take no grouped-query shapes on CUDA;
    under fake tensors the repeat costs nothing)."""
    b, kvh, s, d = k.shape
    r = q.shape[1] // kvh
    k, v = (x[:, :, None].expand(b, kvh, r, s, x.shape[-1]).reshape(b, kvh * r, s, x.shape[-1]) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


flex_sdpa.flop_standin = flex_masked_sdpa.flop_standin = _sdpa_flops


def reference(q, k, v, *, scale: float, softcap: float | None = None, causal: bool = False,
              window: int | None = None, bias=None, bias_dtype=None) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    L, S = s.shape[-2:]
    i = torch.arange(L, device=s.device)[:, None]
    j = torch.arange(S, device=s.device)[None, :]
    if bias is not None:
        a, b, c = torch.tensor(bias, dtype=torch.float32, device=s.device).unbind(-1)
        lin = a[:, None, None] * j + b[:, None, None] * i + c[:, None, None]
        s = s + lin.to(bias_dtype or torch.float32).to(s.dtype)
    allowed = torch.ones(L, S, dtype=torch.bool, device=s.device)
    if causal or window is not None:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j < window
    return torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1) @ v

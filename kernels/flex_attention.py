"""Soft-capped attention through FlexAttention: what SDPA cannot express.

Math (per batch and head; Gemma-2's logit soft-capping)::

    s[i, j] = cap * tanh(scale * (q[i] . k[j]) / cap)          for j allowed (all, or j <= i when causal)
    out[i]  = sum_j softmax_j(s[i, :]) v[j]

``softcap_attention`` calls torch's ``flex_attention`` higher-order op directly, with the soft-cap as its
``score_mod`` and a block mask that skips the blocks above the diagonal when causal. Inside a graph,
AOTAutograd traces the score_mod into a subgraph and Inductor generates the fused Triton kernels for the
forward and the backward (the op's own autograd); run eagerly, the op computes the same thing unfused.
The block mask is built in the call, so in a graph it is a few small ops on constants rather than tensors
the graph would have to take as inputs. The attention pass inserts it (passes/attention.py).
"""

from __future__ import annotations

import math
import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import _apply_kernel_options, create_block_mask, noop_mask

__all__ = ["softcap_attention", "reference"]


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, softcap: float,
                      causal: bool) -> torch.Tensor:
    """Fused ``softmax(cap * tanh(scale * q k^T / cap) [causal]) @ v``."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    mask_mod = causal_mask if causal else noop_mask
    block = create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    kernel_options = _apply_kernel_options(q, k, v, False, None)
    out, *_ = flex_attention_hop(q, k, v, score_mod, block.as_tuple(), scale, kernel_options)
    return out


def reference(q, k, v, *, scale: float, softcap: float, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), -math.inf)
    return torch.softmax(s, dim=-1) @ v

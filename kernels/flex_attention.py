"""FlexAttention for the attention forms SDPA cannot express, or cannot make fast.

Math (per batch and head)::

    s[i, j] = scale * (q[i] . k[j])
    s[i, j] = cap * tanh(s[i, j] / cap)                  with logit soft-capping (Gemma-2)
    allowed = all j | j <= i (causal) | i - window < j <= i (sliding window)
    out[i]  = sum_{j allowed} softmax_j(s[i, :]) v[j]

``flex_sdpa`` calls torch's ``flex_attention`` higher-order op directly: the soft-cap is its ``score_mod``,
the allowed set its ``mask_mod``, and the block mask built from it skips every block with nothing allowed
(above the diagonal; outside the window), which a dense SDPA mask cannot. Inside a graph, AOTAutograd traces
the two functions into subgraphs and Inductor generates fused Triton kernels for the forward and the backward
(the op's own autograd); run eagerly, the op computes the same thing unfused. The block mask is built in the
call, so in a graph it is a few small ops on constants rather than tensors the graph would have to take as
inputs. The attention pass inserts it (passes/attention.py); ``reference`` is the unfused math.
"""

from __future__ import annotations

import math

import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch.nn.attention.flex_attention import _apply_kernel_options, create_block_mask, noop_mask

__all__ = ["flex_sdpa", "reference"]


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


def _score_mod(softcap: float | None):
    if softcap is None:
        def identity(score, b, h, q_idx, kv_idx):
            return score

        return identity

    def soft_cap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return soft_cap


def flex_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, softcap: float | None = None,
              causal: bool = False, window: int | None = None) -> torch.Tensor:
    """Fused attention over [batch, heads, seq, dim] inputs; see the module docstring for the math."""
    block = create_block_mask(_mask_mod(causal, window), None, None, q.shape[-2], k.shape[-2], device=q.device)
    kernel_options = _apply_kernel_options(q, k, v, False, None)
    out, *_ = flex_attention_hop(q, k, v, _score_mod(softcap), block.as_tuple(), scale, kernel_options)
    return out


def reference(q, k, v, *, scale: float, softcap: float | None = None, causal: bool = False,
              window: int | None = None) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    L, S = s.shape[-2:]
    i = torch.arange(L, device=s.device)[:, None]
    j = torch.arange(S, device=s.device)[None, :]
    allowed = torch.ones(L, S, dtype=torch.bool, device=s.device)
    if causal or window is not None:
        allowed &= j <= i
    if window is not None:
        allowed &= i - j < window
    return torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1) @ v

"""Which SDPA kernel runs, and how fast, for GPT-2-sized attention (12 heads, head dim 64, bf16) with: a
contiguous float causal mask, the same mask read through kpt::pad_rows (narrowed back), and is_causal with no
mask; under the attention pass's backend priority (cuDNN first). CUDA only; prints one line per case
(triton.testing.do_bench, median of 50 ms).

    PYTHONPATH=. python benchmarks/diag_sdpa_mask.py
"""
import torch, torch.nn.functional as F
from triton.testing import do_bench
from kpt_compiler.kernels.aligned_rows import aligned_rows
from torch.nn.attention import sdpa_kernel, SDPBackend
order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
for b, s in ((8, 512), (16, 1021), (2, 100)):
    q, k, v = (torch.randn(b, 12, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    i = torch.arange(s, device="cuda")
    m = torch.where(i[None, :] <= i[:, None], 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    m = m.expand(b, 1, s, s).contiguous()
    for name, kw in (("contiguous mask", dict(attn_mask=m)), ("pad_rows mask", dict(attn_mask=aligned_rows(m))),
                     ("is_causal", dict(is_causal=True))):
        with sdpa_kernel(order, set_priority=True):
            choice = torch._fused_sdp_choice(q, k, v, kw.get("attn_mask"), 0.0, kw.get("is_causal", False))
            ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, **kw), warmup=10, rep=50)
        names = {int(v): k for k, v in SDPBackend.__members__.items()}
        print(f"b={b} s={s} {name}: backend {names.get(int(choice), choice)} {ms*1e3:.0f} us")

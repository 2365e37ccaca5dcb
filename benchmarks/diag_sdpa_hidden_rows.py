# Does SDPA's backward give eager's gradients for query rows a finite mask hides whole (padding), per backend?
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(0)
B, H, S, D = 2, 4, 128, 64
for dtype in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
    mn = torch.finfo(dtype).min
    m = torch.zeros(B, 1, S, S, device="cuda", dtype=dtype).masked_fill(torch.ones(S, S, device="cuda").triu(1).bool(), mn)
    m[0, :, :, :3] = mn  # sequence 0 left-padded by 3: its rows 0-2 see no key
    dout = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    def eager(q, k, v):
        return torch.softmax((q.double() @ k.double().transpose(-1, -2)) * D ** -0.5 + m.double(), -1) @ v.double()
    def grads(f):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o = f(qq, kk, vv); o.backward(dout.to(o.dtype))
        return o.double(), qq.grad.double(), kk.grad.double(), vv.grad.double()
    ref = grads(eager)
    for name, be in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            ctx = sdpa_kernel(be) if be is not None else torch.enable_grad()
            with ctx:
                got = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=m))
            out_whole = (got[0] - ref[0])[0, :, :3].abs().max().item()
            out_rest = (got[0] - ref[0])[:, :, 3:].abs().max().item()
            dq_whole = (got[1] - ref[1])[0, :, :3].abs().max().item()
            dk = (got[2] - ref[2]).abs().max().item(); dv = (got[3] - ref[3]).abs().max().item()
            print(f"{str(dtype)[6:]:9} {name:9} out(rows hidden whole) {out_whole:.2e} out(rest) {out_rest:.2e} "
                  f"dq(hidden rows) {dq_whole:.2e} dk {dk:.2e} dv {dv:.2e} (|dv| {ref[3].abs().max().item():.2e})")
        except Exception as e:
            print(f"{str(dtype)[6:]:9} {name:9} error {type(e).__name__}: {str(e)[:100]}")

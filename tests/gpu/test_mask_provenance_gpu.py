"""Mask provenance on the GPU (passes/_mask_provenance.py): a causal mask built by one graph of ours and read by the
attention of the next, with Inductor generating the code; at inference under our CUDA-graph capture (outputs
copied out of the pool: the mark must be on the copy the caller gets), and a Llama under ``fully_shard`` with
NCCL (one process) in training."""

import pytest
import torch

import kpt_compiler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S, D = 64, 32


def notes() -> list[str]:
    out = []
    for r in kpt_compiler.reports():
        out += r.notes
        try:
            out += r.pass_record("attention").notes
        except KeyError:
            pass
    return out


def test_a_mask_built_by_a_captured_graph_is_proven_causal_at_inference():
    def fn(q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)
        mask = torch.zeros(q.shape[-2], q.shape[-2], device=q.device, dtype=q.dtype).masked_fill(
            i[None, :] > i[:, None], torch.finfo(q.dtype).min)
        torch._dynamo.graph_break()
        return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + mask, -1) @ v

    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    c = torch.compile(fn, backend="kernelpytorch", options={"cudagraphs": {"decide": "always"}})
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    with torch.no_grad():
        reference = fn(q.double(), k.double(), v.double())
        for _ in range(4):  # compile, first calls, replays
            out = c(q, k, v)
            torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)
    found = notes()
    assert any("built by an earlier graph of ours" in n for n in found), found
    assert not any("another mask" in n for n in found), found


def test_fsdp2_llama_blocks_prove_the_mask_under_nccl(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg).cuda()
    sharded = transformers.LlamaForCausalLM(cfg).cuda()
    sharded.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(1)).cuda()
    reference(ids).logits.pow(2).mean().backward()
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    try:
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        c = torch.compile(sharded, backend="kernelpytorch")
        for _ in range(2):
            sharded.zero_grad()
            c(ids).logits.pow(2).mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    for n, p in reference.named_parameters():  # fp32; TF32 off by default in torch: Triton's and cuBLAS's sums
        torch.testing.assert_close(grads[n], p.grad, rtol=2e-3, atol=1e-5, msg=n)
    found = notes()
    assert sum("causal (mask proven lower-triangular, built by an earlier graph of ours" in n for n in found) >= 1, \
        found
    assert not any("another mask" in n for n in found), found

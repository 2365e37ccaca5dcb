"""A causal mask built in one graph of ours and read by the attention of another (issue 20: FSDP2 breaks the
graph at every block; here a graph break does the same): the later graph proves it causal from the earlier
graph's mark, each call checks the mark, and a call that passes another mask runs the graph as it was before.
passes/_mask_provenance.py says how."""

import gc

import pytest
import torch
import torch.nn.functional as F

import kpt_compiler
from kpt_compiler.passes import _mask_provenance as provenance

S, D = 16, 8


def causal_mask(n: int, dtype=torch.float64) -> torch.Tensor:
    i = torch.arange(n)
    return torch.zeros(n, n, dtype=dtype).masked_fill(i[None, :] > i[:, None], torch.finfo(dtype).min)


@torch._dynamo.disable
def _eager_write(mask: torch.Tensor) -> None:
    mask.add_(0)  # a write outside any graph: the values stay, the version moves


def attention(q, k, v, mask, sdpa: bool):
    if sdpa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + mask, -1) @ v


def model(sdpa: bool = False, write: bool = False):
    def f(q, k, v, mask=None):
        if mask is None:
            mask = causal_mask(q.shape[-2])  # built from sizes alone: the first graph's output
        torch._dynamo.graph_break()  # the attention lands in a graph of its own, which receives the mask
        if write:
            _eager_write(mask)
        return attention(q, k, v, mask, sdpa)
    return f


def qkv(grad: bool = False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, S, D, dtype=torch.float64, generator=g).requires_grad_(grad) for _ in range(3)]


def compiled(fn):
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    return torch.compile(fn, backend="kernelpytorch", options={"codegen": "eager"})


def attention_notes() -> list[str]:
    notes = []
    for r in kpt_compiler.reports():
        notes += r.notes  # what happens at the calls (the guard's misses)
        try:
            notes += r.pass_record("attention").notes
        except KeyError:
            pass
    return notes


@pytest.mark.parametrize("sdpa", [False, True], ids=["hand-written", "sdpa"])
def test_a_mask_built_by_an_earlier_graph_is_proven_causal_and_each_call_is_checked(sdpa):
    fn = model(sdpa)
    c = compiled(fn)
    q, k, v = qkv(grad=True)
    for _ in range(3):  # later calls: new mask tensors, each marked by the first graph
        out = c(q, k, v)
        torch.testing.assert_close(out, fn(q, k, v))
    notes = attention_notes()
    assert any("marked at each call" in n for n in notes), notes
    assert any("built by an earlier graph of ours" in n for n in notes), notes
    assert not any("another mask" in n for n in notes), notes
    grads = torch.autograd.grad(c(q, k, v).sum(), (q, k, v))
    expected = torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("sdpa", [False, True], ids=["hand-written", "sdpa"])
def test_a_call_with_another_mask_runs_the_graph_as_it_was(sdpa):
    fn = model(sdpa)
    c = compiled(fn)
    q, k, v = qkv()
    c(q, k, v)  # compiles the attention's graph with the marked causal mask
    padded = causal_mask(S)
    padded[:, -3:] = torch.finfo(torch.float64).min  # the same graph serves it (same sizes), causal no more
    torch.testing.assert_close(c(q, k, v, padded), fn(q, k, v, padded))
    assert any("another mask" in n for n in attention_notes())


def test_a_mask_written_after_it_was_built_is_not_taken_from_its_mark():
    fn = model(write=True)
    c = compiled(fn)
    q, k, v = qkv()
    torch.testing.assert_close(c(q, k, v), fn(q, k, v))
    assert not any("built by an earlier graph of ours" in n for n in attention_notes())


def test_a_mask_written_through_another_input_that_shares_its_memory_is_not_taken_from_its_mark():
    """The first graph returns the mask and a view of it; the next writes padding into one and attends with the
    other (found by a review: the write targets another input, which the check of the mask's own writes missed)."""
    def fn(q, k, v, pad):
        m2 = causal_mask(q.shape[-2])
        m4 = m2[None, None]
        torch._dynamo.graph_break()
        m2.masked_fill_(pad[None, :], torch.finfo(torch.float64).min)
        return attention(q, k, v, m4, sdpa=False)

    c = compiled(fn)
    q, k, v = qkv()
    pad = torch.zeros(S, dtype=torch.bool)
    pad[-3:] = True
    for _ in range(2):  # rows 0-2 see only padded keys (all hidden): compare the rest
        torch.testing.assert_close(c(q, k, v, pad)[:, :, 3:], fn(q, k, v, pad)[:, :, 3:])
    assert not any("built by an earlier graph of ours" in n for n in attention_notes())


def test_only_masks_are_marked():
    """A constant output that is no mask (zeros, a cache) is neither hashed nor marked."""
    def fn(x):
        buf = torch.zeros(x.shape[0], 8, dtype=torch.float64)
        torch._dynamo.graph_break()
        return x + buf.sum()

    c = compiled(fn)
    c(torch.ones(4))
    assert not any("marked at each call" in n for n in attention_notes())


def test_under_inference_mode_nothing_is_marked():
    """Inference tensors keep no version (a write into one would go unseen): the mask stays a dense input."""
    fn = model()
    c = compiled(fn)
    q, k, v = qkv()
    with torch.inference_mode():
        out = c(q, k, v)
        torch.testing.assert_close(out, fn(q, k, v))
    assert not any("built by an earlier graph of ours" in n for n in attention_notes())


def test_marks_follow_the_tensor_and_its_version():
    t = causal_mask(4)
    provenance.mark(t, "key")
    assert provenance.mark_of(t) == "key"
    assert provenance.mark_of(t.clone()) is None  # another tensor, the same values
    t.add_(0)
    assert provenance.mark_of(t) is None  # written into since
    provenance.mark(t, "key")
    n = len(provenance._MARKED)
    del t
    gc.collect()
    assert len(provenance._MARKED) == n - 1  # the mark goes with the tensor


def test_the_digest_names_the_values():
    a = causal_mask(4)
    assert provenance.digest(a) == provenance.digest(a.clone())
    assert provenance.digest(a) != provenance.digest(causal_mask(5)[:4, :4].contiguous().neg())
    assert provenance.digest(a) != provenance.digest(a.float())


def test_fsdp2_blocks_receive_the_causal_mask_and_prove_it(tmp_path):
    """The case this is for: a Llama with eager attention under ``fully_shard`` (one gloo process), compiled whole.
    Dynamo builds the causal mask in a graph of its own and compiles each block's forward apart; the blocks'
    attention is proven causal from the mark and the gradients equal eager's."""
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, attn_implementation="eager")
    torch.manual_seed(0)
    reference, sharded = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    sharded.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 128, (2, S), generator=torch.Generator().manual_seed(1))
    reference(ids).logits.pow(2).mean().backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        c = compiled(sharded)
        for _ in range(2):
            sharded.zero_grad()
            c(ids).logits.pow(2).mean().backward()
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in sharded.named_parameters()}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    for n, p in reference.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    notes = attention_notes()
    assert sum("causal (mask proven lower-triangular, built by an earlier graph of ours" in n for n in notes) >= 1, \
        notes
    assert not any("another mask" in n for n in notes), notes

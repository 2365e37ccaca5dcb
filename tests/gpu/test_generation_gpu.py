"""kpt_compiler.generation on CUDA: generate() with its stop check one step late over kpt's compiled forward and
CUDA graphs makes the tokens it makes without (issue 17)."""

import pytest
import torch

import kpt_compiler
from kpt_compiler.generation import deferred_stop_check, deferred_stop_supported

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
if not deferred_stop_supported():
    pytest.skip(f"transformers {transformers.__version__} has no DeferredStopCheck (5.24 or later)",
                allow_module_level=True)

from transformers.generation import utils as gen_utils  # noqa: E402


def _model():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.disable_compile = None, 0, True
    return model


def test_deferred_stop_gives_the_same_tokens_under_kpt_and_its_cuda_graphs(monkeypatch):
    model = _model()
    eager_forward = model.forward
    ids = torch.randint(0, 512, (1, 8), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(max_new_tokens=24, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    kpt_compiler.clear_reports()
    with torch.no_grad():
        model.forward = torch.compile(eager_forward, backend="kernelpytorch")
        plain = [model.generate(ids, **kw) for _ in range(2)]
        made, real_init = [], gen_utils.DeferredStopCheck.__init__

        def counting_init(self, *a, **k):
            made.append(1)
            real_init(self, *a, **k)

        monkeypatch.setattr(gen_utils.DeferredStopCheck, "__init__", counting_init)
        with deferred_stop_check():
            deferred = [model.generate(ids, **kw) for _ in range(2)]
        assert len(made) == 2  # generate() took the deferred check each time
        assert all(torch.equal(p, d) for p, d in zip(plain, deferred)), (plain[0], deferred[0])
        # the decode step's graph was captured by us (not handed to Inductor's trees, which decline a graph that
        # writes into its inputs): the deferral ran over CUDA-graph replays
        records = [p for r in kpt_compiler.reports() for p in r.passes() if p.name == "cudagraphs"]
        assert any(c.status == "applied" and c.stats.get("captured", 0) >= 1
                   and not any(n.startswith("Inductor declined") for n in c.notes) for c in records), [
            (c.status, c.stats, c.notes) for c in records]
        # an end-of-sequence met mid-way: the deferred check learns of it a step late and undoes the extra step
        eos = int(plain[0][0, ids.shape[1] + 10])
        model.generation_config.eos_token_id = eos
        stopped = model.generate(ids, **kw)
        with deferred_stop_check():
            stopped_deferred = model.generate(ids, **kw)
        assert len(made) == 3 and torch.equal(stopped, stopped_deferred), (made, stopped, stopped_deferred)
        assert stopped.shape[1] <= ids.shape[1] + 11 and int(stopped[0, -1]) == eos

"""kpt_compiler.generation: transformers' generate() with its stop check one step late on CUDA (issue 17). The
deferral itself waits on a torch.Event, which the CPU has not: here its switch, its conditions and its errors;
tests/gpu/test_generation_gpu.py runs it."""

import types

import pytest
import torch

from kpt_compiler.generation import deferred_stop_check, deferred_stop_supported

transformers = pytest.importorskip("transformers")
if not deferred_stop_supported():
    pytest.skip(f"transformers {transformers.__version__} has no DeferredStopCheck", allow_module_level=True)

from transformers.generation import utils as gen_utils  # noqa: E402

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _supported(device, cache=None, returned=False, assistant=False):
    return gen_utils.DeferredStopCheck.is_supported(device, cache, returned, assistant)


def test_the_block_turns_the_deferral_on_for_cuda_and_off_again():
    assert not _supported(CUDA)  # transformers' own choice: mps only
    original = gen_utils.DeferredStopCheck.__dict__["is_supported"]
    with deferred_stop_check():
        assert _supported(CUDA) and _supported("cuda")
        assert not _supported(CPU)  # devices not named keep transformers' answer
    assert not _supported(CUDA) and gen_utils.DeferredStopCheck.__dict__["is_supported"] is original
    with pytest.raises(KeyError):
        with deferred_stop_check():
            raise KeyError("the block failed")
    assert gen_utils.DeferredStopCheck.__dict__["is_supported"] is original  # restored on the way out too


def test_transformers_own_conditions_still_hold_inside():
    # an assistant model, or a cache that outlives the call and cannot be cropped back by the extra step: no deferral
    fixed = types.SimpleNamespace(is_croppable=False)
    croppable = types.SimpleNamespace(is_croppable=True)
    with deferred_stop_check():
        assert not _supported(CUDA, assistant=True)
        assert not _supported(CUDA, cache=fixed, returned=True)
        assert _supported(CUDA, cache=fixed, returned=False) and _supported(CUDA, cache=croppable, returned=True)


def test_generate_on_the_cpu_is_unchanged_inside_the_block():
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 5))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
    before = model.generate(ids, **kw)
    with deferred_stop_check():
        inside = model.generate(ids, **kw)
    assert torch.equal(before, inside) and before.shape == (1, 11)


class _DoneEvent:
    """A torch.Event stand-in for the CPU, always complete (the CPU's work is done when the host gets there)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


def test_the_deferred_check_itself_keeps_greedy_tokens_and_stops_at_the_end_of_sequence(monkeypatch):
    # run transformers' deferred path on the CPU (an event stand-in): the same tokens with and without it, also where
    # an end-of-sequence token stops generation and the step made past it is undone
    from kpt_compiler import generation

    monkeypatch.setattr(torch, "Event", _DoneEvent)
    monkeypatch.setattr(generation, "_NO_EVENTS", ())
    made, real_init = [], gen_utils.DeferredStopCheck.__init__

    def counting_init(self, *args, **kwargs):
        made.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(gen_utils.DeferredStopCheck, "__init__", counting_init)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=10, do_sample=False, cache_implementation="static", pad_token_id=0)
    plain = model.generate(ids, **kw)
    with deferred_stop_check(devices=("cpu",)):
        deferred = model.generate(ids, **kw)
    assert made == [1] and torch.equal(plain, deferred)
    eos = int(plain[0, 5 + 4])  # its first place in the tokens is where both stop
    stop = 5 + next(i for i in range(10) if int(plain[0, 5 + i]) == eos) + 1
    model.generation_config.eos_token_id = eos
    plain_eos = model.generate(ids, **kw)
    with deferred_stop_check(devices=("cpu",)):
        deferred_eos = model.generate(ids, **kw)
    assert made == [1, 1] and torch.equal(plain_eos, deferred_eos) and plain_eos.shape == (1, stop)


def test_bad_devices_and_an_old_transformers_get_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="CPU does not have"):
        with deferred_stop_check(devices=("cpu",)):
            pass
    for bad in ((), ("cuda:0",), ("",)):
        with pytest.raises(ValueError, match="name device types"):
            with deferred_stop_check(devices=bad):
                pass
    monkeypatch.delattr(gen_utils, "DeferredStopCheck")
    assert not deferred_stop_supported()
    with pytest.raises(RuntimeError, match=r"transformers 5\.24 or later .* this is transformers"):
        with deferred_stop_check():
            pass

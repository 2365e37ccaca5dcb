"""kernelpytorch under torch.distributed on the CPU (issue 20): two gloo processes train a small GPT one step
under DDP (whose DDPOptimizer cuts Dynamo's graph at gradient-bucket boundaries), under DDP with
``optimize_ddp`` off (one graph), and under FSDP2 (``fully_shard``), compiled with our backend (codegen eager). Each run's gradients must be the single-process run's on the whole batch,
our passes must fire on each rank, each rank's report must carry its rank and go to its own dump folder, and a
graph that is a piece of DDP's split must say so in its report."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
BATCH, SEQ, VOCAB = 4, 32, 128
RUNS = ("ddp", "ddp-whole", "fsdp2")


def _model():
    from kpt_compiler.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=SEQ, vocab_size=VOCAB))  # 0.8 MB a block


def _batch():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(out):
    logits = out[0] if isinstance(out, tuple) else out
    return logits.float().pow(2).mean()


def _wrap(model, run):
    if run == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)  # its first bucket holds 1 MB: DDPOptimizer cuts this 1.7 MB model in two


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    import kpt_compiler

    results = {}
    share = BATCH // WORLD
    for run in RUNS:
        torch._dynamo.reset()
        kpt_compiler.clear_reports()
        model = _model()
        compiled = torch.compile(_wrap(model, run), backend="kernelpytorch",
                                 options={"codegen": "eager", "dump_dir": os.path.join(out_dir, run)})
        with torch._dynamo.config.patch(optimize_ddp=run != "ddp-whole"):
            _loss(compiled(_batch()[rank * share:(rank + 1) * share])).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: a DTensor shard
            grads[name] = g.detach().clone()
        reports = kpt_compiler.reports()
        results[run] = {"grads": grads, "ranks": [r.rank for r in reports], "fired": [r.fired() for r in reports],
                        "notes": [r.notes for r in reports]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(out / "init"), str(out)), nprocs=WORLD)
    results = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    model = _model()
    _loss(model(_batch())).backward()
    reference = {name: p.grad for name, p in model.named_parameters()}
    return out, results, reference


@pytest.mark.parametrize("run", RUNS)
def test_gradients_are_the_single_process_runs_on_every_rank(runs, run):
    _, results, reference = runs
    for rank, result in enumerate(results):
        grads = result[run]["grads"]
        assert set(grads) == set(reference), (run, rank)
        for name, g in grads.items():
            err = ((g - reference[name]).norm() / reference[name].norm()).item()
            assert err < 1e-5, (run, rank, name, err)


@pytest.mark.parametrize("run", RUNS)
def test_the_passes_fire_on_each_rank_and_each_rank_reports_into_its_own_folder(runs, run):
    out, results, _ = runs
    for rank, result in enumerate(results):
        assert result[run]["ranks"] and set(result[run]["ranks"]) == {rank}, result[run]["ranks"]
        assert any("attention" in fired for fired in result[run]["fired"]), result[run]["fired"]
        folder = out / run / f"rank{rank}"
        assert (folder / ".kernelpytorch-dump").exists() and len(os.listdir(folder)) > 1, os.listdir(folder)


def test_a_piece_of_ddps_split_says_so_and_how_to_have_fewer_cuts(runs):
    _, results, _ = runs
    for result in results:
        split = result["ddp"]
        assert len(split["notes"]) > 1, split  # several graphs: DDPOptimizer cut the one Dynamo captured
        pieces = [n for notes in split["notes"] for n in notes if n.startswith("DDP split")]
        assert len(pieces) == len(split["notes"]), split["notes"]
        assert all("optimize_ddp = False" in n and "bucket_cap_mb" in n for n in pieces), pieces
        for run in ("ddp-whole", "fsdp2"):  # one graph each, whole
            assert len(result[run]["notes"]) == 1, result[run]
            assert not any(n.startswith("DDP split") for n in result[run]["notes"][0]), result[run]["notes"]

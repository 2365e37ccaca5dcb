"""A training step on one GPU and on several (issue 20): kernelpytorch against Inductor, bare, under DDP and under
FSDP2, with tokens per second and the scaling from one GPU.

    python -m benchmarks.bench_train_dist [--model llama-eager] [--gpus 2] [--modes inductor,kpt[,inductor-ro,kpt-ro]]
                                          [--setups 1gpu,ddp,fsdp2,fsdp2-blocks] [--steps 30] [--out DIR]
                                          [--batch N] [--device cuda|cpu]

Each setup runs in new processes (``torch.multiprocessing.spawn``, one per GPU, NCCL; on the CPU gloo) over a new
Inductor cache folder; the modes share them, each with its own copy of the model, timed in turn (five rounds of
``--steps`` / 5 steps each), so that a slow spell of the machine falls on all of them (Inductor's DDP step on the
H200s went from 26.6 to 18.6 ms between two runs of one mode, results/nvidia-h200/2026-11-27-s17-train-dist-*).
Every rank builds the zoo model (benchmarks/zoo.py, its training case: batch x seq tokens per rank, bf16 on CUDA
and fp32 on the CPU), wraps it (``1gpu``: one process, no wrapper; ``ddp``: DistributedDataParallel with Dynamo's
DDPOptimizer on, as by default; ``fsdp2``: ``fully_shard`` on each block and then the model, the whole compiled,
where Dynamo breaks the graph at FSDP2's hooks (a graph per block and pieces around them: the reports count them);
``fsdp2-blocks``: each block compiled on its own before sharding, as torchtitan does, and the rest eager), compiles
it, and times ``--steps`` steps of forward, cross-entropy against fixed random tokens, backward and AdamW
(foreach), each step ended by a device synchronisation, after three untimed steps (the first compiles: its seconds
are the compile column, in which the first mode of a process also pays the process's one-time costs and fills the
cache folder the next one reads; the peak memory is that of the mode's warm-up, which the modes before it add to).
The batch per GPU is fixed, so N GPUs process N times the tokens: scaling = tokens/s on N GPUs / tokens/s on one,
for the same mode (N is ideal). Rank 0's times; the noise is (p80 - p20) / median over the steps. ``--profile DIR``
profiles five more steps of each mode after the timing (rank 0's kernels by device time, NCCL's share in the rows).
Modes ``inductor-ro`` and ``kpt-ro`` compile with ``mode="reduce-overhead"`` (Inductor's cudagraph trees over
forward and backward; kpt's option of that name), each step marked with ``cudagraph_mark_step_begin``, and are
compared with each other: is the step bound by the host's launches? Mode ``kpt-cg`` asks the same of kpt's
cudagraphs pass (``options={"cudagraphs": {"decide": "always"}}``, outputs copied out of the pool as by default)
and is compared with ``inductor-ro``. ``--out DIR`` writes bench_train_dist.json
and .md (card, date, commit, command). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0), as the lent machines ask. """

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import tempfile
import time

import torch


from .bench_rms_norm import write_out
from .outputs import run_meta

MODES = ("inductor", "kpt")
# with CUDA graphs (Inductor's cudagraph trees, forward and backward): mode="reduce-overhead" for both backends
# and kpt-cg: kpt's cudagraphs pass asked to capture the training graphs (decide="always"), default mode
KNOWN_MODES = MODES + ("inductor-ro", "kpt-ro", "kpt-cg")
GRAPH_MODES = ("inductor-ro", "kpt-ro", "kpt-cg")
SETUPS = ("1gpu", "ddp", "fsdp2", "fsdp2-blocks")
WARMUP = 3
ROUNDS = 5
PROFILE_STEPS = 5


def _wrap(model: torch.nn.Module, setup: str, device: str) -> torch.nn.Module:
    if setup == "1gpu":
        return model
    if setup.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer: the longest ModuleList's children."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks for fully_shard")
    return list(max(lists, key=len))


def _worker(rank: int, world: int, init_file: str, spec: dict, result_file: str) -> None:
    import torch.distributed as dist

    import kpt_compiler

    from .measure import prepare
    from .zoo import cases

    device = spec["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    if spec["setup"] != "1gpu":  # ddp and fsdp2 need a process group, of one process too (--gpus 1)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}",
                               rank=rank, world_size=world)
    (entry, case), = [(e, c) for e, c in cases("full", device, [spec["model"]]) if c.task == "training"][:1]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch = spec.get("batch") or case.batch
    steps, times, losses, peak, reports = {}, {}, {}, {}, {}
    for mode in spec["modes"]:  # each mode its own copy of the model (same seed), wrapper and optimizer
        model, make_inputs = prepare(entry, device, dtype)
        model.train()
        # the zoo's inputs come from a fixed seed: every rank sees the same tokens (the timing does not depend on them)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in make_inputs(batch, case.seq, device))
        steps[mode] = _make_step(model, inputs, mode, spec["setup"], device, rank)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times[mode], losses[mode] = [], []
        before = len(kpt_compiler.reports())
        for _ in range(WARMUP):  # the first compiles
            _timed(steps[mode], times[mode], losses[mode])
        reports[mode] = kpt_compiler.reports()[before:]  # our backend's graphs of this mode (Inductor's: none)
        peak[mode] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    for _ in range(ROUNDS):  # in turn, so that a slower spell of the machine falls on every mode
        for mode in spec["modes"]:
            for _ in range(max(1, spec["steps"] // ROUNDS)):
                _timed(steps[mode], times[mode], losses[mode])
    profiles = {mode: _profile(steps[mode], spec, mode, rank) for mode in spec["modes"]} if spec.get("profile") else {}
    if rank == 0:
        rows = []
        for mode in spec["modes"]:
            timed = times[mode][WARMUP:]
            q = statistics.quantiles(timed, n=10, method="inclusive")  # deciles: q[1] p20, q[7] p80
            median = statistics.median(timed)
            rows.append({
                "model": entry.name, "shape": f"{batch}x{case.seq}", "setup": spec["setup"], "gpus": world,
                "mode": mode, "compile_s": times[mode][0], "ms": median * 1e3, "noise": (q[7] - q[1]) / median,
                "steps": len(timed), "tokens_s": world * batch * case.seq / median,
                "first_loss": losses[mode][0], "last_loss": losses[mode][-1],
                "graphs": len(reports[mode]),
                "ddp_pieces": sum(any(n.startswith("DDP split") for n in r.notes) for r in reports[mode]),
                "fired": sorted({p for r in reports[mode] for p in r.fired()}),
                "peak_mib": peak[mode], **profiles.get(mode, {})})
        with open(result_file, "w") as f:
            json.dump(rows, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def _annotation(name: str) -> bool:
    """A range the profiler records on the device for an annotation, not a kernel (older torch does not flag
    them ``is_user_annotation``)."""
    return (name.startswith(("nccl:", "aten::", "c10d::", "ProfilerStep")) or name == "record_param_comms"
            or name.endswith(".forward") or "#" in name)


def _profile(step, spec: dict, mode: str, rank: int) -> dict:
    """PROFILE_STEPS more steps, under torch.profiler on rank 0 (every rank runs them: they hold collectives).
    Writes ``<profile>/<setup>-<mode>.txt``, the kernels by device time, and returns per step: the device time
    of NCCL's kernels, of all kernels, and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    if rank:
        for _ in range(PROFILE_STEPS):
            step()
        return {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if spec["device"] == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof, _graph_copies() as copies:
        for _ in range(PROFILE_STEPS):
            step()
    wall = (time.perf_counter() - t0) / PROFILE_STEPS
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # the kernels themselves: a CPU op's event also carries the device time of the kernels it launched, and the
    # device-side ranges of annotations (DistributedDataParallel.forward, Optimizer.step#AdamW.step,
    # nccl:all_reduce, record_param_comms) are device events too: counted, they doubled DDP's device time in the
    # first profile (results/nvidia-h100-80gb-hbm3/2026-11-27-s18-train-dist-prof-3153a9e/)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and device_us(e) > 0
               and not getattr(e, "is_user_annotation", False) and not _annotation(e.key)]
    nccl = sum(device_us(e) for e in kernels if "nccl" in e.key.lower())
    total = sum(device_us(e) for e in kernels)
    # the timeline: how long the device was busy, and how much of NCCL's time no other kernel ran beside it (the
    # communication the step waits for)
    spans = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower()) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
             and not _annotation(e.name) and e.time_range.end > e.time_range.start]
    busy_us, exposed_us = timeline(spans)
    os.makedirs(spec["profile"], exist_ok=True)
    with open(os.path.join(spec["profile"], f"{spec['setup']}-{mode}.txt"), "w") as f:
        f.write(f"# {spec['setup']} {mode}, rank 0, {PROFILE_STEPS} steps: wall {wall * 1e3:.2f} ms/step, device "
                f"{total / 1e3 / PROFILE_STEPS:.2f} ms/step of which NCCL {nccl / 1e3 / PROFILE_STEPS:.2f}\n")
        sort = "self_cuda_time_total" if spec["device"] == "cuda" else "self_cpu_time_total"
        f.write(f"# device busy {busy_us / 1e3 / PROFILE_STEPS:.2f} ms/step; NCCL with no other kernel beside it "
                f"{exposed_us / 1e3 / PROFILE_STEPS:.2f} ms/step\n")
        f.write(events.table(sort_by=sort, row_limit=30, max_name_column_width=90))
        n_copies, n_bytes = (sum(v[i] for v in copies.values()) / PROFILE_STEPS for i in (0, 1))
        f.write(f"\n# cudagraph trees' input copies per step: {n_copies:g}, {n_bytes / 2**20:.1f} MiB; by graph "
                "input (copies, MiB):\n")
        for name, (n, b) in sorted(copies.items(), key=lambda kv: -kv[1][1]):
            f.write(f"#   {name}: {n / PROFILE_STEPS:g}, {b / 2**20 / PROFILE_STEPS:.2f}\n")
        f.write("\n# every kernel: device ms per step, calls per step, name\n")
        for e in sorted(kernels, key=device_us, reverse=True):
            f.write(f"{device_us(e) / 1e3 / PROFILE_STEPS:9.4f} {e.count / PROFILE_STEPS:7.1f}  {e.key}\n")
    return {"profile_wall_ms": wall * 1e3, "device_ms": total / 1e3 / PROFILE_STEPS,
            "nccl_ms": nccl / 1e3 / PROFILE_STEPS, "busy_ms": busy_us / 1e3 / PROFILE_STEPS,
            "nccl_exposed_ms": exposed_us / 1e3 / PROFILE_STEPS}


@contextlib.contextmanager
def _graph_copies():
    """Counts what Inductor's cudagraph trees copy into their graphs' static inputs at each replay (the inputs
    neither static nor made by an earlier graph of the tree): {graph input's name: [copies, bytes]}. Under DDP
    kpt's pieces made 96 device copies per step and Inductor's 77 (session 24): this says which inputs."""
    counts: dict = {}
    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:
        yield counts
        return
    real = trees.CUDAGraphNode._copy_inputs_and_remove_from_src

    def counted(node, dsts, srcs):
        names = [getattr(p, "name", "?") for p in getattr(node.wrapped_function, "placeholders", [])]
        for idx in node.non_static_input_idx:
            if isinstance(srcs[idx], torch.Tensor):
                key = names[idx] if idx < len(names) else f"input {idx}"
                entry = counts.setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] += srcs[idx].numel() * srcs[idx].element_size()
        return real(node, dsts, srcs)

    trees.CUDAGraphNode._copy_inputs_and_remove_from_src = counted
    try:
        yield counts
    finally:
        trees.CUDAGraphNode._copy_inputs_and_remove_from_src = real


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def timeline(spans: list[tuple[float, float, bool]]) -> tuple[float, float]:
    """(the time some kernel ran, the time a communication kernel ran with no other kernel beside it), from
    (start, end, is_communication) spans on the device's clock (several streams)."""
    everything = _union([(a, b) for a, b, _ in spans])
    comm = _union([(a, b) for a, b, c in spans if c])
    compute = _union([(a, b) for a, b, c in spans if not c])
    overlap, j = 0.0, 0
    for a, b in comm:
        while j < len(compute) and compute[j][1] <= a:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < b:
            overlap += min(b, compute[k][1]) - max(a, compute[k][0])
            k += 1
    return sum(b - a for a, b in everything), sum(b - a for a, b in comm) - overlap


def _make_step(model: torch.nn.Module, inputs: tuple, mode: str, setup: str, device: str, rank: int):
    import torch.nn.functional as F

    from kpt_compiler.bench import first_tensor

    graphs = mode in GRAPH_MODES
    backend = "kernelpytorch" if mode.startswith("kpt") else "inductor"
    how = {"options": {"cudagraphs": {"decide": "always"}}} if mode == "kpt-cg" else {} if not graphs else \
        {"options": {"mode": "reduce-overhead"}} if backend == "kernelpytorch" else {"mode": "reduce-overhead"}
    if setup == "fsdp2-blocks":  # torchtitan's way: each block compiled in place, then sharded
        for block in _blocks(model):
            block.compile(backend=backend, **how)
        fn = _wrap(model, setup, device)
    else:
        fn = torch.compile(_wrap(model, setup, device), backend=backend, **how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    target = None

    def step() -> float:
        nonlocal target
        if graphs:  # a new step: the trees may reuse the last step's memory
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        out = first_tensor(fn(*inputs)).flatten(0, -2).float()
        if target is None:
            g = torch.Generator().manual_seed(1000 + rank)  # not the inputs' seed: next tokens, not the same
            target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g).to(device)
        loss = F.cross_entropy(out, target)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    return step


def _timed(step, times: list[float], losses: list[float]) -> None:
    t0 = time.perf_counter()
    losses.append(step())
    times.append(time.perf_counter() - t0)


def spawn_with_timeout(fn, fn_args: tuple, world: int, timeout: float | None) -> None:
    """``mp.spawn`` that gives up after ``timeout`` seconds: the processes are killed and TimeoutError says so (a
    rank stuck in a collective its peer never joins would otherwise hold the run, and CI, for good)."""
    import torch.multiprocessing as mp

    context = mp.spawn(fn, args=fn_args, nprocs=world, join=False)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(timeout=5):
        if deadline is not None and time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
            raise TimeoutError(f"the {world} process(es) did not finish in {timeout:.0f} s")


def _sleep(rank: int, seconds: float) -> None:  # a process that outlives a short timeout (tests)
    time.sleep(seconds)


def run_setup(setup: str, modes: list[str], gpus: int, args: argparse.Namespace) -> list[dict]:
    world = 1 if setup == "1gpu" else gpus
    spec = {"device": args.device, "model": args.model, "setup": setup, "modes": modes, "steps": args.steps,
            "profile": args.profile, "batch": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # the children inherit it
        result = os.path.join(tmp, "rows.json")
        try:
            spawn_with_timeout(_worker, (world, os.path.join(tmp, "init"), spec, result), world, args.timeout)
            with open(result) as f:
                rows = json.load(f)
        except Exception as e:  # noqa: BLE001 - one setup's failure is a row that says so
            error = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            rows = [{"model": args.model, "setup": setup, "gpus": world, "mode": m, "error": error} for m in modes]
    for row in rows:
        print(f"{setup} x{world} {row['mode']}: " + (
            f"{row['ms']:.2f} ms/step, {row['tokens_s']:.0f} tokens/s, compile {row['compile_s']:.1f} s"
            if "ms" in row else row["error"]), flush=True)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """scaling (against the same mode on one GPU) and kpt / Inductor (same setup; with CUDA graphs, against
    Inductor with them), where both rows ran."""
    by = {(r["setup"], r["mode"]): r for r in rows if "ms" in r}
    for r in rows:
        one = by.get(("1gpu", r["mode"]))
        if "ms" in r and one:
            r["scaling"] = r["tokens_s"] / one["tokens_s"]
        reference = "inductor-ro" if r["mode"] in GRAPH_MODES else "inductor"
        ind = by.get((r["setup"], reference))
        if "ms" in r and ind and r["mode"] != reference:
            r["vs_inductor"] = ind["ms"] / r["ms"]


def markdown(rows: list[dict], command: str, card: str, commit: str | None) -> str:
    lines = [f"# A training step on 1 and more GPUs: {card}", "",
             f"- date: {datetime.date.today()}; commit: {commit}; torch {torch.__version__}",
             f"- command: `{command}`",
             "- a step: forward, cross-entropy, backward, AdamW; ms: rank 0's median step; tokens/s: all GPUs; "
             "scaling: tokens/s against the same mode on one GPU; vs Inductor: Inductor's ms / this row's, same "
             "setup", "",
             "| model | tokens per GPU | setup | GPUs | mode | compile s | ms/step | noise | tokens/s | scaling | "
             "vs Inductor | graphs (DDP pieces) | peak MiB | passes fired | loss first, last | profiled ms/step: "
             "wall, kernels (NCCL), device busy, NCCL alone |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | - | {r['setup']} | {r['gpus']} | {r['mode']} | error: {r['error']} |"
                         + " |" * 10)
            continue
        graphs = f"{r['graphs']} ({r['ddp_pieces']})" if r["mode"].startswith("kpt") else "-"
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['shape']} | {r['setup']} | {r['gpus']} | {r['mode']} | {r['compile_s']:.1f} | "
            f"{r['ms']:.2f} | {r['noise']:.1%} | {r['tokens_s']:.0f} | "
            + (f"{r['scaling']:.2f}x" if "scaling" in r else "-") + " | "
            + (f"{r['vs_inductor']:.2f}x" if "vs_inductor" in r else "-") + f" | {graphs} | {peak} | "
            f"{', '.join(r['fired']) or '-'} | {r['first_loss']:.3f}, {r['last_loss']:.3f} | "
            + (f"{r['profile_wall_ms']:.2f}, {r['device_ms']:.2f} ({r['nccl_ms']:.2f}), {r['busy_ms']:.2f}, "
               f"{r['nccl_exposed_ms']:.2f} |" if "device_ms" in r else "- |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a zoo entry with a training case (default: llama-eager on CUDA, "
                                                 "tiny-gpt on the CPU)")
    p.add_argument("--gpus", type=int, default=2, help="processes of the ddp and fsdp2 setups")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=None, help="seconds a setup's processes may take; past them "
                   "they are killed and the setup's rows say so (default: no limit)")
    p.add_argument("--profile", default=None, help="after the timing, profile 5 more steps of each mode on rank 0 "
                   "and write the kernels by device time here (<setup>-<mode>.txt); the rows get NCCL's and all "
                   "kernels' device time per step")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="write bench_train_dist.json and bench_train_dist.md here")
    p.add_argument("--batch", type=int, default=None, help="sequences per GPU (default: the zoo's training case; "
                   "a larger one tells whether the host or the device sets the step)")
    args = p.parse_args(argv)
    args.model = args.model or ("llama-eager" if args.device == "cuda" else "tiny-gpt")
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"error: --gpus {args.gpus} but this machine has {torch.cuda.device_count()} GPU(s)")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(name, value)
    unknown = sorted(set(m for m in args.modes.split(",") if m) - set(KNOWN_MODES))
    if unknown:
        raise SystemExit(f"error: unknown mode(s) {unknown}; known: {', '.join(KNOWN_MODES)}")
    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        raise SystemExit(f"error: unknown setup(s) {unknown}; known: {', '.join(SETUPS)}")
    meta = run_meta("bench_train_dist", argv, args.device)
    rows: list[dict] = []
    for setup in setups:
        rows += run_setup(setup, [m for m in args.modes.split(",") if m], args.gpus, args)
        add_ratios(rows)
        table = markdown(rows, meta["command"], meta["card"], meta["commit"])
        write_out(args.out, "bench_train_dist", meta, rows, table)  # after each setup: a killed run keeps them
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

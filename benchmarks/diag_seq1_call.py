"""Where the sequence-1 call of the 200-call Llama stream spends its time (issue 17; call 194 of the stream took
6.3-8.8 s in pass 1 on the H100 against 2.1-3.1 s of Dynamo frame compile). Six calls of the stream's sizes
through kpt with bucketing and CUDA graphs, in one process, each call's wall time and Dynamo's frame compiles;
cProfile over the 1x383 and 1x1 calls; the last graph's report notes. GPU only:

    PYTHONPATH=. python benchmarks/diag_seq1_call.py

(Run in session 45 as .gpu/probe194.py, the same code: benchmarks/results/nvidia-h100-80gb-hbm3/2026-12-07-s45-*.)
"""
import cProfile, io, os, pstats, sys, tempfile, time
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp()); os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
import torch
import kpt_compiler
from kpt_compiler.models import zoo
from torch._dynamo import utils as du
torch.manual_seed(0)
model, make = zoo.llama(attn="eager")
model = model.to("cuda", torch.bfloat16).eval()
w = torch.compile(lambda a: (a * 2).sum(), backend="inductor"); w(torch.ones(8, device="cuda")); torch._dynamo.reset()
cm = torch.compile(model, backend="kernelpytorch", options={"bucketing": True, "cudagraphs": True})
sizes = [(13, 1723), (2, 1061), (5, 51), (1, 383), (12, 384), (1, 1)]
with torch.no_grad():
    for b, s in sizes:
        x = make(b, s, "cuda")[0]
        n = len(du.get_compilation_metrics())
        torch.cuda.synchronize(); t = time.perf_counter()
        pr = cProfile.Profile() if (b, s) in ((1, 1), (1, 383)) else None
        if pr: pr.enable()
        cm(x); torch.cuda.synchronize()
        if pr: pr.disable()
        ms = du.get_compilation_metrics()[n:]
        print(f"{b}x{s}: {time.perf_counter() - t:.2f} s; frame compiles {[round(m.entire_frame_compile_time_s or 0, 2) for m in ms]}", flush=True)
        if pr:
            st = io.StringIO(); p = pstats.Stats(pr, stream=st); p.sort_stats("cumulative").print_stats(45)
            p.sort_stats("tottime").print_stats(15)
            print("\n".join(l[:170] for l in st.getvalue().splitlines()[:130]))
rep = kpt_compiler.reports()[-1]
print("last graph notes:", [n[:200] for n in rep.notes][:6])
for p in rep.passes():
    if p.notes: print(p.name, [n[:160] for n in p.notes][:4])

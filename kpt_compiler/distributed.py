"""What the backend needs to know of torch.distributed (issue 20): this process's rank, and whether the graph it
compiles is a piece of DDP's split.

Under ``DistributedDataParallel`` Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default)
cuts the captured graph at the boundaries of DDP's gradient buckets, so that the all-reduce of one bucket can
overlap the backward of the next, and hands each piece to the backend on its own. A pattern that spans a cut
(an attention block whose projections and softmax fall in two buckets) is two halves, and no pass sees it
whole. The report of each piece says so, with the two ways to fewer cuts.
"""

from __future__ import annotations

import os
import sys

_DDP_FILE = os.path.join("_dynamo", "backends", "distributed.py")


def rank() -> int | None:
    """This process's rank where torch.distributed runs more than one process, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


def ddp_split() -> str | None:
    """A note for the report when the graph being compiled is a piece of DDPOptimizer's split (read off the
    calling frames: DDPOptimizer.compile_fn holds the buckets, SubmodCompiler.run_node the piece), else None."""
    piece, buckets = None, None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_DDP_FILE):
            local = frame.f_locals
            if code.co_name == "run_node" and piece is None and hasattr(local.get("n"), "target"):
                piece = str(local["n"].target)
            if code.co_name == "compile_fn" and isinstance(local.get("buckets"), list):
                buckets = len(local["buckets"])
        frame = frame.f_back
    if piece is None and buckets is None or buckets == 1:  # one bucket: DDPOptimizer passes the graph whole
        return None
    of = f" of {buckets}" if buckets else ""
    return (f"DDP split: this graph is one piece ({piece or '?'}){of} of Dynamo's graph, cut by DDPOptimizer at "
            "DDP's gradient-bucket boundaries; a pattern across a cut is seen as two halves and not rewritten. "
            "Fewer cuts: a larger DDP(bucket_cap_mb=...), or torch._dynamo.config.optimize_ddp = False (one "
            "graph; DDP then overlaps less of its all-reduce with the backward)")

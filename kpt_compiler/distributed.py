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


def _split_frames() -> tuple[str | None, int | None, dict | None, object]:
    """Read off the calling frames while DDPOptimizer compiles a piece: the piece's name (SubmodCompiler.run_node
    holds it), the number of buckets, each node's piece and the whole graph (DDPOptimizer.compile_fn holds them);
    Nones outside a split."""
    piece, buckets, partition, whole = None, None, None, None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_DDP_FILE):
            local = frame.f_locals
            if code.co_name == "run_node" and piece is None and hasattr(local.get("n"), "target"):
                piece = str(local["n"].target)
            if code.co_name == "compile_fn" and isinstance(local.get("buckets"), list):
                buckets = len(local["buckets"])
                partition = local.get("partition_map") if isinstance(local.get("partition_map"), dict) else None
                whole = local.get("gm")
        frame = frame.f_back
    return piece, buckets, partition, whole


def ddp_split() -> list[str]:
    """Notes for the report when the graph being compiled is a piece of DDPOptimizer's split: that it is a piece,
    and each pattern of our passes that the split cut whose first node lies in this piece (so that each cut is
    said once)."""
    piece, buckets, partition, _ = _split_frames()
    if piece is None and buckets is None or buckets == 1:  # one bucket: DDPOptimizer passes the graph whole
        return []
    of = f" of {buckets}" if buckets else ""
    notes = [f"DDP split: this graph is one piece ({piece or '?'}){of} of Dynamo's graph, cut by DDPOptimizer at "
             "DDP's gradient-bucket boundaries; a pattern across a cut is seen as two halves and not rewritten. "
             "Fewer cuts: a larger DDP(bucket_cap_mb=...), or torch._dynamo.config.optimize_ddp = False (one "
             "graph; DDP then overlaps less of its all-reduce with the backward)"]
    if partition and piece and piece.startswith("submod_") and piece[7:].isdigit():
        here = int(piece[7:])
        notes += [f"DDP split near miss: the cut between {' and '.join(f'submod_{i}' for i in pieces)} runs through "
                  f"{what}: no pass sees it whole" for first, what, pieces in cut_patterns(partition) if first == here]
    return notes


def cut_patterns(partition: dict) -> list[tuple[int, str, list[int]]]:
    """The patterns of our passes in DDPOptimizer's whole graph whose nodes fall in more than one piece, found by
    the passes' own matchers: (the piece of the first node, what and where, the pieces) for attention
    (passes/_attention_match.py), parallel linears of one input (merge-parallel-linears' groups, which
    fuse-gated-linear's gate and up are too), an add feeding a norm (fuse-add-norm, Llama's hand-written RMSNorm
    included) and a linear's epilogue (fuse-linear-epilogue). ``partition`` maps each node but the placeholders
    and the output to its piece."""
    from kpt_compiler.passes import _attention_match, fuse_add_norm, fuse_linear_epilogue, merge_parallel_linears

    from . import torch_ir as ir

    if not partition:
        return []
    index = {n: i for i, n in enumerate(next(iter(partition)).graph.nodes)}  # graph order (the map's is not)
    found = []

    def cut(nodes: list, what: str) -> None:
        nodes = sorted((n for n in nodes if n in partition), key=index.__getitem__)
        pieces = sorted({partition[n] for n in nodes})
        if len(pieces) > 1:
            found.append((partition[nodes[0]], f"{what} (from {nodes[0].name})", pieces))

    for node in index:  # every node: a placeholder's users may be parallel linears
        if ir.kind(node) == "softmax":
            attention = _attention_match.match(node)
            if isinstance(attention, _attention_match.Attention):
                cut([*attention.chain, attention.out], "attention")
        if ir.kind(node) == "linear":
            last = fuse_linear_epilogue._epilogue_of(node)[0]
            if last is not node:
                cut([node, last], "a linear and its epilogue")
        norm = fuse_add_norm._norm_call(node)
        if norm is not None and ir.kind(norm[0]) == "add":
            cut([norm[0], node], f"add + {norm[-1]}")
        for group in merge_parallel_linears._groups(node).values():
            if len(group) > 1:
                cut(group, f"{len(group)} parallel linears of {node.name}")
    return found


def values_before_cut(node, max_elements: int, usable=lambda source: True) -> dict:
    """In a piece of DDPOptimizer's split, the inputs ``node`` depends on whose values the whole graph computes
    from no input (a causal mask built in the first piece, which every later layer's piece receives as an
    input): each such input of the piece and its value, computed in the whole graph. Empty outside a split, or
    where any input that ``node`` depends on depends on a real input (it then is not known at compile time) or
    is not ``usable`` (the caller's check of the whole graph's node: nothing writes into it, for a mask).
    An input is matched to the whole graph's node by name and by the example value ``split_module`` copies from
    that node (its names are not always the node's: it lowercases camelCase, so two nodes may share one); the
    pieces are called only from the split module, so such an input has this value at every call."""
    import torch.fx as fx

    from . import torch_ir as ir

    inputs = [n for n in ir.ancestors(node) if n.op == "placeholder"]
    whole = _split_frames()[3] if inputs else None
    if not isinstance(whole, fx.GraphModule):
        return {}
    by_name = {n.name: n for n in whole.graph.nodes}
    known = {}
    for x in inputs:
        source = by_name.get(x.name)
        if source is None or source.op == "placeholder" or ir.example_value(x) is not ir.example_value(source) \
                or not usable(source):
            return {}
        value = ir.evaluate(whole, source, max_elements=max_elements)
        if value is None:
            return {}
        known[x] = value
    return known

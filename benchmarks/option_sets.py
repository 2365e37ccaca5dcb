"""Named kernelpytorch option sets: each runs as mode ``kpt[<name>]`` beside plain ``kpt`` (default options).

torch.compile refuses ``mode=`` together with ``options=``, so a mode goes inside the options.
Plain ``kpt`` runs every pass that is on by default (attention and the fusion group's passes); a set that
switches one on or off shows what that pass buys on every model. Later passes add their sets here.
"""

OPTION_SETS: dict[str, dict] = {
    "ro": {"mode": "reduce-overhead"},  # CUDA graphs on top of our pipeline, to compare with inductor-ro
    "no-attention": {"attention": False},
    "no-cudagraphs": {"cudagraphs": False},  # small inference graphs launched kernel by kernel: what capture buys  # the attention pass off: what it buys (or costs) on every model
    "attention-flash": {"attention": {"backend": "flash"}},  # flash before cuDNN: what the priority buys
    "no-fusion": {"fusion": False},  # the fusion group off (on by default): what its passes buy on every model
    "ro-no-fusion": {"mode": "reduce-overhead", "fusion": False},  # the same under CUDA graphs
    "no-horizontal": {"merge_parallel_linears": False},  # fusion without q/k/v merging: what that pass buys
    "fp8": {"fp8": True},  # lossy, opt-in: fp8 linears where the card's calibration says they pay
    "fp8-rowwise": {"fp8": {"granularity": "rowwise"}},
    # inference weights quantized once for every parameter (the default does it for frozen ones only)
    "fp8-static": {"fp8": {"static_weights": True}},
    "fp8-rowwise-static": {"fp8": {"granularity": "rowwise", "static_weights": True}},
    "fusion-always": {"fusion": {"decide": "always"}},  # every fusion taken: checks the cost model's refusals
    "fusion-measure": {"fusion": {"decide": "measure"}},  # decisions timed on the device at compile time
    "bucketing": {"bucketing": True},  # varying sizes padded to a few buckets: fewer graphs for a stream of sizes
    "bucketing+cudagraphs": {"bucketing": True, "cudagraphs": True},  # the buckets captured as CUDA graphs
    # the same with the graphs' pool capped: the memory bound issue 17 asks to show
    "bucketing+cudagraphs-cap256": {"bucketing": True, "cudagraphs": {"max_pool_mb": 256}},
    # a ladder per padded dim fitted to the first 8 distinct sizes instead of powers of two
    "bucketing-fit+cudagraphs": {"bucketing": {"buckets": "fit"}, "cudagraphs": True},
    # plain kpt buckets by default from the 4th distinct size: this is kpt as it was before that
    "no-bucketing": {"bucketing": False},
    # lossy, opt-in: 2:4 sparse weights (pruned by magnitude) where the card's calibration says they pay
    "2:4": {"sparsity_2_4": True},
    "2:4-always": {"sparsity_2_4": {"decide": "always"}},  # every eligible layer: what the gate saves us from
    # the same inside CUDA graphs: torch's cuSPARSELt call costs the host far more than a dense GEMM's
    "2:4+cudagraphs": {"sparsity_2_4": True, "cudagraphs": {"decide": "always"}},
    "cudagraphs-always": {"cudagraphs": {"decide": "always"}},  # the line 2:4+cudagraphs is compared against
}

"""Named kernelpytorch option sets: each runs as mode ``kpt[<name>]`` beside plain ``kpt`` (default options).

torch.compile refuses ``mode=`` together with ``options=``, so a mode goes inside the options.
Later passes add their sets here, e.g. {"attention": {"attention": True}}, so every benchmark run shows
what each one buys on every model.
"""

OPTION_SETS: dict[str, dict] = {
    "ro": {"mode": "reduce-overhead"},  # CUDA graphs on top of our pipeline, to compare with inductor-ro
}

"""Named kernelpytorch option sets: each runs as mode ``kpt[<name>]`` beside plain ``kpt`` (default options).

torch.compile refuses ``mode=`` together with ``options=``, so a mode goes inside the options.
Plain ``kpt`` runs every pass that is on by default (attention; fusion is opt-in); a set that switches one
on or off shows what that pass buys on every model. Later passes add their sets here.
"""

OPTION_SETS: dict[str, dict] = {
    "ro": {"mode": "reduce-overhead"},  # CUDA graphs on top of our pipeline, to compare with inductor-ro
    "fusion": {"fusion": True},  # fusion on (off by default), deciding by the cost model
    "ro-fusion": {"mode": "reduce-overhead", "fusion": True},  # the same under CUDA graphs (device-time model)
    "no-fusion": {"fusion": False},  # the default today; kept for runs that compare against an older default
    "fusion-always": {"fusion": {"decide": "always"}},  # every fusion taken: checks the cost model's refusals
    "fusion-measure": {"fusion": {"decide": "measure"}},  # decisions timed on the device at compile time
}

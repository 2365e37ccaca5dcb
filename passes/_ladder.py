"""The ladder of bucket sizes a padded dimension rounds up to: powers of two, the user's buckets, or a ladder
fitted to the sizes a graph has met.

A fitted ladder keeps the number of buckets that powers of two would give over the same range of sizes (so the
same number of CUDA graphs to capture) and places them where the sizes are: it minimises the padding the sizes
met would get, each counted once, by dynamic programming over the sizes met as candidate buckets (a bucket at a
size that occurred pads that size by nothing). A bucket past 16 is rounded up to a multiple of 8, the alignment
the GEMMs and the attention kernels read fastest. A size never pads past its own power of two: where the fitted
ladder's next bucket is further, the power of two is its bucket (so a size between two far-apart sizes met costs
no more than powers of two would), and sizes past the largest bucket round up to powers of two.
"""

from __future__ import annotations

from typing import Sequence


def power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, ladder: Sequence[int] | None, past: str = "unpadded") -> int:
    """``n``'s bucket: the first of ``ladder`` that holds it (powers of two when None); past the last, ``n``
    itself (``past="unpadded"``: the user's buckets) or its power of two (``"power_of_two"``: a fitted ladder)."""
    if ladder is None:
        return power_of_two(n)
    for b in ladder:
        if b >= n:
            return b if past == "unpadded" else min(b, power_of_two(n))
    return n if past == "unpadded" else power_of_two(n)


def fit(sizes: Sequence[int], buckets: int | None = None) -> tuple[int, ...]:
    """At most ``buckets`` sizes (default: as many as the distinct powers of two of the sizes met) such that
    rounding each of ``sizes`` up (``round_up(..., past="power_of_two")``) costs the least padding in all; the
    largest size met (aligned) is always one of them."""
    values = sorted(set(int(s) for s in sizes))
    if not values:
        raise ValueError("a ladder is fitted to at least one size")
    if buckets is None:
        buckets = len({power_of_two(v) for v in values})
    buckets = max(1, min(buckets, len(values)))
    n = len(values)
    caps = [v if v <= 16 else -(-v // 8) * 8 for v in values]
    # cost[i][j]: the padding of sizes i..j (sorted) with values[j]'s bucket the next (each at most its own
    # power of two, as round_up gives)
    table = [[0] * n for _ in range(n)]
    for j in range(n):
        total = 0
        for i in range(j, -1, -1):
            total += min(caps[j], power_of_two(values[i])) - values[i]
            table[i][j] = total

    def cost(i: int, j: int) -> int:
        return table[i][j]

    inf = float("inf")
    # best[k][j]: the least padding of sizes 0..j with k buckets, the last at values[j]
    best = [[inf] * n for _ in range(buckets + 1)]
    back = [[-1] * n for _ in range(buckets + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for k in range(2, buckets + 1):
        for j in range(n):
            for i in range(j):  # the previous bucket at values[i]
                c = best[k - 1][i] + cost(i + 1, j)
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, buckets + 1), key=lambda kk: (best[kk][n - 1], kk))
    ladder, j = [], n - 1
    while j >= 0 and k >= 1:
        ladder.append(caps[j])
        j, k = back[k][j], k - 1
    return tuple(sorted(ladder))

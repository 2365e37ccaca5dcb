"""The benchmark zoo: which models run, at which shapes, for inference and for a training step.

Every model comes from ``kpt_compiler.models.zoo.build`` (configurations with random weights, no downloads).
The cuda zoo uses the reference shapes of ANCHORS.md in bf16; the cpu zoo is in float32: its quick cases are
reduced so that CI (2 cores) runs the whole harness in a minute or so, its full ones are whole models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Case", "Entry", "CUDA_ZOO", "CPU_ZOO", "cases"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One task at one shape: ``batch`` x ``seq`` tokens (images: ``batch`` images of ``seq`` x ``seq``)."""

    task: str  # "inference" (no_grad forward) or "training" (forward, loss, backward)
    batch: int
    seq: int
    quick: bool = False  # in the quick suite too; the full suite runs every case
    cudagraphs: bool = False  # run the reduce-overhead modes: CUDA graphs pay off where kernel launches dominate


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # the row label
    builder: str  # a kpt_compiler.models.zoo builder
    kwargs: dict[str, Any]
    cases: tuple[Case, ...]
    image: bool = False

    def shape(self, case: Case) -> str:
        # resnet50's inputs are fixed at 224 x 224 by its builder; the label says so
        return f"{case.batch}x3x{case.seq}x{case.seq}" if self.image else f"{case.batch}x{case.seq}"


# Compiles dominate the run time (~15 s per GPT-2 Inductor compile on an H100): the quick cases are estimated
# at 3-4 minutes there; the progress lines give each row's time for tuning. Not yet measured on the GPU.
CUDA_ZOO: tuple[Entry, ...] = (
    Entry("gpt2-eager", "gpt2", {"attn": "eager"}, (
        Case("inference", 8, 1024, quick=True),
        Case("inference", 1, 64, cudagraphs=True),  # launch-bound: where CUDA graphs matter
        Case("training", 4, 1024),
    )),
    # transformers' default attention (SDPA), the path most users run
    Entry("gpt2-sdpa", "gpt2", {"attn": "sdpa"}, (Case("inference", 8, 1024, quick=True), Case("inference", 1, 64))),
    Entry("bert-sdpa", "bert", {"attn": "sdpa"}, (Case("inference", 32, 512, quick=True),)),
    Entry("vit-sdpa", "vit", {"attn": "sdpa"}, (Case("inference", 64, 224, quick=True),), image=True),
    # a learned relative-position bias on the scores, on both paths
    Entry("t5-encoder-sdpa", "t5-encoder", {"attn": "sdpa"}, (Case("inference", 16, 512, quick=True),)),
    Entry("t5-encoder-eager", "t5-encoder", {"attn": "eager"}, (Case("inference", 16, 512, quick=True),)),
    Entry("llama-eager", "llama", {"attn": "eager"}, (  # 8 layers, grouped-query attention 16/4
        Case("inference", 8, 1024, quick=True),
        Case("inference", 1, 128, cudagraphs=True),
        Case("training", 4, 1024),
    )),
    # Llama-3-8B's layer (hidden 4096, MLP 14336, grouped-query 32/8), 4 layers: large enough for fp8 to matter
    Entry("llama-4096", "llama", {"attn": "sdpa", "n_layer": 4, "hidden": 4096, "heads": 32, "kv_heads": 8,
                                  "intermediate": 14336}, (Case("training", 4, 2048), Case("inference", 4, 2048))),
    Entry("tiny-gpt", "tiny-gpt", {}, (
        Case("training", 8, 1024, quick=True, cudagraphs=True),
        Case("inference", 8, 1024),
    )),
    Entry("bert-eager", "bert", {"attn": "eager"}, (Case("inference", 32, 512),)),
    Entry("resnet50", "resnet50", {}, (Case("inference", 64, 224),), image=True),
)

CPU_ZOO: tuple[Entry, ...] = (
    Entry("tiny-gpt", "tiny-gpt", {"n_layer": 1}, (
        Case("inference", 1, 32, quick=True),
        Case("training", 1, 32, quick=True),
    )),
    Entry("gpt2-eager", "gpt2", {"attn": "eager", "n_layer": 1}, (Case("inference", 1, 32, quick=True),)),
    # the full suite on the CPU (not run by CI): whole models at CPU-sized shapes, for the promise that kpt by
    # default is not slower than Inductor on the CPU either (about 20 minutes on 2 cores, compiles included)
    Entry("gpt2-eager-12", "gpt2", {"attn": "eager"}, (Case("inference", 1, 128), Case("inference", 1, 1024))),
    Entry("gpt2-sdpa-12", "gpt2", {"attn": "sdpa"}, (Case("inference", 1, 128),)),
    Entry("bert-eager", "bert", {"attn": "eager"}, (Case("inference", 4, 128),)),
    Entry("bert-sdpa", "bert", {"attn": "sdpa"}, (Case("inference", 4, 128),)),
    Entry("llama-eager", "llama", {"attn": "eager"}, (Case("inference", 1, 128), Case("training", 1, 128),
                                                      Case("inference", 1, 1024), Case("training", 1, 1024))),
    Entry("t5-encoder-sdpa", "t5-encoder", {"attn": "sdpa"}, (Case("inference", 2, 128),)),
    Entry("t5-encoder-eager", "t5-encoder", {"attn": "eager"}, (Case("inference", 2, 128),)),
    Entry("vit-sdpa", "vit", {"attn": "sdpa"}, (Case("inference", 1, 224),), image=True),
)


def cases(suite: str, device: str, models: list[str] | None = None) -> list[tuple[Entry, Case]]:
    """The (entry, case) pairs a run measures, the quick ones first so a time budget cuts the extras."""
    zoo = CUDA_ZOO if device == "cuda" else CPU_ZOO
    if models:
        unknown = sorted(set(models) - {e.name for e in zoo})
        if unknown:
            raise ValueError(f"unknown model(s) {unknown} for {device}; known: {', '.join(e.name for e in zoo)}")
        zoo = tuple(e for e in zoo if e.name in models)
    pairs = [(e, c) for e in zoo for c in e.cases if suite == "full" or c.quick]
    return sorted(pairs, key=lambda p: not p[1].quick)  # stable: zoo order within each group

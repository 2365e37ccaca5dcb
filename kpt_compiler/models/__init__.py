"""Models the project ships for its main job, tests and benchmarks (random weights, no downloads)."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]

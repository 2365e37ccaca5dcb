"""Small real models for CPU tests."""

import torch
import torch.nn as nn

from kpt_compiler.models.gpt import Block, GPTConfig


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden), nn.ReLU(),
                                 nn.Linear(d_hidden, d_out))

    def forward(self, x):
        return self.net(x)


class UpDown(nn.Module):
    """Two linears, the shape the weight passes' CPU tests take (fp4, 2:4): ``up`` with a bias, ``down`` without."""

    def __init__(self, d=256, h=512):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def up_down(dtype, **kw) -> UpDown:
    """A seeded ``UpDown`` in ``dtype``, in eval mode."""
    torch.manual_seed(0)
    return UpDown(**kw).to(dtype).eval()


class SmallCNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def transformer_block():
    return Block(GPTConfig(n_embd=32, n_head=4, block_size=16))


def make(name):
    """(model, example input) for a model name, seeded."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), torch.randn(9, 16)
    if name == "cnn":
        return SmallCNN(), torch.randn(4, 3, 12, 12)
    if name == "block":
        return transformer_block(), torch.randn(2, 16, 32)
    raise KeyError(name)

"""2:4 structured sparsity without a GPU (issue 19's pruning, pattern check and fine-tuning with the mask kept;
the pass and its sparse kernels need CUDA and are not built yet): passes/_sparse24.py, kpt_compiler.prune_2_4."""

import itertools

import pytest
import torch
import torch.nn as nn

import kpt_compiler
from kpt_compiler.passes._sparse24 import is_2_4, mask_2_4, prune_2_4


def test_the_mask_keeps_the_two_largest_magnitudes_of_each_group_of_four():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g)
    mask = mask_2_4(w)
    for row, col in itertools.product(range(16), range(0, 32, 4)):
        group = w[row, col:col + 4].abs()
        kept = set(torch.nonzero(mask[row, col:col + 4]).flatten().tolist())
        assert kept == set(torch.argsort(group, descending=True)[:2].tolist())  # no ties in Gaussian draws
    assert mask.sum() == w.numel() // 2 and is_2_4(prune_2_4(w)) and not is_2_4(w)


def test_ties_keep_the_earlier_position_and_zero_groups_stay_zero():
    w = torch.tensor([[1.0, -1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, -2.0, 3.0, 3.0, -3.0, 3.0]])
    assert mask_2_4(w).tolist() == [[True, True, False, False, True, True, False, False],
                                    [False, True, False, True, True, True, False, False]]
    assert is_2_4(torch.tensor([[0.0, 5.0, 0.0, 1.0]])) and not is_2_4(torch.tensor([[1.0, 5.0, 0.0, 1.0]]))


def test_bad_shapes_say_what_is_wrong():
    with pytest.raises(ValueError, match="K=6 is not a multiple of 4"):
        mask_2_4(torch.randn(3, 6))
    with pytest.raises(ValueError, match="2-D weights"):
        is_2_4(torch.randn(4))
    with pytest.raises(ValueError, match="skip must be a list"):
        kpt_compiler.prune_2_4(nn.Linear(64, 64), skip="lm_head")


def test_prune_reports_each_layer_and_why_it_left_others():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 66), nn.Linear(66, 64), nn.Linear(64, 64),
                          nn.Linear(64, 10))
    before = model[4].weight.detach().clone()
    done = kpt_compiler.prune_2_4(model, skip=("4",), min_features=32)
    assert set(done.layers) == {"0", "2"} and is_2_4(model[0].weight) and is_2_4(model[2].weight)
    assert "not a multiple of 4" in done.skipped["3"] and "skip pattern" in done.skipped["4"]
    assert "min_features" in done.skipped["5"] and torch.equal(model[4].weight, before)
    assert done.layers["0"]["zeros"] == 0.5 and 5 < done.layers["0"]["sqnr_db"] < 15, done  # Gaussian: ~8.5 dB
    assert "pruned 2 layers to 2:4" in str(done)


def test_a_pruned_classifier_fine_tuned_with_the_mask_recovers_to_within_a_point():
    # a student MLP learns a random teacher's 8-way classification; pruned to 2:4 it loses ~6 points; 800 steps
    # of AdamW (weight decay on) with the mask kept bring it back within 1 point of dense, still 2:4
    torch.manual_seed(0)
    D, C = 32, 8
    teacher = nn.Sequential(nn.Linear(D, 64), nn.Tanh(), nn.Linear(64, C))

    def data(n, seed):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            return x, teacher(x).argmax(-1)

    (xtr, ytr), (xte, yte) = data(8192, 1), data(4096, 2)
    model = nn.Sequential(nn.Linear(D, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, C))

    def accuracy():
        with torch.no_grad():
            return (model(xte).argmax(-1) == yte).float().mean().item() * 100

    def train(steps, lr):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(3)
        for _ in range(steps):
            i = torch.randint(0, len(xtr), (256,), generator=g)
            loss = nn.functional.cross_entropy(model(xtr[i]), ytr[i])
            opt.zero_grad()
            loss.backward()
            opt.step()

    train(1500, 3e-3)
    dense = accuracy()
    done = kpt_compiler.prune_2_4(model, min_features=8)
    pruned = accuracy()
    train(800, 1e-3)
    tuned = accuracy()
    assert len(done.layers) == 3 and pruned < dense - 3, (dense, pruned)
    assert tuned >= dense - 1.0, (dense, pruned, tuned)
    for layer in (model[0], model[2], model[4]):
        assert is_2_4(layer.weight) and (layer.weight == 0).float().mean() == 0.5

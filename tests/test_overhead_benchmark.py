"""The overhead benchmark's measures (benchmarks/overhead.py): allocator-independent memory, paired time ratios."""

import torch

from benchmarks.overhead import TensorMemoryPeak, paired_ratio, rotated


def test_tensor_memory_peak_counts_live_storages_once():
    """Storages count from the operation that returns them until they are freed; views add nothing."""
    mib = 2**20
    with TensorMemoryPeak() as tensors:
        first = torch.ones(mib // 4)  # 1 MiB of fp32
        second = torch.ones(mib // 2)  # 2 MiB: 3 MiB held
        view = second[:10].view(2, 5)
        del first, second, view
        third = torch.zeros(mib // 4)  # 1 MiB, after 3 MiB were freed
    assert tensors.peak == 3 * mib
    assert tensors.held == mib
    del third
    assert tensors.held == 0


def test_paired_ratio_cancels_drift_between_rounds():
    """The machine slows down 4x in round 3, between the baseline's sample and the model's: the ratio per round stays
    1.1 in every other round, while the ratio of medians would compare a slow model with a fast baseline."""
    baseline = [1.0, 1.0, 1.0, 4.0, 4.0]
    model = [1.1, 1.1, 4.4, 4.4, 4.4]
    assert abs(paired_ratio(model, baseline) - 1.1) < 1e-12
    assert sorted(model)[2] / sorted(baseline)[2] == 4.4


def test_rotation_gives_every_model_every_position():
    """Over as many rounds as there are models, each model runs once in each position of the round."""
    models = ["llama", "standard", "block", "full"]
    rounds = [rotated(models, r) for r in range(len(models))]
    assert rounds[0] == models
    for round_ in rounds:
        assert sorted(round_) == sorted(models)
    for position in range(len(models)):
        assert sorted(round_[position] for round_ in rounds) == sorted(models)
    assert rotated(models, 5) == rounds[1]

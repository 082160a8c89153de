"""The overhead benchmark's allocator-independent memory measure (benchmarks/overhead.py)."""

import torch

from benchmarks.overhead import TensorMemoryPeak


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

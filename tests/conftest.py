"""Tiny-model tests run on one thread: on 2 shared cores, multi-threaded tiny matmuls mostly wait on each other.
Tests marked `slow` (the 135M default model) keep torch's default thread count."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(before if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(before)

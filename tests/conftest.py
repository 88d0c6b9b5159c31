"""Tiny-model tests run on one thread: on 2 shared cores, multi-threaded tiny matmuls mostly wait on each other.
Tests marked `slow` (the 135M default model) keep torch's default thread count. Every test decodes cold: its
warm-start files (exitspec.warm) live in its own tmp_path, so no test sees what an earlier one learned. In-process
tests resolve `--dtype auto` to fp32 on every CPU (the tests that mean bf16 say so), so that their expectations do
not depend on whether the CPU has native bf16."""

import pytest
import torch

from exitspec import models, warm


@pytest.fixture(autouse=True)
def _threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(before if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _cold_start(tmp_path, monkeypatch):
    monkeypatch.setattr(warm, "cache_dir", lambda: tmp_path)


@pytest.fixture(autouse=True, scope="session")
def _fp32_auto():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "native_bf16", lambda: False)
        yield

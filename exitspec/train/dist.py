"""torch.distributed set-up from torchrun's environment: nccl on GPUs, gloo on CPUs, or a single process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        """The process that writes checkpoints, logs and the progress bar."""
        return self.rank == 0


def setup(device: str | None = None) -> Dist:
    """Joins the process group when launched by torchrun (WORLD_SIZE > 1). The device defaults to
    cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    return Dist(rank, world, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over processes (in place; the identity for a single process)."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

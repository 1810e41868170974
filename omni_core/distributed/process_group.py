"""The training ranks' `torch.distributed` group: where the ranks meet, forming the group, the DDP wrapper, and the
all-gather of a step's no-grad values by sample.

One place for the distribution mechanics of the training actors (`workers.training_actor` calls these); the training
math (`workers.policy_trainer`) only receives the wrapper and the gather. NCCL on cuda, HCCL on npu, gloo on cpu.
"""

from __future__ import annotations

import datetime
import socket

import torch

from omni_core.device import PROCESS_GROUP_BACKENDS

__all__ = ["PROCESS_GROUP_TIMEOUT_S", "RankRestartedError", "form_group", "gather_by_sample", "rendezvous_address", "wrap_ddp"]

# A collective that waits this long for a rank fails instead of holding the others (a dead rank's peers
# usually fail at once: gloo sees the closed connection).
PROCESS_GROUP_TIMEOUT_S = 600


class RankRestartedError(RuntimeError):
    """A data-parallel rank was asked to train without a process group: Ray restarted its process mid-epoch.
    An infrastructure failure (`faults.is_retryable`): the retried epoch resets the ranks and forms the group."""


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a free TCP port, where the ranks meet to form their group (rank 0 picks them)."""
    import ray

    address = ray.util.get_node_ip_address()
    with socket.socket() as probe:
        probe.bind((address, 0))
        return address, probe.getsockname()[1]


def form_group(address: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
    """Form the group anew (every rank calls this at once); a group of an earlier generation is destroyed first."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend=PROCESS_GROUP_BACKENDS[device.type],
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )


def wrap_ddp(transformer: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`DistributedDataParallel` over the transformer. Buffers are equal on every rank (same checkpoint); not
    broadcasting them keeps forwards free of collectives, so ranks may run different numbers of no-grad forwards."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index or 0] if device.type == "cuda" else None
    return DistributedDataParallel(transformer, device_ids=device_ids, broadcast_buffers=False)


def gather_by_sample(
    own: list[int], values: torch.Tensor, batch_size: int, device: torch.device, rank: int, world_size: int
) -> torch.Tensor:
    """`[batch_size, ...]` from this rank's `values` of samples `own` and every other rank's (all-gathered; the parts
    are equal in size). NCCL gathers device tensors, gloo CPU ones; the result is on the CPU."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RankRestartedError(
            f"training rank {rank} of {world_size} has no process group (Ray restarted it); the epoch is "
            "retried from its checkpoint, which forms the group again"
        )
    out = torch.full((batch_size, *values.shape[1:]), float("nan"), dtype=values.dtype)
    index = torch.tensor(own, device=device)
    indices = [torch.empty_like(index) for _ in range(world_size)]
    parts = [torch.empty_like(values, device=device) for _ in range(world_size)]
    dist.all_gather(indices, index)
    dist.all_gather(parts, values.to(device).contiguous())
    for idx, part in zip(indices, parts, strict=True):
        out[idx.cpu()] = part.cpu()
    return out

"""FSDP2 for the training ranks (`actor.strategy=fsdp2`): shard the transformer, gather it, checkpoint it.

`torch.distributed.fsdp.fully_shard` goes on each transformer block (verl-omni's `fsdp_layer_prefixes` idea:
`transformer_blocks`, and FLUX's `single_transformer_blocks`) and then on the root, over a one-dimensional
device mesh of every rank; parameters become DTensors holding 1/world of each tensor. Mixed precision is
FSDP2's `MixedPrecisionPolicy`: parameters all-gathered in `actor.fsdp_config.dtype` for the compute,
gradients reduced in fp32, the sharded master weights and AdamW state in fp32.

Everything here is collective: every rank calls it at the same point. Checkpoints are
`torch.distributed.checkpoint` folders (`actor/dcp/`, one shard file per rank plus metadata, loadable by
another number of ranks), written next to rank 0's consolidated copy in today's format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omni_core.models import lora
from omni_core.models.policy import FlowPolicy

# Blocks sharded one by one (each all-gathers on its own), as verl-omni's fsdp_layer_prefixes name them.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
DCP_FOLDER = "dcp"


def shard_transformer(policy: FlowPolicy, world_size: int) -> int:
    """Shard `policy.transformer` over all ranks; returns how many blocks were sharded on their own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(policy.device.type, (world_size,))
    mixed = MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=torch.float32)
    blocks = [block for name in BLOCK_LISTS for block in getattr(policy.base_transformer, name, [])]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mixed)
    fully_shard(policy.transformer, mesh=mesh, mp_policy=mixed)
    return len(blocks)


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    """Within: backwards accumulate local gradients without reduce-scattering them (FSDP2's counterpart of
    DDP's `no_sync`); the next backward outside reduces everything accumulated."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_trainable_state(policy: FlowPolicy, rank: int) -> dict[str, torch.Tensor]:
    """The trainable state in `FlowPolicy.state_dict_for_checkpoint`'s keys (whole transformer, or the LoRA
    adapter), gathered from every rank's shards onto rank 0's CPU; {} on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(policy.transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return {}
    if policy.is_lora:
        return {k: v.contiguous() for k, v in lora.lora_state(policy.transformer, state_dict=full).items()}
    return {k: v.contiguous() for k, v in full.items()}


def save_sharded(policy: FlowPolicy, optimizer: torch.optim.Optimizer, actor_dir: Path) -> list[Path]:
    """Every rank writes its shards of the model and the AdamW state into `actor_dir/dcp/`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(policy.transformer, optimizer)
    folder = actor_dir / DCP_FOLDER
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))
    return sorted(folder.iterdir())


def load_sharded(policy: FlowPolicy, optimizer: torch.optim.Optimizer, actor_dir: Path) -> None:
    """Every rank reads its shards (resharded when the checkpoint was written by another number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(policy.transformer, optimizer)  # also creates AdamW's state to fill
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(actor_dir / DCP_FOLDER))
    set_state_dict(policy.transformer, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

"""TransferQueue: the adapter over the ``transfer_queue`` package (``client``) and the v1 replay buffer.

Importing this package is cheap; ``ray`` / ``transfer_queue`` load on first use.
"""

from omni_core.tq.client import (
    FAILURE,
    FINISHED,
    PENDING,
    RUNNING,
    SUCCESS,
    TransferQueueCapacityError,
    attach,
    check_ray_capacity,
    clear,
    clear_partition,
    close_transfer_queue,
    detach,
    get_trajectories,
    init_transfer_queue,
    list_rows,
    partition_id,
    put_prompts,
    put_trajectories,
    set_prompt_status,
    trajectory_key,
    uid_of_key,
)
from omni_core.tq.replay_buffer import ReplayBuffer, SampledBatch

__all__ = [
    "FAILURE",
    "FINISHED",
    "PENDING",
    "RUNNING",
    "SUCCESS",
    "ReplayBuffer",
    "SampledBatch",
    "TransferQueueCapacityError",
    "attach",
    "check_ray_capacity",
    "clear",
    "clear_partition",
    "close_transfer_queue",
    "detach",
    "get_trajectories",
    "init_transfer_queue",
    "list_rows",
    "partition_id",
    "put_prompts",
    "put_trajectories",
    "set_prompt_status",
    "trajectory_key",
    "uid_of_key",
]

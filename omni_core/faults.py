"""Which failures are worth a retry, and what an out-of-memory error tells the user to change.

A retry resumes from the last checkpoint with the same config and code, so it only helps when the fault
was outside both: a process or node that died, a call that timed out, an object that was lost
(`is_retryable`). A dead TransferQueue actor is such a fault too, but a plain retry would find the same dead
queue: the flow first starts a new TransferQueue, then redoes the epoch (`is_transfer_queue_lost`). A config
error, a reward file that raises and an out-of-memory error fail the same way again; they end the run at
once with their own message (`out_of_memory_error` says which settings lower the memory). The Prefect layer
turns `is_retryable` into the tasks' `retry_condition_fn`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Raised by ray.get / actor calls when the process or node went away, or a bounded wait ran out.
_RAY_INFRASTRUCTURE = (
    "ActorDiedError",
    "ActorUnavailableError",
    "RayActorError",
    "WorkerCrashedError",
    "NodeDiedError",
    "GetTimeoutError",
    "ObjectLostError",
    "OwnerDiedError",
    "ObjectFetchTimedOutError",
    "ConnectionError",  # joining a cluster (ray_kwargs.ray_init.address) that is not reachable yet
    "TimeoutError",
    "StorageUnitTimeout",  # transfer_queue: a live storage unit that did not answer (a dead one is "lost" below)
    "DistBackendError",  # torch.distributed: a collective whose peer rank died (gloo: connection closed)
    "DistNetworkError",
    "RankRestartedError",  # a training rank Ray restarted, asked to train before the epoch formed the group again
    "PeerRankLostError",  # a training step's collective failed because another rank's process died
)
# Never retried, whatever they wrap: the same config / code fails the same way (matched by class name so
# that this module imports neither the rewards nor the config package).
_NOT_RETRYABLE = (
    "ConfigError",
    "EpochTimeoutError",
    "IncompleteGroupsError",
    "RewardFailureError",
    "RunOutOfMemoryError",
    "RunStopRequested",  # Ctrl-C, SIGTERM, a UI cancel (omni_core.distributed.run_control): also when it made an actor call fail
    "TransferQueueCapacityError",
)
# What torch (CUDA: "CUDA out of memory"; CPU allocator: "not enough memory" / "can't allocate memory") and
# other libraries put in the message of an allocation failure.
_OOM_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")


# What gloo / NCCL put in a plain RuntimeError when the peer of a collective went away.
_PEER_LOST_TEXT = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "broken pipe")


class RunOutOfMemoryError(RuntimeError):
    """An out-of-memory failure with the settings that lower the memory a step needs (never retried)."""


class EpochTimeoutError(RuntimeError):
    """An epoch ran past `trainer.epoch_timeout_s` and was stopped (never retried: a retry would take as long)."""


def epoch_timeout_error(epoch: int, timeout_s: float) -> EpochTimeoutError:
    """The error of an epoch stopped at its bound: what happened and what to change."""
    return EpochTimeoutError(
        f"epoch {epoch} ran past trainer.epoch_timeout_s={timeout_s:g} s (its retries included) and was stopped; it is "
        "not retried, a retry would take as long. The last checkpoint is kept: raise trainer.epoch_timeout_s, or set "
        "it to null (no bound), and start the run again to resume from it."
    )


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, the exceptions it wraps (`__cause__`, `__context__`, a Ray task error's `cause`), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend([getattr(current, "cause", None), current.__cause__, current.__context__])


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, MemoryError, Ray's OutOfMemoryError (a worker killed by its memory monitor), or
    a RuntimeError saying an allocation failed, anywhere in the chain."""
    for e in exception_chain(exc):
        names = _class_names(e)
        if names & {"OutOfMemoryError", "MemoryError", "RunOutOfMemoryError"}:
            return True
        if isinstance(e, RuntimeError) and any(text in str(e).lower() for text in _OOM_TEXT):
            return True
    return False


def is_peer_rank_lost(exc: BaseException) -> bool:
    """A torch.distributed collective failed because a peer process went away: DistBackendError /
    DistNetworkError, or gloo's plain RuntimeError naming the closed connection, anywhere in the chain."""
    for e in exception_chain(exc):
        if _class_names(e) & {"DistBackendError", "DistNetworkError"}:
            return True
        if isinstance(e, RuntimeError) and any(text in str(e).lower() for text in _PEER_LOST_TEXT):
            return True
    return False


def is_transfer_queue_lost(exc: BaseException) -> bool:
    """A TransferQueue controller or storage unit died (`TransferQueueUnavailableError` anywhere in the chain):
    the epoch can be redone from its checkpoint once a new TransferQueue runs."""
    return any("TransferQueueUnavailableError" in _class_names(e) for e in exception_chain(exc))


def is_retryable(exc: BaseException) -> bool:
    """True only for infrastructure failures that a plain retry can get past (a dead actor, worker or node, a
    timeout, a lost object); False for config errors, user-code errors (a reward that raises), out of memory
    and a lost TransferQueue (`is_transfer_queue_lost`: the same dead queue would fail the retry)."""
    chain = list(exception_chain(exc))
    if is_out_of_memory(exc) or is_transfer_queue_lost(exc) or any(_class_names(e) & set(_NOT_RETRYABLE) for e in chain):
        return False
    return any(_class_names(e) & set(_RAY_INFRASTRUCTURE) for e in chain)


def out_of_memory_error(config: Any, exc: BaseException, where: str) -> RunOutOfMemoryError:
    """The error to raise instead of `exc`: where it ran out and which settings (with their values) to change."""
    arr = config.actor_rollout_ref
    actor, model = arr.actor, arr.model
    hints = [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={actor.ppo_micro_batch_size_per_gpu} (samples per "
        "training forward/backward; halve it, the gradient accumulates over more micro-batches)",
        f"data.gen_batch_size={config.data.gen_batch_size} (prompts per rollout call; set it below "
        f"data.train_batch_size={config.data.train_batch_size})",
        f"actor_rollout_ref.actor.fsdp_config.dtype={actor.fsdp_config.compute_dtype} (bf16 halves activations)",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={model.enable_gradient_checkpointing} (true trades "
        "compute for activation memory)",
        f"actor_rollout_ref.model.lora_rank={model.lora_rank} (LoRA, e.g. 64, trains adapters only: no full "
        "optimizer state, and a bf16 base)",
    ]
    first = next((e for e in exception_chain(exc) if is_out_of_memory(e) and e is not exc), exc)
    return RunOutOfMemoryError(
        f"out of memory during {where}: {type(first).__name__}: {str(first).strip().splitlines()[0][:300]}. "
        "Retrying with the same settings would fail again; lower the memory a step needs with one of:\n  - "
        + "\n  - ".join(hints)
    )

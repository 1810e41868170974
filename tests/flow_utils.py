"""Helpers of the main-job tests: final weights of a run, a run with a process killed mid-way."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

# One step of the training actor used directly (no flow): 2 prompts x 4 samples, one mini-batch, 32 px, 4 denoising steps
# whose SDE window starts in 0..3.
SMALL_ACTOR_STEP = [
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.pipeline.height=32",
    "actor_rollout_ref.rollout.pipeline.width=32",
    "actor_rollout_ref.rollout.pipeline.num_inference_steps=4",
    "actor_rollout_ref.rollout.algo.sde_window_range=[0,3]",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
]
# DiffusionNFT as verl-omni's recipe selects it, on a LoRA adapter (its old policy is a second one).
DIFFUSION_NFT = [
    "actor_rollout_ref.model.algorithm=diffusion_nft",
    "actor_rollout_ref.model.model_type=diffusion_nft_model",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=diffusion_nft",
    "algorithm.trainer_type=direct_preference",
    "actor_rollout_ref.model.policy_state_adapters=[default,old]",
    "actor_rollout_ref.rollout.rollout_adapter=old",
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
]
# verl-omni's online Diffusion-DPO keys (its examples/dpo_trainer/qwen_image recipe's selectors), LoRA as the recipe.
DIFFUSION_DPO = [
    "actor_rollout_ref.model.algorithm=dpo",
    "actor_rollout_ref.model.model_type=diffusion_dpo_model",
    "actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo",
    "algorithm.trainer_type=direct_preference",
    "algorithm.sample_source=online",
    "algorithm.paired_preference=true",
    "actor_rollout_ref.rollout.calculate_log_probs=false",
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # a mini-batch is ppo_mini_batch_size pairs (2 x 2 samples)
]
# verl-omni's offline Diffusion-DPO keys (its examples/dpo_trainer/sd35 recipe's selectors): the pairs data set, no rollout.
OFFLINE_DPO = [
    *(o for o in DIFFUSION_DPO if not o.startswith(("algorithm.sample_source", "actor_rollout_ref.rollout."))),
    "algorithm.sample_source=offline",
    "data.custom_cls.path=pkg://verl_omni.utils.dataset.offline_dpo_dataset",
    "data.custom_cls.name=OfflineDPODataset",
    "data.custom_cls.collate_fn=offline_dpo_collate_fn",
    "trainer.val_before_train=false",
]
# The lean config (conftest's flow_overrides) on two data-parallel training ranks (actor.strategy=ddp, gloo on CPU).
TWO_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=ddp"]
# ... sharded instead (actor.strategy=fsdp2): the session's two-rank flow reference (conftest.two_rank_reference).
TWO_FSDP2_RANKS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2"]
# ... with epochs of two steps (one prompt x 4 samples each, 2 per rank) and a checkpoint after every step: steps 1 and 3
# are saved inside an epoch, 2 and 4 at its end (cosine lr x 1, 0.85, 0.5, 0.15; retention keeps the last 3 checkpoints).
MID_EPOCH = [
    *TWO_RANKS,
    "data.train_batch_size=1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "trainer.save_freq=1",
]

_session_runs: dict[str, Path] = {}


def run_mid_epoch_reference(flow_overrides: list[str], tmp_path_factory) -> Path:
    """The checkpoint folder of the uninterrupted in-process run of `flow_overrides` + `MID_EPOCH`, made once per session
    for whichever test module asks first (test_cli_runs, test_checkpoint_faults): a session fixture imported into two
    modules would run once per module. Needs the session's Prefect API, Ray cluster and TransferQueue."""
    if "mid_epoch" not in _session_runs:
        from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

        ckpt = tmp_path_factory.mktemp("mid_epoch_reference") / "ckpt"
        state = main_diffusion_v1(overrides=[*flow_overrides, *MID_EPOCH, f"trainer.default_local_dir={ckpt}"], return_state=True)
        assert state.is_completed(), state.message
        assert state.result().global_step == 4
        _session_runs["mid_epoch"] = ckpt
    return _session_runs["mid_epoch"]


def final_weights(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    root = Path(checkpoint_dir)
    step = int((root / "latest_checkpointed_iteration.txt").read_text().strip())
    return load_file(str(root / f"global_step_{step}" / "actor" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def kill_when(ckpt, name_part: str, class_name: str, killed: list[int], timeout_s: float = 400, after_step: int = 1) -> None:
    """Once `ckpt/global_step_<after_step>` is complete, SIGKILL the live actor of class `class_name` whose name
    holds `name_part` (pid from Ray's state API)."""
    import signal
    import time

    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (ckpt / f"global_step_{after_step}" / "manifest.json").exists():
        time.sleep(0.2)
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
        detail=True,
        limit=1000,
    )
    for actor in actors:
        if name_part in (actor.name or ""):
            os.kill(actor.pid, signal.SIGKILL)
            killed.append(actor.pid)


def kill_mid_call(ckpt, name_part: str, class_name: str, method: str, killed: list[int], timeout_s: float = 400) -> None:
    """Once `ckpt/global_step_1` is complete, SIGKILL the live actor of class `class_name` whose name holds
    `name_part` while it runs `method` (`killed` gets its pid; nothing if the deadline passes first).

    A training step of the lean config takes ~0.3 s, less than Ray's state API takes to report a running
    call (its task events are sent once a second), so the actor is made a straggler first: SIGSTOP / SIGCONT,
    20 ms running in each 200 ms, as a process starved by a busy host is. Its `method` then runs ten times
    longer, and the state API sees it running before it ends.
    """
    import signal
    import threading
    import time

    import ray
    from ray.util.state import list_actors, list_tasks

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (ckpt / "global_step_1" / "manifest.json").exists():
        time.sleep(0.2)
    address = ray.get_runtime_context().gcs_address
    alive = list_actors(
        address=address, filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")], detail=True, limit=1000
    )
    target = next((a for a in alive if name_part in (a.name or "")), None)
    if target is None:
        return
    done = threading.Event()

    def throttle() -> None:
        while not done.is_set():
            os.kill(target.pid, signal.SIGSTOP)
            done.wait(0.18)
            os.kill(target.pid, signal.SIGCONT)
            done.wait(0.02)

    name = f"{class_name}.{method}"
    calls = [("actor_id", "=", target.actor_id), ("name", "=", name)]
    # The calls made before now: the state API may still report one of them RUNNING (its end not sent yet).
    earlier = {t.task_id for t in list_tasks(address=address, filters=calls, limit=10000)}
    throttler = threading.Thread(target=throttle, daemon=True)
    throttler.start()
    try:
        while time.monotonic() < deadline:
            running = list_tasks(address=address, filters=[*calls, ("state", "=", "RUNNING")], limit=10000)
            if [t for t in running if t.task_id not in earlier]:
                os.kill(target.pid, signal.SIGKILL)
                killed.append(target.pid)
                return
            time.sleep(0.1)
    finally:
        done.set()
        throttler.join()
        if not killed:
            os.kill(target.pid, signal.SIGCONT)


def run_with_kill(
    flow_overrides, ckpt, experiment: str, name_part: str, class_name: str, method: str | None = None, after_step: int = 1
):
    """A run of `flow_overrides` in `ckpt` with an actor killed after the checkpoint of `after_step` (`kill_when`), or
    while it runs `method` after the first one (`kill_mid_call`): (final state, [killed pid])."""
    import threading

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    killed: list[int] = []
    if method is None:
        target, args, kwargs = kill_when, (ckpt, name_part, class_name, killed), {"after_step": after_step}
    else:
        target, args, kwargs = kill_mid_call, (ckpt, name_part, class_name, method, killed), {}
    watcher = threading.Thread(target=target, args=args, kwargs=kwargs, daemon=True)
    watcher.start()
    state = main_diffusion_v1(
        overrides=[*flow_overrides, f"trainer.default_local_dir={ckpt}", f"trainer.experiment_name={experiment}"],
        return_state=True,
    )
    watcher.join(timeout=30)
    return state, killed


def train_one_epoch_and_export(flow_overrides: list[str], model_dir: Path, tmp_path: Path, pipeline_cls: type, extra: list[str]):
    """One lean epoch of `main_diffusion_v1` on the pipeline in `model_dir` (with `extra` overrides), then the export
    of its checkpoint loaded back with diffusers' `pipeline_cls`. Checks what every architecture must give: one step,
    a checkpoint with the diffusers copy, a finite reward, a first ratio of exactly 1 (the update is on-policy), and
    an exported transformer that is the trained one, not the base one. Returns the step's metrics record."""
    import math

    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    from omni_core.export import export_checkpoint
    from omni_core.tracking import read_jsonl

    overrides = [o for o in flow_overrides if not o.startswith(("actor_rollout_ref.model.path=", "trainer.total_epochs="))]
    overrides += [f"actor_rollout_ref.model.path={model_dir}", *extra, "trainer.total_epochs=1"]
    state = main_diffusion_v1(overrides=[*overrides, f"trainer.default_local_dir={tmp_path / 'ckpt'}"], return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == 1
    step = Path(result.final_checkpoint)
    assert step.name == "global_step_1" and (step / "actor" / "hf" / "config.json").is_file()
    records = [r for r in read_jsonl(Path(result.log_dir) / "metrics.jsonl") if "critic/rewards/mean" in r]
    assert len(records) == 1 and math.isfinite(records[0]["critic/rewards/mean"])
    assert records[0]["actor/ratio_mean"] == 1.0

    export_checkpoint(model_dir, step, tmp_path / "export")
    exported = pipeline_cls.from_pretrained(tmp_path / "export", local_files_only=True).transformer.state_dict()
    base = pipeline_cls.from_pretrained(model_dir, local_files_only=True).transformer.state_dict()
    assert exported.keys() == base.keys()
    assert any(not torch.equal(exported[k], base[k]) for k in base)
    return records[0]

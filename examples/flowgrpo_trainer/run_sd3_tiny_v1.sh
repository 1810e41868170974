#!/usr/bin/env bash
# Flow-GRPO on the tiny SD3-family model, v1 sync trainer, JPEG-compressibility reward, on CPU.
# The verl-omni recipe style: every setting is a key=value override of main_diffusion_v1, and any
# extra argument of this script is appended (later overrides win), e.g.
#   bash examples/flowgrpo_trainer/run_sd3_tiny_v1.sh trainer.total_epochs=2 actor_rollout_ref.rollout.n=4
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-models/tiny-sd3}
[ -f "$MODEL_PATH/model_index.json" ] || omniflow make-tiny-model "$MODEL_PATH" --arch sd3 --seed 0

python3 -m omniflow.flows.main_diffusion_v1 \
    data.train_files=pkg://omni_core/assets/prompts/train.txt \
    data.val_files=pkg://omni_core/assets/prompts/val.txt \
    data.train_batch_size=2 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.algorithm=flow_grpo \
    actor_rollout_ref.model.attn_backend=native \
    actor_rollout_ref.model.lora_rank=0 \
    actor_rollout_ref.actor.strategy=torch \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.diffusion_loss.clip_ratio=1e-4 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.rollout.name=diffusers \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.seed=42 \
    actor_rollout_ref.rollout.rollout_attn_backend=TORCH_SDPA \
    actor_rollout_ref.rollout.pipeline.height=64 \
    actor_rollout_ref.rollout.pipeline.width=64 \
    actor_rollout_ref.rollout.pipeline.num_inference_steps=10 \
    actor_rollout_ref.rollout.algo.noise_level=0.7 \
    actor_rollout_ref.rollout.algo.sde_type=sde \
    actor_rollout_ref.rollout.algo.sde_window_size=2 \
    actor_rollout_ref.rollout.algo.sde_window_range=[0,5] \
    actor_rollout_ref.rollout.agent.num_workers=1 \
    algorithm.adv_estimator=flow_grpo \
    trainer.v1.trainer_mode=sync \
    trainer.use_v1=true \
    trainer.project_name=omniflow \
    trainer.experiment_name=tiny_sd3_jpeg \
    trainer.logger=[console,file] \
    trainer.device=auto \
    ray_kwargs.ray_init.num_cpus=16 \
    "$@"

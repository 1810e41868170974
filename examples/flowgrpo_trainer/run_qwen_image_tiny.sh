#!/usr/bin/env bash
# Flow-GRPO on a tiny random Qwen-Image (QwenImagePipeline: Qwen2.5-VL text encoder, true CFG with the
# norm-preserving rescale), with verl-omni's Qwen-Image recipe keys: true_cfg_scale is the CFG scale and
# guidance_scale stays 1.0. On a GPU set MODEL_PATH to a local Qwen/Qwen-Image folder and raise the size,
# steps and batch (see verl-omni's examples/flowgrpo_trainer/qwen_image/*.sh); on CPU the tiny model is built.
#   bash examples/flowgrpo_trainer/run_qwen_image_tiny.sh trainer.total_epochs=1
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-models/tiny-qwen-image}
[ -f "$MODEL_PATH/model_index.json" ] || omniflow make-tiny-model "$MODEL_PATH" --arch qwen-image --seed 0

MODEL_PATH="$MODEL_PATH" bash "$(dirname "$0")/run_sd3_tiny_v1.sh" \
    actor_rollout_ref.rollout.pipeline.height=32 \
    actor_rollout_ref.rollout.pipeline.width=32 \
    actor_rollout_ref.rollout.pipeline.true_cfg_scale=4.0 \
    actor_rollout_ref.rollout.pipeline.max_sequence_length=64 \
    trainer.experiment_name=tiny_qwen_image_jpeg \
    "$@"

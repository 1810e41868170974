#!/usr/bin/env bash
# Flow-GRPO on the tiny SD3-family model with a PickScore reward (flow_grpo's `pickscore`), scored in the rollout
# workers on the run's device. PICKSCORE_PATH is a local folder with the CLIP model and its processor files, e.g. a
# downloaded yuvalkirstain/PickScore_v1 (with laion/CLIP-ViT-H-14-laion2B-s32B-b79K's processor files: set
# PICKSCORE_PROCESSOR_PATH to that folder if they live apart); by default a tiny random CLIP is built offline.
# flow_grpo's config.reward_fn={"pickscore": 1.0} becomes the reward.reward_functions entry below.
#   bash examples/flowgrpo_trainer/run_sd3_tiny_pickscore.sh trainer.total_epochs=2
set -xeuo pipefail

PICKSCORE_PATH=${PICKSCORE_PATH:-models/tiny-clip}
PICKSCORE_PROCESSOR_PATH=${PICKSCORE_PROCESSOR_PATH:-$PICKSCORE_PATH}
PICKSCORE_DTYPE=${PICKSCORE_DTYPE:-float32}
[ -f "$PICKSCORE_PATH/config.json" ] || omniflow make-tiny-model "$PICKSCORE_PATH" --arch clip --seed 0

bash "$(dirname "$0")/run_sd3_tiny_v1.sh" \
    "reward.reward_functions=[{name: pickscore, model_path: $PICKSCORE_PATH, processor_path: $PICKSCORE_PROCESSOR_PATH, dtype: $PICKSCORE_DTYPE, batch_size: 16, weight: 1.0}]" \
    trainer.experiment_name=tiny_sd3_pickscore \
    "$@"

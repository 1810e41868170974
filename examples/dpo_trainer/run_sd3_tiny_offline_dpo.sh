#!/usr/bin/env bash
# Offline Diffusion-DPO on the tiny SD3-family model, on CPU: verl-omni's offline DPO keys
# (examples/dpo_trainer/sd35/run_sd35_medium_offline_dpo_lora.sh there) on a pair data set in its layout. No rollout:
# each step trains the next pairs' (chosen, rejected) images, encoded once through the VAE and cached.
# The default data is a small set shipped with OmniFlow (warm-toned images preferred over cool ones); point
# PAIRS_FILE at your own, e.g. one written by `omniflow make-dataset --pairs FOLDER pairs.parquet` from a folder of
# <name>.txt, <name>_win.png and <name>_lose.png. Extra arguments are appended (later overrides win).
set -xeuo pipefail

MODEL_PATH=${MODEL_PATH:-models/tiny-sd3}
PAIRS_FILE=${PAIRS_FILE:-pkg://omni_core/assets/pairs/warm_over_cool.jsonl}
[ -f "$MODEL_PATH/model_index.json" ] || omniflow make-tiny-model "$MODEL_PATH" --arch sd3 --seed 0

python3 -m omniflow.flows.main_diffusion_v1 \
    algorithm.trainer_type=direct_preference \
    algorithm.sample_source=offline \
    algorithm.paired_preference=true \
    data.train_files="$PAIRS_FILE" \
    data.val_files=null \
    data.train_batch_size=2 \
    data.custom_cls.path=pkg://verl_omni.utils.dataset.offline_dpo_dataset \
    data.custom_cls.name=OfflineDPODataset \
    data.custom_cls.collate_fn=offline_dpo_collate_fn \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.model.algorithm=dpo \
    actor_rollout_ref.model.model_type=diffusion_dpo_model \
    actor_rollout_ref.model.pipeline.guidance_scale=1.0 \
    actor_rollout_ref.model.lora_rank=4 \
    actor_rollout_ref.model.lora_alpha=8 \
    actor_rollout_ref.actor.diffusion_loss.loss_mode=dpo \
    actor_rollout_ref.actor.diffusion_loss.dpo_beta=100.0 \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.pipeline.height=32 \
    actor_rollout_ref.rollout.pipeline.width=32 \
    trainer.project_name=omniflow \
    trainer.experiment_name=tiny_sd3_offline_dpo \
    trainer.logger=[console,file] \
    trainer.total_epochs=3 \
    "$@"

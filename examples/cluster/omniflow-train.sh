#!/usr/bin/env bash
# OmniFlow's main_diffusion_v1 on the Ray cluster of this node: run it on the head of ray-cluster.yaml
# (`ray exec`) or kuberay-raycluster.yaml (`kubectl exec`). `ray_kwargs.ray_init.address=auto` joins the
# cluster that `ray start` started here; every node mounts the shared volume at $SHARED, so the model,
# the checkpoints and the prompt-embedding cache are one folder for all of them (the run checks this at
# start and names the node that does not see it). Extra arguments are appended as overrides, e.g.
#   bash examples/cluster/omniflow-train.sh trainer.total_epochs=2 actor_rollout_ref.rollout.n=8
set -euo pipefail

SHARED=${SHARED:-/mnt/shared}
MODEL_PATH=${MODEL_PATH:-$SHARED/models/tiny-sd3}
EXPERIMENT=${EXPERIMENT:-tiny_sd3_jpeg_cluster}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Prefect's result cache (the prompt embeddings that every rollout worker reads) on the shared volume.
export PREFECT_RESULTS_LOCAL_STORAGE_PATH=${PREFECT_RESULTS_LOCAL_STORAGE_PATH:-$SHARED/omniflow/prefect-results}

# One Prefect API that every node reaches: the epochs run as Prefect tasks on Ray workers of any node, and
# the embedded default listens on 127.0.0.1 of this node only. A PREFECT_API_URL you set wins.
if [ -z "${PREFECT_API_URL:-}" ]; then
    head_ip=$(hostname -I | awk '{print $1}')
    prefect server start --host "$head_ip" --port 4200 >"$HOME/prefect-server.log" 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    export PREFECT_API_URL="http://$head_ip:4200/api"
    for _ in $(seq 120); do
        python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$PREFECT_API_URL/health" 2>/dev/null && break
        sleep 1
    done
    echo "Prefect UI: http://$head_ip:4200"
fi

# A smoke test needs no download: the tiny random-weight pipeline. For a real model, copy its diffusers
# folder (e.g. SD3.5-medium) to the shared volume and set MODEL_PATH.
[ -f "$MODEL_PATH/model_index.json" ] || omniflow make-tiny-model "$MODEL_PATH" --arch sd3 --seed 0

omniflow train \
    ray_kwargs.ray_init.address=auto \
    trainer.device=cuda \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    trainer.experiment_name="$EXPERIMENT" \
    trainer.default_local_dir="$SHARED/omniflow/checkpoints/$EXPERIMENT" \
    "$@"

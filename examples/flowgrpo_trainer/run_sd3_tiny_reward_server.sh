#!/usr/bin/env bash
# Flow-GRPO on the tiny SD3-family model with its reward served over HTTP: `omniflow reward-server` runs the reward
# (here PickScore on a tiny random CLIP; any reward.reward_functions entries work) in a process of its own, which can
# hold its own GPU (CUDA_VISIBLE_DEVICES) or run on another machine (--host 0.0.0.0 there, and point
# REWARD_SERVER_URL at it). Any server that speaks the JSON wire format (docs/configuration.md, "Model rewards and reward servers") works too.
#   REWARD_SERVER_URL=http://scorer:8765/score bash examples/flowgrpo_trainer/run_sd3_tiny_reward_server.sh
set -xeuo pipefail

PORT=${REWARD_SERVER_PORT:-8765}
if [ -z "${REWARD_SERVER_URL:-}" ]; then
    CLIP_PATH=${CLIP_PATH:-models/tiny-clip}
    [ -f "$CLIP_PATH/config.json" ] || omniflow make-tiny-model "$CLIP_PATH" --arch clip --seed 0
    omniflow reward-server --host 127.0.0.1 --port "$PORT" \
        "reward.reward_functions=[{name: pickscore, model_path: $CLIP_PATH}]" trainer.device=auto &
    SERVER_PID=$!
    trap 'kill $SERVER_PID' EXIT
    REWARD_SERVER_URL=http://127.0.0.1:$PORT/score
    for _ in $(seq 120); do  # up to 60 s for the model to load
        curl -sf "http://127.0.0.1:$PORT/health" && break
        sleep 0.5
    done
fi

# A header value env:NAME is read from that variable at each request (never stored in the config or logged), e.g.
#   headers: {Authorization: 'env:REWARD_SERVER_TOKEN'}
bash "$(dirname "$0")/run_sd3_tiny_v1.sh" \
    "reward.reward_functions=[{name: pickscore_served, server_url: '$REWARD_SERVER_URL', batch_size: 16, max_concurrency: 2, request_timeout_s: 120, max_retries: 2, retry_backoff: 0.5}]" \
    trainer.experiment_name=tiny_sd3_reward_server \
    "$@"

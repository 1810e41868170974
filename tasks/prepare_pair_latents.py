"""Stage 4c' — `prepare_pair_latents` (offline samples only): every image of the run's preference pairs through the
VAE once, cached across runs.

Offline Diffusion-DPO (`algorithm.sample_source=offline`) trains on the latents of data-set images, not on rollouts:
they are encoded here, once, into a safetensors file (`omni_core.models.pair_latents`) that the controller reads
(`RunInfo.pair_latents`) when it writes each step's pairs to the TransferQueue; no worker keeps a VAE encoder for it.

Cache key (`latents_key`): the sha256 of every image file and of the model's VAE files, the images' size
(`rollout.pipeline.height` / `width`), `model.architecture`, `trainer.device` and the OmniFlow code version. The file
lives next to Prefect's cached results, named by the key; a cached entry whose file was deleted runs again. The result
Prefect stores is that path, as JSON (never a pickle).
"""

from __future__ import annotations

from typing import Any

import ray
from omniflow.tasks.cache_keys import cached_file, file_backed_key
from prefect import get_run_logger, task

from omni_core.config.schema import ActorRolloutRefConfig
from omni_core.data.preference_pairs import PreferencePair
from omni_core.models.pair_latents import encode_pair_images, latents_key, unique_images

ENCODE_TIMEOUT_S = 4 * 3600  # a bounded wait on the Ray task (a VAE encode: tens of ms per image on a GPU)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    p = parameters
    key = latents_key(p["actor_rollout_ref"], p["device"], unique_images(p["pairs"]))
    return file_backed_key(context, key, cached_file("pair-latents", key, ".safetensors"))


@task(name="prepare_pair_latents", cache_key_fn=_cache_key, persist_result=True, result_serializer="json", retries=1)
def prepare_pair_latents(actor_rollout_ref: ActorRolloutRefConfig, device: str, pairs: list[PreferencePair]) -> str:
    """The path of the safetensors file with the latents of every chosen and rejected image of `pairs`."""
    model, pipeline = actor_rollout_ref.model, actor_rollout_ref.rollout.pipeline
    images = unique_images(pairs)
    out = cached_file("pair-latents", latents_key(actor_rollout_ref, device, images), ".safetensors")
    args = (model.path, images, pipeline.height, pipeline.width, out)
    kwargs = {"architecture": model.architecture, "revision": model.revision}
    if device == "cuda":
        # On the device the policy trains on, in a Ray worker that exits afterwards (its CUDA context goes with it).
        remote = ray.remote(num_gpus=1, max_calls=1)(encode_pair_images)
        path = ray.get(remote.remote(*args, device="cuda", **kwargs), timeout=ENCODE_TIMEOUT_S)
    else:
        path = encode_pair_images(*args, device=device, **kwargs)
    get_run_logger().info(f"{len(images)} pair images encoded ({pipeline.height}x{pipeline.width}) in {path}")
    return str(path)

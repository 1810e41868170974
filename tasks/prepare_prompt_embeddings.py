"""Stage 4c — `prepare_prompt_embeddings`: every prompt of the run through the text encoders once, cached across runs.

verl-omni's prompt-embedding cache (its Q3 roadmap, issue #97): the text encoders (CLIP x2 + T5-XXL for
SD3.5, ~5 GB) are needed only to embed prompts, so the train and validation prompts and their negative
prompts are embedded here, once, into a safetensors file that the run's workers read
(`RunInfo.prompt_embeddings`) instead of keeping the text encoders on their devices.

Cache key: the sha256 of the model's text-encoder and tokenizer files, the prompt set (the sorted unique
texts of the train and validation prompts and negative prompts, plus ""), `model.architecture`,
`rollout.pipeline.max_sequence_length`, `trainer.device` (embeddings computed on another kind of
device differ in the last bits) and the OmniFlow code version (`cache_keys.code_version`). The model path, its transformer, VAE and scheduler, and every other
field leave it valid (a Hub id is fingerprinted in the snapshot its `model.revision` resolves to now: a revision
with other text encoders makes a new entry, one with the same reuses it). The file lives next to Prefect's cached results, named by the key; a cached entry
whose file was deleted runs again. The result Prefect stores is that path, as JSON (never a pickle).
"""

from __future__ import annotations

from typing import Any

import ray
from omniflow.tasks.cache_keys import cached_file, file_backed_key
from prefect import get_run_logger, task

from omni_core.config.schema import ActorRolloutRefConfig
from omni_core.data.prompts import PromptRecord
from omni_core.models.prompt_embeddings import embeddings_key, encode_prompt_set, prompt_set

ENCODE_TIMEOUT_S = 4 * 3600  # a bounded wait on the Ray task (T5-XXL: ~20 ms per prompt on a GPU)


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    p = parameters
    key = embeddings_key(p["actor_rollout_ref"], p["device"], prompt_set(p["train"], p["val"]))
    return file_backed_key(context, key, cached_file("prompt-embeddings", key, ".safetensors"))


@task(name="prepare_prompt_embeddings", cache_key_fn=_cache_key, persist_result=True, result_serializer="json", retries=1)
def prepare_prompt_embeddings(
    actor_rollout_ref: ActorRolloutRefConfig, device: str, train: list[PromptRecord], val: list[PromptRecord]
) -> str:
    """The path of the safetensors file with the embeddings of every prompt of `train` and `val`."""
    model, max_sequence_length = actor_rollout_ref.model, actor_rollout_ref.rollout.pipeline.max_sequence_length
    prompts = prompt_set(train, val)
    out = cached_file("prompt-embeddings", embeddings_key(actor_rollout_ref, device, prompts), ".safetensors")
    args = (model.path, prompts, max_sequence_length, out)
    if device == "cuda":
        # On the device the policy runs on (bit-equal embeddings), in a Ray worker that exits afterwards
        # (max_calls=1): the text encoders' memory and CUDA context go with it, before any actor starts.
        remote = ray.remote(num_gpus=1, max_calls=1)(encode_prompt_set)
        path = ray.get(
            remote.remote(*args, device="cuda", architecture=model.architecture, revision=model.revision),
            timeout=ENCODE_TIMEOUT_S,
        )
    else:
        # cpu (and npu, which Ray does not schedule): in this process. No device memory to hand back, the
        # modules are freed on return, and no Ray worker has to import torch and diffusers first.
        path = encode_prompt_set(*args, device=device, architecture=model.architecture, revision=model.revision)
    get_run_logger().info(f"{len(prompts)} prompt embeddings ({max_sequence_length} tokens) in {path}")
    return str(path)

"""Cached prompt embeddings: equal to a fresh encoding bit for bit, stored as safetensors, cached by Prefect.

The tiny SD3 and FLUX pipelines are loaded the production way; the reference is
`FlowPolicy.encode_prompts` on a one-prompt batch, what a worker computes without the file.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
import uuid

import pytest
import torch

from omni_core.models.prompt_embeddings import (
    PromptEmbeddings,
    PromptNotEmbeddedError,
    encode_prompt_set,
    prompt_key,
    text_encoder_fingerprint,
)

PROMPTS = ["a red circle", "a blue square on a white background", "ünïcode ✓ prompt"]
NEGATIVE = "blurry, low quality"
MAX_SEQ_LEN = 32


@pytest.fixture(scope="module")
def embedded(tiny_sd3_dir, tiny_flux_dir, tmp_path_factory) -> dict[str, tuple]:
    """{arch: (model dir, embeddings file)} over PROMPTS + NEGATIVE (and "", always added)."""
    out = tmp_path_factory.mktemp("prompt_embeddings")
    return {
        arch: (path, encode_prompt_set(path, [*PROMPTS, NEGATIVE, PROMPTS[0]], MAX_SEQ_LEN, out / f"{arch}.safetensors"))
        for arch, path in (("sd3", tiny_sd3_dir), ("flux", tiny_flux_dir))
    }


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_cond_equals_a_fresh_single_prompt_encoding_bit_for_bit(embedded, arch, one_torch_thread):
    from omni_core.models.policy import FlowPolicy

    model_dir, file = embedded[arch]
    policy = FlowPolicy(model_dir)
    cached = PromptEmbeddings(file)
    for do_cfg, negatives in [(False, None), (True, None), (True, [NEGATIVE]), (True, [""])]:
        for prompt in PROMPTS:
            got = cached.cond([prompt], negatives, do_cfg, "cpu")
            want = policy.encode_prompts([prompt], negatives, MAX_SEQ_LEN, do_cfg)
            assert list(got) == list(want), (do_cfg, negatives)
            for k in want:
                assert got[k].dtype == want[k].dtype and got[k].device == want[k].device, k
                assert torch.equal(got[k], want[k]), (arch, prompt, do_cfg, negatives, k)
    # A batch is the stack of its rows, in order ([B, L, D] and [B, P]); dtype converts on the way out.
    batch = cached.cond(PROMPTS[::-1], [NEGATIVE] * 3, True, "cpu", dtype=torch.bfloat16)
    rows = [cached.cond([p], [NEGATIVE], True, "cpu") for p in PROMPTS[::-1]]
    for k, v in batch.items():
        assert v.dtype == torch.bfloat16 and v.shape[0] == 3
        assert torch.equal(v, torch.cat([r[k] for r in rows]).to(torch.bfloat16)), k
    assert cached.max_sequence_length == MAX_SEQ_LEN


def test_file_is_safetensors_with_one_pair_of_rows_per_unique_text_and_metadata(embedded):
    from safetensors import safe_open

    model_dir, file = embedded["sd3"]
    raw = file.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]  # safetensors: u64 header size, a JSON header, raw tensor bytes
    assert json.loads(raw[8 : 8 + header_len])["__metadata__"]["format"] == "omniflow-prompt-embeddings/1"
    assert raw[:2] != b"\x80\x04" and b"PK\x03\x04" not in raw[:4]  # no pickle stream, no torch.save zip

    texts = sorted({*PROMPTS, NEGATIVE, ""})  # the duplicate prompt once; "" always
    with safe_open(str(file), framework="pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        row = f.get_tensor(f"{prompt_key('')}.prompt_embeds")
    assert names == {f"{prompt_key(t)}.{n}" for t in texts for n in ("prompt_embeds", "pooled_prompt_embeds")}
    assert row.ndim == 2  # [L, D]: rows are stored without the batch dim
    assert meta["architecture"] == "StableDiffusion3Pipeline"
    assert meta["max_sequence_length"] == str(MAX_SEQ_LEN)
    assert meta["count"] == str(len(texts))
    assert meta["text_encoder_fingerprint"] == text_encoder_fingerprint(model_dir)
    assert (meta["dtype"], meta["device"]) == ("float32", "cpu")
    assert not list(file.parent.glob(".*tmp*"))  # the temporary file was renamed into place


def test_a_prompt_outside_the_set_raises_a_key_error_naming_it(embedded):
    cached = PromptEmbeddings(embedded["flux"][1])
    assert PROMPTS[0] in cached and "" in cached and "a green dot" not in cached
    with pytest.raises(KeyError) as err:
        cached.cond([PROMPTS[0], "a green dot"], None, False, "cpu")
    assert isinstance(err.value, PromptNotEmbeddedError)
    assert "'a green dot'" in str(err.value) and "run's prompt set" in str(err.value)
    with pytest.raises(PromptNotEmbeddedError, match="unknown negative"):
        cached.cond([PROMPTS[0]], ["unknown negative"], True, "cpu")


def test_the_cache_key_of_a_cached_run_needs_no_diffusers(tiny_sd3_dir):
    """A run whose embeddings are cached computes only their key (text-encoder fingerprint): that must not import
    diffusers (~3 s on 2 cores, which the cache hit used to take longer than computing the tiny model's embeddings)."""
    import subprocess
    import sys

    code = (
        "import sys; from omni_core.models.prompt_embeddings import text_encoder_fingerprint; "
        f"fp = text_encoder_fingerprint({str(tiny_sd3_dir)!r}); "
        "print(len(fp), 'diffusers' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["64", "False", "False"], out.stdout + out.stderr


def test_prompt_key_is_stable_and_distinct():
    assert (
        prompt_key("a red circle") == prompt_key("a red circle") == "a1e4a280d27cad5b1aa05b230031f649"
    )  # sha256, first 32 hex digits
    assert len({prompt_key(t) for t in ["", " ", "a", "A", "a "]}) == 5


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_load_pipeline_without_text_encoders(tiny_sd3_dir, tiny_flux_dir, arch):
    from omni_core.models.loader import load_pipeline

    pipe = load_pipeline(tiny_sd3_dir if arch == "sd3" else tiny_flux_dir, text_encoders=False)
    text = {k: v for k, v in pipe.components.items() if k.startswith(("text_encoder", "tokenizer"))}
    assert len(text) == (6 if arch == "sd3" else 4) and all(v is None for v in text.values()), text
    assert not any("text_encoder" in name for name, _ in pipe.components.items() if isinstance(_, torch.nn.Module))
    assert isinstance(pipe.transformer, torch.nn.Module) and isinstance(pipe.vae, torch.nn.Module)


# ----------------------------------------------------------------------------------- the Prefect task
async def _task_states(flow_run_id, count: int, timeout_s: float = 120) -> dict[str, str]:
    """The final state of each of the flow run's `count` task runs. The API records task runs from the events the
    flow process sends, a moment after the flow returns (later on a busy machine): read until all are final."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            states = {r.name: r.state.name for r in runs if r.state is not None and r.state.is_final()}
            if len(states) >= count or time.monotonic() > deadline:
                return states
            await asyncio.sleep(0.5)


def test_task_is_cached_across_calls_and_remade_when_its_file_is_deleted(prefect_api, tiny_sd3_dir):
    from pathlib import Path

    from omniflow.tasks.prepare_prompt_embeddings import prepare_prompt_embeddings
    from prefect import flow

    from omni_core.config.loader import load_config
    from omni_core.data.prompts import PromptRecord

    def arr(seq_len: int):
        overrides = [
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            f"actor_rollout_ref.rollout.pipeline.max_sequence_length={seq_len}",
        ]
        return load_config(overrides=overrides).actor_rollout_ref

    fresh = f"a prompt no other test embeds {uuid.uuid4().hex}"  # the first call misses whatever ran before
    train = [PromptRecord(prompt=fresh, index=0), PromptRecord(prompt="a red circle", negative_prompt=NEGATIVE, index=1)]
    val = [PromptRecord(prompt="a green dot", index=0)]

    def call(name: str, *args) -> str:
        return prepare_prompt_embeddings.with_options(task_run_name=name)(*args)

    @flow(name="prompt-embeddings-cache")
    def calls() -> dict[str, str]:
        paths = {
            "first": call("first", arr(16), "cpu", train, val),
            "same": call("same", arr(16), "cpu", train, val),
            "longer": call("longer", arr(24), "cpu", train, val),
            "more-prompts": call("more-prompts", arr(16), "cpu", [*train, PromptRecord(prompt="a cat", index=2)], val),
        }
        Path(paths["first"]).unlink()
        paths["after-delete"] = call("after-delete", arr(16), "cpu", train, val)
        paths["again"] = call("again", arr(16), "cpu", train, val)
        return paths

    state = calls(return_state=True)
    assert state.is_completed(), state.message
    paths = state.result()
    states = asyncio.run(_task_states(state.state_details.flow_run_id, count=6))
    assert states == {
        "first": "Completed",
        "same": "Cached",
        "longer": "Completed",  # max_sequence_length is in the key
        "more-prompts": "Completed",  # so is the prompt set
        "after-delete": "Completed",  # the cached file was gone: made again, at the same path
        "again": "Cached",
    }, states
    assert paths["same"] == paths["first"] == paths["after-delete"] == paths["again"]
    assert len({paths["first"], paths["longer"], paths["more-prompts"]}) == 3

    from prefect.settings import get_current_settings

    storage = Path(get_current_settings().results.local_storage_path)
    file = Path(paths["again"])
    assert file.is_file() and file.parent == storage / "omniflow-prompt-embeddings"
    cached = PromptEmbeddings(file)
    assert all(t in cached for t in [fresh, "a red circle", NEGATIVE, "a green dot", ""])
    assert len(cached) == 5 and cached.max_sequence_length == 16
    assert PromptEmbeddings(paths["longer"]).max_sequence_length == 24 and "a cat" in PromptEmbeddings(paths["more-prompts"])

"""Model paths that are Hugging Face Hub ids (`omni_core.models.hub`), offline: a Hugging Face cache is written from
the tiny models in the layout huggingface_hub downloads into (`models--org--name/{blobs,refs,snapshots}`, read back
by huggingface_hub's own `scan_cache_dir` as a check of the layout), then the project's loaders open the models by id
with `HF_HUB_CACHE` pointed at it and `HF_HUB_OFFLINE=1`."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import scan_cache_dir

from omni_core.cache_keys import fingerprint_files
from omni_core.config import load_config
from omni_core.models.hub import hub_snapshot, model_folder, resolve_model_path, shadowed_hub_model
from omni_core.models.policy import FlowPolicy
from omni_core.validation import config_problems

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}
REPO = "tiny-org/tiny-sd3"
MAIN = hashlib.sha1(b"main").hexdigest()  # the two commits of REPO: main (seed 0) and the tag v2 (seed 1)
V2 = hashlib.sha1(b"v2").hexdigest()


def put_in_cache(cache: Path, repo_id: str, commit: str, folder: Path, refs: tuple[str, ...]) -> Path:
    """Write `folder` as snapshot `commit` of `repo_id` the way huggingface_hub's downloads do: each file once in
    blobs/<sha256>, the snapshot's files relative symlinks to them, each name in `refs` a file holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads the file as the commit
    return snapshot


@pytest.fixture(scope="module")
def tiny_sd3_seed1(tmp_path_factory) -> Path:
    from omni_core.models.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd3_seed1"), arch="sd3", seed=1)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    from omni_core.rewards.tiny_clip import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), seed=3)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_sd3_dir, tiny_sd3_seed1, tiny_clip) -> Path:
    root = tmp_path_factory.mktemp("hf_hub_cache")
    put_in_cache(root, REPO, MAIN, tiny_sd3_dir, refs=("main",))
    put_in_cache(root, REPO, V2, tiny_sd3_seed1, refs=("v2",))
    put_in_cache(root, "tiny-org/tiny-clip", MAIN, tiny_clip, refs=("main",))
    return root


@pytest.fixture
def offline_cache(cache, monkeypatch, tmp_path) -> Path:
    """The cache above as this process's Hugging Face cache, downloads off, run from an empty folder (so no local
    folder named like the ids exists)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache


def _model(*overrides: str):
    return load_config(overrides=list(overrides)).actor_rollout_ref.model


def _weights(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    return policy.transformer.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_cache_is_in_huggingface_hubs_own_layout(offline_cache):
    """huggingface_hub's cache scanner sees both revisions of the repo, with their refs (else the layout is wrong)."""
    repos = {r.repo_id: r for r in scan_cache_dir(offline_cache).repos}
    assert {REPO, "tiny-org/tiny-clip"} <= repos.keys()
    revisions = {r.commit_hash: set(r.refs) for r in repos[REPO].revisions}
    assert revisions == {MAIN: {"main"}, V2: {"v2"}}


def test_a_hub_id_loads_the_cached_pipeline_through_the_policy_loader(offline_cache, tiny_sd3_dir):
    model = _model(f"actor_rollout_ref.model.path={REPO}")
    assert model_folder(model) == offline_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN
    by_id = FlowPolicy.from_model_config(model, trainable=False)
    local = FlowPolicy(tiny_sd3_dir, trainable=False)
    assert _same(_weights(by_id), _weights(local))
    # the text encoders come from the snapshot too (what prompt-embedding preparation reads)
    assert _same(by_id.pipeline.text_encoder.state_dict(), local.pipeline.text_encoder.state_dict())


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_loads_that_snapshot(offline_cache, tiny_sd3_dir, tiny_sd3_seed1, revision):
    """A tag or a commit hash picks the seed-1 snapshot; the two snapshots' weights differ, so this is no accident."""
    model = _model(f"actor_rollout_ref.model.path={REPO}", f"actor_rollout_ref.model.revision={revision}")
    assert model_folder(model).name == V2
    by_id = _weights(FlowPolicy.from_model_config(model, trainable=False))
    assert _same(by_id, _weights(FlowPolicy(tiny_sd3_seed1, trainable=False)))
    assert not _same(by_id, _weights(FlowPolicy(tiny_sd3_dir, trainable=False)))


def test_a_cached_hub_id_validates(offline_cache):
    config = load_config(overrides=[f"actor_rollout_ref.model.path={REPO}", "actor_rollout_ref.model.revision=v2"])
    assert not [str(p) for p in config_problems(config, CPU_ONLY) if p.key.startswith("actor_rollout_ref.model")]


def test_a_cached_video_pipeline_is_refused_by_its_class_before_anything_loads(offline_cache, tmp_path):
    """A Hub id whose cached snapshot holds a pipeline OmniFlow does not train (here Wan 2.x's `WanPipeline`) is refused
    by `validate`, from the snapshot's model_index.json, naming the class, why and the supported classes."""
    wan = tmp_path / "wan"
    wan.mkdir()
    (wan / "model_index.json").write_text('{"_class_name": "WanPipeline", "_diffusers_version": "0.35.0"}')
    put_in_cache(offline_cache, "tiny-org/tiny-wan", MAIN, wan, refs=("main",))
    config = load_config(overrides=["actor_rollout_ref.model.path=tiny-org/tiny-wan"])
    (problem,) = [p for p in config_problems(config, CPU_ONLY) if p.key == "actor_rollout_ref.model.path"]
    assert "WanPipeline" in problem.message and "video" in problem.message
    assert "StableDiffusion3Pipeline" in problem.message


@pytest.mark.parametrize(
    ("overrides", "command"),
    [
        (
            ["actor_rollout_ref.model.path=stabilityai/stable-diffusion-3.5-medium"],
            "hf download stabilityai/stable-diffusion-3.5-medium --revision main",
        ),
        ([f"actor_rollout_ref.model.path={REPO}", "actor_rollout_ref.model.revision=v3"], f"hf download {REPO} --revision v3"),
    ],
)
def test_a_missing_hub_id_names_the_key_and_the_download_command(offline_cache, overrides, command):
    problems = [p for p in config_problems(load_config(overrides=overrides), CPU_ONLY) if p.key == "actor_rollout_ref.model.path"]
    assert len(problems) == 1, problems
    message = str(problems[0])
    assert message.startswith(overrides[0] + ":")  # the key and the value given
    assert command in message
    assert "HF_HUB_OFFLINE=0" in message and str(offline_cache) in message
    assert "make-tiny-model" not in message  # it would write a random model under the real one's name


def test_a_local_folder_wins_over_the_hub_id_and_refuses_a_revision(offline_cache, tiny_sd3_seed1):
    (Path("tiny-org")).mkdir()
    Path(REPO).symlink_to(tiny_sd3_seed1)  # ./tiny-org/tiny-sd3, spelled like the Hub id
    assert resolve_model_path(REPO) == Path(REPO)
    config = load_config(overrides=[f"actor_rollout_ref.model.path={REPO}", "actor_rollout_ref.model.revision=v2"])
    problems = {p.key: str(p) for p in config_problems(config, CPU_ONLY)}
    assert "a local folder" in problems["actor_rollout_ref.model.revision"]
    assert "actor_rollout_ref.model.path" not in problems


def test_a_reward_model_loads_by_hub_id(offline_cache, tiny_clip):
    from omni_core.rewards.model_rewards import load_clip

    by_id = load_clip("tiny-org/tiny-clip", None, "float32", torch.device("cpu"))
    local = load_clip(tiny_clip, None, "float32", torch.device("cpu"))
    assert by_id is not local  # two entries of the per-process cache: two folders were loaded
    assert _same(by_id.model.state_dict(), local.model.state_dict())


def test_a_missing_reward_model_hub_id_names_its_key(offline_cache):
    config = load_config(
        overrides=["reward.reward_functions=[{name: clip_score, model_path: tiny-org/absent-clip, revision: r1}]"]
    )
    problems = {p.key: str(p) for p in config_problems(config, CPU_ONLY)}
    message = problems["reward.reward_functions[0].model_path"]
    assert "hf download tiny-org/absent-clip --revision r1" in message
    assert "make-tiny-model" not in message


def test_the_tokenizer_cache_key_follows_the_resolved_snapshot(offline_cache):
    """Both snapshots hold the same tokenizer files, so only the resolved commit tells the two revisions apart: a new
    revision of the model must not be served the older one's cached entry."""
    from omniflow.tasks.load_tokenizer import tokenizer_key

    from omni_core.models.tokenizer import tokenizer_dir

    main, v2 = (_model(f"actor_rollout_ref.model.path={REPO}", f"actor_rollout_ref.model.revision={r}") for r in (MAIN, "v2"))
    assert fingerprint_files([tokenizer_dir(main)]) == fingerprint_files([tokenizer_dir(v2)])
    assert (hub_snapshot(main.path, main.revision), hub_snapshot(v2.path, v2.revision)) == (MAIN, V2)
    assert tokenizer_key(main) != tokenizer_key(v2)
    # `main` moved to the v2 commit: the same config (revision null) now keys like v2, not like before
    before = tokenizer_key(_model(f"actor_rollout_ref.model.path={REPO}"))
    ref = offline_cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main"
    try:
        ref.write_text(V2)
        assert tokenizer_key(_model(f"actor_rollout_ref.model.path={REPO}")) not in (before, tokenizer_key(main))
    finally:
        ref.write_text(MAIN)


def test_the_prompt_embeddings_key_follows_the_resolved_snapshots_text_encoders(offline_cache, tiny_sd3_dir):
    """Keyed on the text-encoder files of the snapshot the id resolves to: the same as the local folder's for main,
    another for v2 (whose text encoders have other weights)."""
    from omni_core.models.prompt_embeddings import embeddings_key

    def key(*overrides: str) -> str:
        return embeddings_key(load_config(overrides=list(overrides)).actor_rollout_ref, "cpu", ["", "a cat"])

    main = key(f"actor_rollout_ref.model.path={REPO}")
    assert main == key(f"actor_rollout_ref.model.path={tiny_sd3_dir}")
    assert main != key(f"actor_rollout_ref.model.path={REPO}", "actor_rollout_ref.model.revision=v2")


def test_make_tiny_model_refuses_a_hub_id_it_would_shadow(offline_cache, capsys):
    from omniflow.flows.cli import main

    assert main(["make-tiny-model", REPO]) == 2
    err = capsys.readouterr().err
    assert f"hf download {REPO}" in err and "local folder wins" in err
    assert not Path(REPO).exists()
    assert shadowed_hub_model("models/tiny-sd3") is None  # the project's own tiny folder: no such Hub model here
    assert shadowed_hub_model(Path(os.getcwd()) / REPO) is None  # an absolute folder is never a Hub id

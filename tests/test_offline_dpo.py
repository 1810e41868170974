"""Offline Diffusion-DPO (`algorithm.sample_source=offline`): pair files in verl-omni's layout, the cached VAE latents,
the feed's rows, validation, and one whole flow that learns the data set's preference without rollout workers."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flow_utils import OFFLINE_DPO
from PIL import Image

from omni_core.config import load_config
from omni_core.data.preference_pairs import PreferencePair, load_preference_pairs, make_pair_dataset
from omni_core.data.prompts import PromptFileError
from omni_core.models.pair_latents import PairLatents, encode_pair_images, load_image_pixels, unique_images

SIZE = 32
EXAMPLE_PAIRS = "pkg://omni_core/assets/pairs/warm_over_cool.jsonl"  # the example's default data set
PROMPTS = ["a red circle", "a blue square", "a green dot", "a white line"]


def _image(path: Path, seed: int, bright: bool) -> Path:
    """A 32 px image: bright warm noise (the preferred look) or dark cool noise."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(SIZE, SIZE, 3, generator=g)
    base = torch.tensor([0.9, 0.6, 0.3]) if bright else torch.tensor([0.1, 0.2, 0.45])
    pixels = ((base + 0.2 * (noise - 0.5)).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).save(path)
    return path


def _pair_folder(root: Path) -> Path:
    """`omniflow make-dataset --pairs`'s input: `<name>.txt`, `<name>_win.png`, `<name>_lose.png` per pair."""
    folder = root / "pairs"
    folder.mkdir()
    for i, prompt in enumerate(PROMPTS):
        (folder / f"{i:03d}.txt").write_text(prompt + "\n")
        _image(folder / f"{i:03d}_win.png", 2 * i, bright=True)
        _image(folder / f"{i:03d}_lose.png", 2 * i + 1, bright=False)
    return folder


def write_pair_file(root: Path) -> Path:
    """A pair file of 4 pairs (bright chosen, dark rejected images) made by `make_pair_dataset` under `root`."""
    return make_pair_dataset(_pair_folder(root), root / "data" / "train.parquet")


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory) -> Path:
    return write_pair_file(tmp_path_factory.mktemp("offline_dpo_data"))


def test_a_folder_of_image_pairs_becomes_a_pair_file_that_loads_back(pair_file):
    import pyarrow.parquet as pq

    rows = pq.read_table(pair_file).to_pylist()
    assert [r["img_win"] for r in rows] == [f"../pairs/{i:03d}_win.png" for i in range(4)]  # relative to the file
    pairs = load_preference_pairs(str(pair_file))
    assert [p.prompt for p in pairs] == PROMPTS and [p.index for p in pairs] == [0, 1, 2, 3]
    folder = pair_file.parent.parent / "pairs"
    assert pairs[2].images == (str(folder / "002_win.png"), str(folder / "002_lose.png"))
    assert (pairs[0].chosen_score, pairs[0].rejected_score, pairs[0].data_source) == (1.0, 0.0, "offline_dpo")


def test_a_verl_omni_offline_dpo_file_loads_without_its_precomputed_tensors(tmp_path):
    """verl-omni's layout (its prepare_offline_dpo.py): chat-message prompts, paths relative to the file, scores, and its
    own SD3 encoder outputs as torch.save bytes, which OmniFlow does not read (it encodes with the run's model)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _image(tmp_path / "w.png", 0, True)
    _image(tmp_path / "l.png", 1, False)
    buffer = io.BytesIO()
    torch.save(torch.zeros(16, 4, 4), buffer)
    chat = [{"role": "system", "content": "You are a helpful image generation assistant."}, {"role": "user", "content": "a cat"}]
    row = {
        "data_source": "offline_dpo_smoke",
        "prompt": chat,
        "negative_prompt": [{"role": "user", "content": "blurry"}],
        "img_win": "w.png",
        "img_lose": "l.png",
        "img_win_latents": buffer.getvalue(),
        "img_lose_latents": buffer.getvalue(),
        "prompt_embeds": buffer.getvalue(),
        "win_score": 0.8,
        "lose_score": 0.3,
        "extra_info": {"split": "smoke", "index": 0, "raw_prompt": "a cat"},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "train.parquet")
    (pair,) = load_preference_pairs(str(tmp_path / "train.parquet"))
    assert (pair.prompt, pair.negative_prompt, pair.data_source) == ("a cat", "blurry", "offline_dpo_smoke")
    assert pair.images == (str(tmp_path / "w.png"), str(tmp_path / "l.png"))
    assert (pair.chosen_score, pair.rejected_score) == (0.8, 0.3)
    json.dumps(dataclasses.asdict(pair))  # the cached dataset task stores the records as JSON


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({"prompt": "x", "img_win": "missing.png", "img_lose": "l.png"}, "does not exist"),
        ({"prompt": "x", "img_win": "w.png", "img_lose": "l.png", "win_score": 0.1, "lose_score": 0.9}, "swap img_win and img_lose"),
        ({"prompt": "x", "img_lose": "l.png"}, "set data.img_win_key"),
        ({"prompt": "x", "img_win": "w.png", "img_lose": "l.png", "win_score": "high"}, "is not a number"),
    ],
    ids=["missing image", "chosen below rejected", "no chosen column", "score not a number"],
)
def test_a_bad_pair_row_is_refused_naming_the_row_and_the_fix(tmp_path, row, fragment):
    _image(tmp_path / "w.png", 0, True)
    _image(tmp_path / "l.png", 1, False)
    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(PromptFileError) as err:
        load_preference_pairs(str(tmp_path / "pairs.jsonl"))
    assert "line 1" in str(err.value) and fragment in str(err.value)


def test_a_prompt_text_file_is_not_taken_for_pairs(tmp_path):
    (tmp_path / "prompts.txt").write_text("a cat\n")
    with pytest.raises(PromptFileError, match="make-dataset --pairs"):
        load_preference_pairs(str(tmp_path / "prompts.txt"))


def _fresh_sd3_latents(model_dir: Path, image: str) -> torch.Tensor:
    """SD3's image latents as its pipelines compute them, written out here: preprocess, the VAE posterior's mean,
    then (z - shift_factor) * scaling_factor."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad(), Image.open(image) as img:
        pixels = pipe.image_processor.preprocess(img.convert("RGB"), height=SIZE, width=SIZE)
        z = pipe.vae.encode(pixels).latent_dist.mean
    return (z[0] - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor


def test_the_cached_latents_equal_a_fresh_encoding_bit_for_bit(tiny_sd3_dir, pair_file, tmp_path):
    pairs = load_preference_pairs(str(pair_file))
    images = unique_images(pairs)
    out = encode_pair_images(tiny_sd3_dir, images, SIZE, SIZE, tmp_path / "latents.safetensors")
    cached = PairLatents(out)
    assert cached.size == (SIZE, SIZE)
    rows = cached.latents([pairs[1].chosen_image, pairs[1].rejected_image])
    fresh = _fresh_sd3_latents(tiny_sd3_dir, pairs[1].chosen_image)
    assert rows.shape == (2, *fresh.shape) and fresh.shape[0] == 16  # SD3's 16 latent channels
    assert torch.equal(rows[0], fresh)
    assert torch.equal(rows[1], _fresh_sd3_latents(tiny_sd3_dir, pairs[1].rejected_image))
    assert not torch.equal(rows[0], rows[1])
    with pytest.raises(KeyError, match="run prepare_pair_latents again"):
        cached.latents([str(tmp_path / "other.png")])


def test_qwen_image_latents_are_the_normalised_vae_mean_packed(tiny_qwen_image_dir, pair_file, tmp_path):
    """Qwen-Image's VAE takes one-frame video and its latents are normalised by latents_mean / latents_std (as
    QwenImageEditPipeline's image latents), then packed into 2x2 patches: written out here independently."""
    from diffusers import QwenImagePipeline

    image = load_preference_pairs(str(pair_file))[0].chosen_image
    out = encode_pair_images(tiny_qwen_image_dir, [image], SIZE, SIZE, tmp_path / "latents.safetensors")
    (got,) = PairLatents(out).latents([image])
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image_dir, local_files_only=True)
    vae = pipe.vae
    with torch.no_grad():
        z = vae.encode(load_image_pixels(image, SIZE, SIZE)[:, :, None]).latent_dist.mean[:, :, 0]  # [1, C, h, w]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    z = (z - mean) / std
    c, h, w = z.shape[1:]
    packed = z.view(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4).reshape(h // 2 * w // 2, c * 4)
    torch.testing.assert_close(got, packed, rtol=0, atol=1e-6)


def test_the_feed_writes_each_pair_as_a_group_of_chosen_then_rejected(tiny_sd3_dir, pair_file, tmp_path):
    from omni_core.models.prompt_embeddings import PromptEmbeddings, encode_prompt_set
    from omni_core.records import RunInfo
    from omni_core.trainers.preference_data_feed import PreferenceDataFeed

    config = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            f"data.train_files={pair_file}",
            *OFFLINE_DPO,
            "actor_rollout_ref.rollout.pipeline.guidance_scale=4.0",
        ]
    )
    pairs = load_preference_pairs(str(pair_file))
    pairs[3] = dataclasses.replace(pairs[3], chosen_score=0.5, rejected_score=0.5)  # a tie: no preference
    max_len = config.actor_rollout_ref.rollout.pipeline.max_sequence_length
    embeddings = encode_prompt_set(tiny_sd3_dir, [p.prompt for p in pairs], max_len, tmp_path / "emb.safetensors")
    latents = encode_pair_images(tiny_sd3_dir, unique_images(pairs), SIZE, SIZE, tmp_path / "lat.safetensors")
    run = RunInfo("r", "ns", str(tmp_path), str(tmp_path), prompt_embeddings=str(embeddings), pair_latents=str(latents))
    feed = PreferenceDataFeed(SimpleNamespace(config=config, run=run))
    traj, rewards = feed.pair_rows(pairs[2:])
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert traj.latents.shape[:3] == (4, 1, 16) and traj.window_size == 0
    want = PairLatents(latents).latents([pairs[2].chosen_image, pairs[2].rejected_image, *pairs[3].images])
    assert torch.equal(traj.latents[:, 0], want)
    assert traj.prompt_index.tolist() == [2, 2, 3, 3] and traj.sample_index.tolist() == [0, 1, 0, 1]
    # SD3 guides with "" negatives (guidance_scale 4 > 1): the cond of each row is its prompt's, as the rollout's would be.
    cond = PromptEmbeddings(embeddings).cond([pairs[2].prompt] * 2 + [pairs[3].prompt] * 2, None, True, "cpu")
    assert set(traj.cond) == set(cond) and "negative_prompt_embeds" in cond
    assert all(torch.equal(traj.cond[k], cond[k]) for k in cond)
    with Image.open(pairs[2].chosen_image) as img:
        assert torch.equal(traj.images[0], torch.tensor(np.asarray(img.convert("RGB"))).permute(2, 0, 1))


def test_an_offline_dpo_config_validates_and_plans_no_rollout_workers(tiny_sd3_dir, pair_file):
    from omni_core.resources import resource_plan, rollout_worker_count, uses_hybrid_engine
    from omni_core.validation import validate_config

    config = load_config(overrides=[f"actor_rollout_ref.model.path={tiny_sd3_dir}", f"data.train_files={pair_file}", *OFFLINE_DPO])
    validate_config(config, device_counts={"cuda": 0, "npu": 0, "cpu": 2})
    assert rollout_worker_count(config) == 0 and not uses_hybrid_engine(config)
    plan = resource_plan(config)
    assert plan.rollout == () and len(plan.training) == 1


def test_a_pair_record_is_a_prompt_record():
    """The prompt-embedding and data-loader code take the pairs as the prompts they are."""
    from omni_core.data.prompts import PromptRecord

    assert issubclass(PreferencePair, PromptRecord)


# ----------------------------------------------------------------------------- the example, and one whole flow
EXAMPLE = Path(__file__).parent.parent / "examples" / "dpo_trainer" / "run_sd3_tiny_offline_dpo.sh"


def example_overrides(**variables: str) -> list[str]:
    """The key=value arguments of the example's `main_diffusion_v1` command, its shell variables set to `variables`."""
    lines = EXAMPLE.read_text().split("main_diffusion_v1 \\\n", 1)[1].splitlines()
    out = []
    for line in lines:
        line = line.strip().removesuffix("\\").strip()
        if line == '"$@"':
            break
        for name, value in variables.items():
            line = line.replace(f'"${name}"', value)
        assert "$" not in line, line
        out.append(line)
    return out


def test_the_example_validates_with_verl_omnis_offline_dpo_keys(tiny_sd3_dir):
    """The example's command as `omniflow validate` runs it, with the data set shipped with OmniFlow (pkg://)."""
    from omni_core.validation import prepare_run_config

    config = prepare_run_config(None, example_overrides(MODEL_PATH=str(tiny_sd3_dir), PAIRS_FILE=EXAMPLE_PAIRS))
    assert (config.algorithm.sample_source, config.actor_rollout_ref.actor.diffusion_loss.loss_mode) == ("offline", "dpo")
    pairs = load_preference_pairs(EXAMPLE_PAIRS)
    assert len(pairs) == 4 and all(Path(image).is_file() for pair in pairs for image in pair.images)


def test_make_dataset_pairs_is_the_command_of_the_pair_layout(tmp_path, capsys):
    from omniflow.flows.cli import main

    out = tmp_path / "out" / "pairs.parquet"
    assert main(["make-dataset", "--pairs", str(_pair_folder(tmp_path)), str(out)]) == 0
    assert f"preference pairs written to {out}" in capsys.readouterr().out
    assert [p.prompt for p in load_preference_pairs(str(out))] == PROMPTS

def _margins(overrides: list[str], checkpoint: Path, pairs: list[PreferencePair]) -> torch.Tensor:
    """Diffusion-DPO's implicit preference of the trained policy, written out here (Wallace et al., eq. 14): at fresh
    noise points, D(x0) = err_theta(x0) - err_ref(x0) with err the flow-matching error ||v(x_t) - (eps - x0)||^2, and
    each pair's margin D(rejected) - D(chosen) > 0 when training moved the policy towards the chosen image."""
    from omni_core.checkpoint.trained import load_checkpoint_weights
    from omni_core.models.policy import FlowPolicy

    config = load_config(overrides=overrides).actor_rollout_ref
    model_dir = Path(config.model.path)
    policy = FlowPolicy.from_model_config(config.model)  # the run's LoRA adapter, at its initial (zero) weights
    load_checkpoint_weights(policy, checkpoint, ema=False)
    g = torch.Generator().manual_seed(1234)
    margins = []
    for pair in pairs:
        x0 = torch.stack([_fresh_sd3_latents(model_dir, image) for image in pair.images])
        cond = policy.encode_prompts([pair.prompt] * 2, max_sequence_length=config.rollout.pipeline.max_sequence_length)
        total = torch.zeros(2)
        for _ in range(6):
            t = torch.rand(1, generator=g) * 0.8 + 0.1
            eps = torch.randn(x0.shape[1:], generator=g).expand_as(x0)  # one noise for both images, as in training
            x_t, u = (1 - t) * x0 + t * eps, eps - x0
            with torch.no_grad():
                err = ((policy.velocity(x_t, (t * 1000).expand(2), cond) - u) ** 2).flatten(1).mean(1)
                ref = ((policy.velocity(x_t, (t * 1000).expand(2), cond, use_reference=True) - u) ** 2).flatten(1).mean(1)
            total += err - ref
        margins.append(total[1] - total[0])
    return torch.stack(margins)


@pytest.fixture(scope="module")
def offline_run(prefect_api, ray_cluster, transfer_queue, tiny_sd3_dir, pair_file, tmp_path_factory):
    """The example's run on the test's pairs, uninterrupted: (overrides without the folder, its final state, folder)."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1

    ckpt = tmp_path_factory.mktemp("offline_run") / "ckpt"
    overrides = [*example_overrides(MODEL_PATH=str(tiny_sd3_dir), PAIRS_FILE=str(pair_file)), "trainer.concurrency.gpu_limit=null"]
    return overrides, main_diffusion_v1(overrides=[*overrides, f"trainer.default_local_dir={ckpt}"], return_state=True), ckpt


def test_an_offline_dpo_run_learns_the_pairs_preference_without_rollout_workers(offline_run, pair_file):
    """The offline DPO example (verl-omni's offline DPO keys) through `main_diffusion_v1` on the test's pairs: the images
    are encoded once (a prepare_pair_latents task), no init_agent_loop stage and no rollout worker runs, and 3 epochs of
    2 steps (2 pairs each) move the policy towards every chosen image, measured independently of the run's metrics."""
    import math

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from omni_core.tracking import read_jsonl

    overrides, state, ckpt = offline_run
    assert state.is_completed(), state.message
    result = state.result()
    assert result.global_step == 6 and result.offline
    assert result.margin_last > result.margin_first  # the run's own account (the summary's DPO margin lines)
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    names = {t.name.rsplit("-", 1)[0] for t in tasks}
    assert {"prepare_pair_latents", "prepare_prompt_embeddings", "init_trainer"} <= names  # (fit_epoch: in the fit subflow)
    assert "init_agent_loop" not in names
    (log_dir,) = (ckpt / "logs").iterdir()
    records = [r for r in read_jsonl(log_dir / "metrics.jsonl") if "actor/dpo_loss" in r]
    assert len(records) == 6 and "actor/pg_loss" not in records[0]
    # LoRA starts at zero: the first step's forwards are the reference's, so every pair's loss is log 2.
    assert records[0]["actor/dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert records[0]["critic/rewards/mean"] == pytest.approx(0.5)  # the scores 1 and 0 are the rewards
    margins = _margins(overrides, ckpt / "global_step_6", load_preference_pairs(str(pair_file)))
    assert bool((margins > 0).all()), margins


def test_a_training_rank_killed_mid_run_is_restarted_and_the_run_ends_with_the_same_weights(offline_run, tmp_path):
    """SIGKILL of the training rank's process after epoch 1's checkpoint (step 2): Ray restarts it, the epoch is retried
    from that checkpoint, and the run ends with the uninterrupted run's weights, bit for bit (the pairs, their order,
    the noise and the sigma of every step are functions of the step, not of the process)."""
    from flow_utils import assert_same_weights, final_weights, run_with_kill

    overrides, reference, reference_ckpt = offline_run
    assert reference.is_completed(), reference.message
    ckpt = tmp_path / "ckpt"
    state, killed = run_with_kill(overrides, ckpt, "offline-kill", "training-actor", "TrainingActor", after_step=2)
    assert state.is_completed(), state.message
    assert killed, "no training actor was killed"
    assert state.result().global_step == 6
    assert_same_weights(final_weights(ckpt), final_weights(reference_ckpt))


def test_verl_omnis_offline_dpo_recipe_trains_one_epoch_on_the_tiny_sd3(offline_run, tiny_sd3_dir, tmp_path):
    """verl-omni's offline DPO recipe as written (its sizes: 16 pairs a step in mini-batches of 4 pairs and micro-batches
    of 8 samples, LoRA rank 32 on a bf16 base, CFG 4.0 in the training forward), without its refused keys, with the local
    model and a 16-pair file, for one epoch (`trainer.total_training_steps=1`: one epoch of 16 pairs; the recipe's is
    1,000 steps) and the console and file loggers."""
    from omniflow.flows.main_diffusion_v1 import main_diffusion_v1
    from test_verl_omni_recipes import EXPECTED_REFUSED, _key, recipe_overrides

    name = "run_sd35_medium_offline_dpo_lora"
    folder = tmp_path / "pairs16"
    folder.mkdir()
    for i in range(16):
        (folder / f"{i:03d}.txt").write_text(f"picture number {i}\n")
        _image(folder / f"{i:03d}_win.png", 2 * i, bright=True)
        _image(folder / f"{i:03d}_lose.png", 2 * i + 1, bright=False)
    pairs = make_pair_dataset(folder, tmp_path / "train.parquet")
    local = {"data.train_files": str(pairs), "data.val_files": str(pairs), "actor_rollout_ref.model.path": str(tiny_sd3_dir)}
    overrides = [
        f"{_key(o)}={local[_key(o)]}" if _key(o) in local else o
        for o in recipe_overrides(name)
        if not any(_key(o) == k or _key(o).startswith(k + ".") for k in EXPECTED_REFUSED[name])
    ]
    ckpt = tmp_path / "ckpt"
    extra = ["trainer.total_training_steps=1", "trainer.logger=[console,file]", "trainer.concurrency.gpu_limit=null", f"trainer.default_local_dir={ckpt}"]
    state = main_diffusion_v1(overrides=[*overrides, *extra], return_state=True)
    assert state.is_completed(), state.message
    assert state.result().global_step == 1 and (ckpt / "global_step_1" / "actor" / "model.safetensors").is_file()

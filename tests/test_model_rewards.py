"""Model rewards (PickScore, CLIP score, LAION aesthetic) on a tiny random CLIP built offline and loaded with
from_pretrained(local_dir), checked against a CLIP forward computed by hand; and the config rules of reward entries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import CLIPModel, CLIPProcessor

from omni_core.config import ConfigError, load_config
from omni_core.rewards.manager import RewardManager
from omni_core.rewards.model_rewards import load_clip
from omni_core.rewards.tiny_clip import AESTHETIC_HEAD_FILE
from omni_core.validation import config_problems, prepare_run_config

CPU_ONLY = {"cuda": 0, "npu": 0, "cpu": 2}
PROMPTS = ["a red circle", "a blue square on a white background", "a red circle", "two cats", "a green dot"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """The tiny CLIP reward model, written by the CLI a user would run (`omniflow make-tiny-model --arch clip`)."""
    from omniflow.flows.cli import main

    out = tmp_path_factory.mktemp("tiny_clip")
    assert main(["make-tiny-model", str(out), "--arch", "clip", "--seed", "3"]) == 0
    return out


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """Five 40x40 uint8 CHW images: random noise and flat colours (resized and cropped to 32 by the processor)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (3, 3, 40, 40), dtype=np.uint8)
    flat = np.stack([np.full((3, 40, 40), v, dtype=np.uint8) for v in (30, 220)])
    return torch.from_numpy(np.concatenate([noise, flat]))


def _direct(clip_dir, images: torch.Tensor, prompts: list[str], dtype: torch.dtype = torch.float32):
    """Independent path: CLIPModel.forward (which normalises both embeddings itself) on the processor's inputs."""
    model = CLIPModel.from_pretrained(clip_dir, dtype=dtype).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    pil = [img.permute(1, 2, 0).numpy() for img in images]
    inputs = processor(text=prompts, images=pil, padding=True, return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.no_grad():
        out = model(**inputs)
    cos = (out.image_embeds.float() * out.text_embeds.float()).sum(-1)
    pickscore = out.logits_per_image.float().diag() / 26  # logit_scale.exp() * cos / 26 (flow_grpo)
    return cos, pickscore, out.image_embeds.float()


def _reward_cfg(*entries: dict, timeout_s: float | None = 60) -> dict:
    return {"reward_functions": list(entries), "timeout_s": timeout_s}


def test_pickscore_and_clip_score_equal_a_direct_clip_forward(clip_dir, images, one_torch_thread):
    cos, pickscore, _ = _direct(clip_dir, images, PROMPTS)
    cfg = _reward_cfg(
        {"name": "pickscore", "model_path": str(clip_dir), "weight": 2.0},
        {"name": "clip_score", "model_path": str(clip_dir), "weight": 0.5},
    )
    result = RewardManager(cfg, device="cpu").score(images, "x", prompts=PROMPTS)
    assert not result.failed.any()
    got_pick = torch.tensor([e["pickscore"] for e in result.extras])
    got_cos = torch.tensor([e["clip_score"] for e in result.extras])
    torch.testing.assert_close(got_pick, pickscore, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cos, cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.scores, 2.0 * pickscore + 0.5 * cos, atol=1e-5, rtol=1e-5)
    # The logit scale is CLIP's initial log(1/0.07): PickScore = 14.29 * cos / 26 here.
    torch.testing.assert_close(got_pick, got_cos * (1 / 0.07) / 26, atol=1e-4, rtol=1e-4)


def test_aesthetic_is_the_mlp_on_the_normalised_image_embedding(clip_dir, images, tmp_path, one_torch_thread):
    _, _, image_embeds = _direct(clip_dir, images, PROMPTS)
    head = load_file(str(clip_dir / AESTHETIC_HEAD_FILE))
    x = image_embeds
    for i in (0, 2, 4, 6, 7):  # LAION's head: five Linear layers, no activations (dropout is off in eval)
        x = x @ head[f"layers.{i}.weight"].T + head[f"layers.{i}.bias"]
    expected = x.squeeze(-1)
    entry = {"name": "aesthetic", "model_path": str(clip_dir), "head_path": str(clip_dir / AESTHETIC_HEAD_FILE)}
    got = RewardManager(_reward_cfg(entry), device="cpu").score(images, "x")  # needs no prompt
    torch.testing.assert_close(got.scores, expected, atol=1e-5, rtol=1e-5)
    # LAION distributes the head as a torch state dict (.pth): read with weights_only=True, same numbers.
    torch.save(head, tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    pth = RewardManager(_reward_cfg({**entry, "head_path": str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth")}), device="cpu")
    torch.testing.assert_close(pth.score(images, "x").scores, expected, atol=1e-5, rtol=1e-5)


def test_batches_give_the_scores_of_one_by_one_and_the_model_loads_once(clip_dir, images, one_torch_thread):
    entry = {"name": "pickscore", "model_path": str(clip_dir)}
    one_batch = RewardManager(_reward_cfg({**entry, "batch_size": 8}), device="cpu").score(images, "x", prompts=PROMPTS)
    in_twos = RewardManager(_reward_cfg({**entry, "batch_size": 2}), device="cpu").score(images, "x", prompts=PROMPTS)
    single = [
        RewardManager(_reward_cfg(entry), device="cpu").score(images[i : i + 1], "x", prompts=PROMPTS[i : i + 1])
        for i in range(5)
    ]
    torch.testing.assert_close(in_twos.scores, one_batch.scores, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([s.scores for s in single]), one_batch.scores, atol=1e-6, rtol=1e-6)
    # Seven managers above, one model in this process (cached by folder, dtype and device).
    assert load_clip(clip_dir, None, "float32", torch.device("cpu")) is load_clip(
        clip_dir, clip_dir, "float32", torch.device("cpu")
    )


def test_the_precision_asked_for_is_the_models(clip_dir, images, one_torch_thread):
    bundle = load_clip(clip_dir, None, "bfloat16", torch.device("cpu"))
    assert bundle.model.dtype == torch.bfloat16 and bundle.model.logit_scale.dtype == torch.bfloat16
    cos16, pick16, _ = _direct(clip_dir, images, PROMPTS, dtype=torch.bfloat16)
    cos32, _, _ = _direct(clip_dir, images, PROMPTS)
    entry = {"name": "clip_score", "model_path": str(clip_dir), "dtype": "bf16"}  # verl's spelling
    got = RewardManager(_reward_cfg(entry), device="cpu").score(images, "x", prompts=PROMPTS).scores
    torch.testing.assert_close(got, cos16, atol=2e-2, rtol=0)  # bf16 keeps ~3 significant digits
    assert (got - cos32).abs().max() > 0  # it did run in bf16, not in fp32
    pick = RewardManager(_reward_cfg({**entry, "name": "pickscore"}), device="cpu").score(images, "x", prompts=PROMPTS)
    torch.testing.assert_close(pick.scores, pick16, atol=2e-2, rtol=0)


def test_a_sample_without_a_prompt_fails_alone_with_the_reason(clip_dir, images, one_torch_thread):
    entry = {"name": "pickscore", "model_path": str(clip_dir), "batch_size": 2}
    result = RewardManager(_reward_cfg(entry), device="cpu").score(images, "x", prompts=[*PROMPTS[:4], None])
    assert result.failed.tolist() == [False, False, False, False, True]
    assert math.isnan(result.scores[4].item())
    assert result.reasons[4] == "pickscore: pickscore compares the image with its prompt, and no prompt was given"


def test_model_entries_fail_early_with_the_key_and_the_fix(clip_dir, tmp_path):
    with pytest.raises(ValueError, match=r"reward_functions\[0\]\.model_path: clip_score needs model_path"):
        RewardManager(_reward_cfg({"name": "clip_score"}))
    with pytest.raises(ValueError, match=r"reward_functions\[0\]\.head_path: aesthetic needs head_path"):
        RewardManager(_reward_cfg({"name": "aesthetic", "model_path": str(clip_dir)}), device="cpu")
    with pytest.raises(ValueError, match=r"has unknown keys \['head_path'\].*a pickscore model entry takes name, model_path"):
        RewardManager(_reward_cfg({"name": "pickscore", "model_path": str(clip_dir), "head_path": "h.safetensors"}))
    wrong = {"layers.0.weight": torch.zeros(4, 7), "layers.0.bias": torch.zeros(4)}
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(ValueError, match=r"expected flow_grpo's / LAION's MLP layout"):
        RewardManager(_reward_cfg({"name": "aesthetic", "model_path": str(clip_dir), "head_path": str(tmp_path / "wrong.pth")}))


def test_validation_checks_model_and_server_entries_before_anything_starts(clip_dir, tiny_sd3_dir, tmp_path):
    def problems(entries: str) -> dict[str, str]:
        cfg = load_config(overrides=[f"actor_rollout_ref.model.path={tiny_sd3_dir}", f"reward.reward_functions={entries}"])
        return {p.key: p.message for p in config_problems(cfg, CPU_ONLY)}

    head = clip_dir / AESTHETIC_HEAD_FILE
    good = (
        f"[{{name: pickscore, model_path: {clip_dir}, dtype: bfloat16, batch_size: 8}}, "
        f"{{name: aesthetic, model_path: {clip_dir}, head_path: {head}}}, "
        "{name: ocr, server_url: 'http://127.0.0.1:9/score', headers: {Authorization: 'env:OCR_TOKEN'}, max_concurrency: 2}]"
    )
    assert problems(good) == {}
    found = problems(
        f"[{{name: pickscore}}, {{name: clip_score, model_path: {tmp_path}}}, {{name: aesthetic, model_path: {clip_dir}, "
        f"head_path: {clip_dir / 'config.json'}}}, {{name: ocr, server_url: 'ftp://x/score'}}]"
    )
    assert set(found) == {
        "reward.reward_functions[0].model_path",
        "reward.reward_functions[1].model_path",
        "reward.reward_functions[2].head_path",
        "reward.reward_functions[3].server_url",
    }
    assert "pickscore needs model_path" in found["reward.reward_functions[0].model_path"]
    assert "no model folder (config.json)" in found["reward.reward_functions[1].model_path"]
    assert "must be an http:// or https:// URL" in found["reward.reward_functions[3].server_url"]
    # A key of another kind is refused by validation, naming the keys the entry's kind takes.
    other_kind = problems("[{name: ocr, server_url: 'http://h/score', dtype: bfloat16}]")
    assert list(other_kind) == ["reward.reward_functions[0].dtype"]
    assert "a reward-server entry (server_url) takes name, server_url, headers" in other_kind["reward.reward_functions[0].dtype"]


def test_verl_reward_model_keys_enable_false_is_taken_the_vllm_judge_is_refused(tiny_sd3_dir):
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"
    assert prepare_run_config(None, [model, "reward.reward_model.enable=False"]).reward.reward_model.enable is False
    for extra in (
        ["reward.reward_model.enable=True"],
        ["reward.reward_model.enable=True", "reward.reward_model.rollout.name=vllm"],
    ):
        with pytest.raises(ConfigError) as err:
            prepare_run_config(None, [model, *extra])
        assert err.value.keys == ["reward.reward_model"]  # one problem for the section, with the way out
        assert "{name: pickscore | clip_score | aesthetic, model_path" in str(err.value) and "server_url" in str(err.value)
    with pytest.raises(ValueError, match="reward.reward_model.enable=true is not supported"):
        RewardManager({"reward_model": {"enable": True}})


def test_every_node_must_read_the_model_rewards_folders_but_not_a_servers_url(clip_dir, tiny_sd3_dir, tmp_path):
    """The multi-node storage check (`omni_core.distributed.shared_storage`) lists what each node opens: a model reward's
    config.json and head, a reward file; a server term and verl-omni's HTTP client entry open nothing."""
    from omni_core.distributed.shared_storage import files_every_node_reads

    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n")
    config = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            "reward.reward_functions=["
            f"{{name: aesthetic, model_path: {clip_dir}, head_path: {clip_dir / AESTHETIC_HEAD_FILE}}},"
            f"{{path: {reward_file}}},"
            "{name: ocr, server_url: 'http://127.0.0.1:9/score'},"
            "{name: ocr2, path: 'pkg://verl_omni.utils.reward_score.http_scorer_client', server_url: 'http://127.0.0.1:9'}]",
        ]
    )
    assert files_every_node_reads(config)[1:] == [
        ("reward.reward_functions[0].model_path", str(clip_dir / "config.json")),
        ("reward.reward_functions[0].head_path", str(clip_dir / AESTHETIC_HEAD_FILE)),
        ("reward.reward_functions[1].path", str(reward_file)),
    ]

"""`omniflow export` and `omniflow evaluate` on real checkpoints, no training run of their own.

Full fine-tuning: the session's reference run (`flow_reference`: the lean config, tiny SD3, no EMA). LoRA: a
checkpoint written the way a run writes one (`TrainingActor.save` into a `CheckpointWriter`, with the config), its
adapter moved away from the zero start and folded into an EMA once, so the EMA, the trained adapter and the base
all differ. The CLI runs once as a subprocess (the installed `omniflow` entry point); the rest calls
`flows/cli.py: main` in this process.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omniflow.flows.cli import main as omniflow
from PIL import Image

from omni_core.checkpoint import CheckpointWriter, read_tensors
from omni_core.config import load_config, to_yaml
from omni_core.models.lora import DIFFUSERS_PREFIX, LORA_WEIGHT_NAME, PEFT_PREFIX

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]  # scale alpha / rank = 2


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_sd3_dir, tmp_path_factory) -> Path:
    """`<run>/global_step_3` of a LoRA run that kept an EMA: EMA = 0.9 x the trained adapter (the first fold, d = 0.1,
    of an average that starts at the zero-B adapter: ema + 0.9 (theta - ema))."""
    from omni_core.workers.training_actor import TrainingActor

    threads = torch.get_num_threads()
    cfg = load_config(
        overrides=[f"actor_rollout_ref.model.path={tiny_sd3_dir}", *LORA, "actor_rollout_ref.actor.ema.enable=true"]
    )
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=1, num_threads=1)
    torch.set_num_threads(threads)
    with torch.no_grad():  # move the adapter away from its zero start, as training would
        gen = torch.Generator().manual_seed(0)
        for name, p in actor.policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    actor.ema.step(actor.get_weights(), 0)
    with CheckpointWriter(tmp_path_factory.mktemp("lora") / "run", 3) as writer:
        actor.save(str(writer.tmp))
        writer.write_config(to_yaml(cfg))
        return writer.commit()


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder under `root`: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _transformer_inputs(config) -> dict:
    gen = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(2, config.in_channels, 4, 4, generator=gen),
        timestep=torch.tensor([500.0, 250.0]),
        encoder_hidden_states=torch.randn(2, 7, config.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=gen),
        return_dict=False,
    )


def _jpeg_reward(image: torch.Tensor) -> float:
    """flow_grpo's jpeg_compressibility, written out: -(bytes of the q=95 JPEG) / 1000 / 500."""
    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=95)
    return -buffer.tell() / 1000 / 500


# ----------------------------------------------------------------------------------------------------- export
def test_export_command_writes_the_reference_run_as_a_pipeline_diffusers_loads(flow_reference, tiny_sd3_dir, tmp_path):
    from diffusers import DiffusionPipeline

    _, result, root = flow_reference
    latest = Path(result.final_checkpoint).resolve()
    out = tmp_path / "exported"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("omniflow")), "export", str(root), str(out)],  # the experiment folder: its newest
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"exported {latest} (step {result.global_step}) as full, the trained weights" in proc.stdout
    info = json.loads((out / "export_info.json").read_text())
    assert (info["checkpoint"], info["step"], info["kind"], info["format"], info["weights"]) == (
        str(latest),
        result.global_step,
        "full",
        "full",
        "model",
    )

    pipe = DiffusionPipeline.from_pretrained(out, local_files_only=True)
    base = DiffusionPipeline.from_pretrained(tiny_sd3_dir, local_files_only=True)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    trained, exported = read_tensors(latest / "actor", "model"), pipe.transformer.state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)  # bit for bit
    assert not all(torch.equal(base.transformer.state_dict()[k], trained[k]) for k in trained)  # training moved them
    assert all(torch.equal(v, base.vae.state_dict()[k]) for k, v in pipe.vae.state_dict().items())  # the rest: the base's


def test_lora_exports_ship_the_ema_and_the_adapter_on_the_base_computes_the_merged_pipeline(
    lora_checkpoint, tiny_sd3_dir, tmp_path, one_torch_thread, capsys
):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    ema, trained = read_tensors(lora_checkpoint / "actor", "ema"), read_tensors(lora_checkpoint / "actor", "model")
    assert omniflow(["export", str(lora_checkpoint), str(tmp_path / "lora")]) == 0
    assert "as lora, the EMA weights" in capsys.readouterr().out
    assert omniflow(["export", str(lora_checkpoint), str(tmp_path / "trained"), "--no-ema"]) == 0
    assert omniflow(["export", str(lora_checkpoint), str(tmp_path / "merged"), "--format", "merged"]) == 0
    assert "as merged, the EMA weights" in capsys.readouterr().out

    def adapter(folder: Path) -> dict[str, torch.Tensor]:  # diffusers' LoRA keys back to peft's
        return {PEFT_PREFIX + k.removeprefix(DIFFUSERS_PREFIX): v for k, v in load_file(folder / LORA_WEIGHT_NAME).items()}

    for folder, expected, weights in ((tmp_path / "lora", ema, "ema"), (tmp_path / "trained", trained, "model")):
        got = adapter(folder)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), folder
        assert json.loads((folder / "export_info.json").read_text())["weights"] == weights
    assert not all(torch.equal(ema[k], trained[k]) for k in ema)

    # The merged transformer: W + (alpha / rank) B @ A with the EMA adapter where a layer is adapted, the base elsewhere.
    base = DiffusionPipeline.from_pretrained(tiny_sd3_dir, local_files_only=True)
    merged = DiffusionPipeline.from_pretrained(tmp_path / "merged", local_files_only=True)
    base_sd, merged_sd = base.transformer.state_dict(), merged.transformer.state_dict()
    assert merged_sd.keys() == base_sd.keys()
    adapted = {k.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight") for k in ema if ".lora_A." in k}
    assert len(adapted) > 10
    for key, weight in base_sd.items():
        if key in adapted:
            stem = PEFT_PREFIX + key.removesuffix(".weight")
            expected = weight + 2.0 * ema[f"{stem}.lora_B.weight"] @ ema[f"{stem}.lora_A.weight"]
            torch.testing.assert_close(merged_sd[key], expected, rtol=0, atol=1e-6)
        else:
            assert torch.equal(merged_sd[key], weight), key

    # The adapter export loaded on the base with diffusers' load_lora_weights computes what the merged one computes.
    inputs = _transformer_inputs(base.transformer.config)
    with torch.no_grad():
        base_out = base.transformer(**inputs)[0]
        merged_out = merged.transformer(**inputs)[0]
        base.load_lora_weights(tmp_path / "lora")
        lora_out = base.transformer(**inputs)[0]
    assert (merged_out - base_out).abs().max() > 1e-4
    # fp32 rounding at the output's scale (a merged W x vs W x + B (A x)).
    torch.testing.assert_close(
        lora_out, merged_out, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(merged_out.abs().max())
    )


def test_export_refusals_name_the_argument_and_leave_every_file_as_it_was(flow_reference, lora_checkpoint, tmp_path, capsys):
    _, _, root = flow_reference
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    damaged = tmp_path / "run" / lora_checkpoint.name  # a copy with one byte of its trained adapter flipped
    shutil.copytree(lora_checkpoint, damaged)
    adapter = damaged / "actor" / "model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-1] ^= 0xFF
    adapter.write_bytes(bytes(data))
    untouched = _tree(tmp_path)

    def refused(*args: str) -> str:
        assert omniflow(["export", *args]) == 2
        return capsys.readouterr().err

    assert f"OUT={mine} is a folder that is not empty; nothing is ever overwritten" in refused(str(root), str(mine))
    err = refused(str(root), str(tmp_path / "out"), "--format", "lora")
    assert "--format lora:" in err and "is a full fine-tuning checkpoint" in err and "Use --format full" in err
    err = refused(str(root), str(tmp_path / "out"), "--ema")
    assert "--ema:" in err and "kept no EMA" in err
    err = refused(str(damaged), str(tmp_path / "out"))
    assert f"CHECKPOINT={damaged}:" in err and "model.safetensors has a different sha256 than the manifest" in err
    assert f"CHECKPOINT={root / 'missing'} does not exist" in refused(str(root / "missing"), str(tmp_path / "out"))
    assert _tree(tmp_path) == untouched  # no output, no staging or temp folder beside it, the inputs unchanged

    (damaged / "manifest.json").unlink()  # a save that never finished
    assert f"CHECKPOINT={damaged} is incomplete (no manifest.json" in refused(str(damaged), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------- evaluate
def test_evaluate_scores_the_base_and_the_checkpoint_at_the_same_seeds(
    flow_reference, flow_overrides, flow_prompts, tiny_sd3_dir, tmp_path, one_torch_thread, capsys
):
    from safetensors.torch import load_file

    from omni_core.models.policy import FlowPolicy
    from omni_core.rollout.sampler import generate
    from omni_core.rollout.sampling_params import SamplingParams

    _, result, _ = flow_reference
    latest = Path(result.final_checkpoint)
    run = tmp_path / "run"  # a copy of the checkpoint: the report goes next to it, not into the shared run's folder
    shutil.copytree(latest, run / latest.name)
    taken = run / f"evaluate-{latest.name}"  # an earlier report's name: the new one takes the next
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")

    assert omniflow(["evaluate", str(run), "--samples", "2"]) == 0  # the experiment folder: its newest checkpoint
    out = run / f"evaluate-{latest.name}-2"
    assert f"report {out}" in capsys.readouterr().out
    assert [p.name for p in taken.iterdir()] == ["notes.txt"] and (taken / "notes.txt").read_text() == "keep me"
    report = json.loads((out / "report.json").read_text())
    assert (report["seed"], report["samples_per_prompt"], report["weights"]) == (42, 2, "model")  # rollout.val_kwargs.seed

    # Independently: the validation prompt sampled with the base weights, then with the checkpoint's trained weights
    # loaded into the transformer, at the validation seed; scored with the JPEG formula written out above.
    config = load_config(overrides=flow_overrides)
    params = SamplingParams.for_validation(config.actor_rollout_ref.rollout).replace(n=2)
    prompts = (flow_prompts / "val.txt").read_text().splitlines()  # the one validation prompt, "a green dot"
    policy = FlowPolicy(tiny_sd3_dir, trainable=False)

    def sample() -> torch.Tensor:
        return generate(policy, prompts, None, prompt_indices=[0], **params.generate_kwargs(global_step=0)).images

    base_images = sample()
    policy.base_transformer.load_state_dict(load_file(latest / "actor" / "model.safetensors"))
    ckpt_images = sample()
    assert not torch.equal(base_images, ckpt_images)
    before, after = [_jpeg_reward(i) for i in base_images], [_jpeg_reward(i) for i in ckpt_images]
    assert before != after

    (row,) = report["per_prompt"]
    assert row["prompt"] == "a green dot"
    assert row["before_samples"] == pytest.approx(before, abs=1e-9)  # float32 scores
    assert row["after_samples"] == pytest.approx(after, abs=1e-9)
    assert report["mean_reward_before"] == pytest.approx(np.mean(before), abs=1e-9)
    assert report["mean_reward_after"] == pytest.approx(np.mean(after), abs=1e-9)
    assert report["mean_reward_before"] != report["mean_reward_after"]
    # The grid (PNG, lossless), tiles of 32 px with 2 px gaps: the base's two samples, then the checkpoint's two.
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    for j, image in enumerate([*base_images, *ckpt_images]):
        x = 2 + j * 34
        assert np.array_equal(grid[2:34, x : x + 32], image.permute(1, 2, 0).numpy()), f"column {j + 1}"
    markdown = (out / "report.md").read_text()
    assert f"| after (checkpoint) | {report['mean_reward_after']:.6f} |" in markdown and "![before | after](grid.png)" in markdown


def test_evaluate_refuses_an_out_folder_that_is_not_empty(flow_reference, tmp_path, capsys):
    _, _, root = flow_reference
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert omniflow(["evaluate", str(root), "--out", str(mine)]) == 2
    assert f"--out={mine} is a folder that is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and [p.name for p in mine.iterdir()] == ["notes.txt"]

"""benchmarks/gpu_smoke.py without a GPU: it refuses to run (exit 2), and its ``--cpu-check`` runs the same
phases on CPU with shrunken published configs and writes the JSON fields that benchmarks/README.md quotes
(the fsdp2 phase's gathered state checked against trainable parameters counted here on the meta device).
Also the published configs themselves: their names are the diffusers constructors' keywords, and the
full-fine-tuning memory rule skips FLUX.1-dev on an H200 but not SD3.5-medium."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_core.models.published_configs import PUBLISHED, count_transformer_parameters, transformer_config

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_smoke.py"
H200_BYTES = 150_000_000_000  # 143771 MiB as the H200 reports it


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _shrunk_transformer_counts(name: str, mode: str, lora_rank: int, lora_targets: list[str]) -> dict[str, int]:
    """Counted on a meta-device copy of the shrunken transformer, independently of the script: trainable parameter
    elements (full: every parameter; LoRA: rank x (in + out) for the A and B matrices of each targeted Linear, peft
    matching a target as the module name or its dotted suffix), state elements (full: + persistent buffers) and
    blocks (FSDP2 shards each of them on its own)."""
    config = transformer_config(name, shrink=True)
    with torch.device("meta"):
        module = PUBLISHED[name].transformer_cls(**config)
    if mode == "full":
        trainable = sum(p.numel() for p in module.parameters())
        state = sum(t.numel() for t in module.state_dict().values())
    else:
        linears = [
            m
            for n, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and any(n.endswith("." + t) for t in lora_targets)
        ]
        trainable = state = sum(lora_rank * (m.in_features + m.out_features) for m in linears)
    blocks = config["num_layers"] + config.get("num_single_layers", 0)
    return {"trainable": trainable, "state": state, "blocks": blocks}


def _numbers(obj, path="$"):
    """Every int / float in a JSON tree with its path (bools are not numbers here)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield path, obj


@pytest.mark.bench
def test_without_cuda_exits_2_with_the_message():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU even on a GPU machine
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gpu_smoke.py needs an NVIDIA GPU (torch.cuda.is_available() is False); run it on a CUDA machine" in proc.stderr


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_names_are_constructor_keywords(name):
    cls = PUBLISHED[name].transformer_cls
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    assert set(transformer_config(name)) <= accepted
    assert set(transformer_config(name, shrink=True)) <= accepted


@pytest.mark.bench
def test_full_fine_tuning_memory_rule():
    rule = _load_script().full_ft_skip_reason
    flux, sd35 = count_transformer_parameters("flux.1-dev"), count_transformer_parameters("sd3.5-medium")
    # 11.90 B x 16 bytes (fp32 weights, grads, two AdamW moments) = 190 GB > 150 GB; 2.24 B x 16 = 36 GB fits.
    assert 11.8e9 < flux < 12.0e9 and 2.2e9 < sd35 < 2.3e9
    reason = rule(flux, H200_BYTES)
    assert reason is not None and "11.90 B parameters x 16 bytes" in reason and "190 GB > 150 GB" in reason
    assert rule(sd35, H200_BYTES) is None


@pytest.mark.bench
def test_cpu_check_runs_every_phase_and_writes_finite_json(tmp_path):
    out = tmp_path / "x.json"
    cmd = [sys.executable, str(SCRIPT), "--cpu-check", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())

    assert result["benchmark"] == "omniflow.gpu_smoke" and result["mode"] == "cpu-check"
    assert result["errors"] == []
    assert {"torch", "diffusers", "transformers", "peft"} <= set(result["versions"])
    assert result["settings"]["models"] == ["sd3.5-medium", "flux.1-dev"]
    assert result["settings"]["compute_dtypes"] == ["float32", "bfloat16"]
    assert result["matmul_peak"]["status"] == "ok" and result["matmul_peak"]["peak_tflops_per_s"] > 0
    bad = [(p, v) for p, v in _numbers(result) if not math.isfinite(v)]
    assert not bad, bad

    batch = 2 * result["settings"]["n"]
    for name in ("sd3.5-medium", "flux.1-dev"):
        model = result["models"][name]
        build = model["build"]
        assert build["status"] == "ok" and build["shrunk"] is True
        assert {"init_s", "cast_to_cpu_s", "save_s", "total_s", "disk_bytes", "transformer_config"} <= set(build)
        assert build["parameters"]["transformer"] > 0
        assert set(model["modes"]) == {"lora", "full"}  # the shrunken models fit: no mode is skipped
        for mode, rec in model["modes"].items():
            settings = result["settings"]
            counts = _shrunk_transformer_counts(name, mode, settings["lora_rank"], settings["lora_targets"])
            if mode == "full":
                assert counts["trainable"] == build["parameters"]["transformer"]
            rollout = rec["rollout"]
            assert rollout["status"] == "ok" and rollout["images"] == batch and rollout["log_probs_finite"] is True
            assert rollout["images_per_s"] > 0 and rollout["weights_dtype"] == "bfloat16"
            assert rollout["peak_memory_gib"] is None  # measured on CUDA only
            precision = rec["logprob_precision"]
            assert precision["status"] == "ok" and precision["transitions"] == batch * result["settings"]["window"]
            assert 0 <= precision["mean_abs"] <= precision["max_abs"]
            assert set(rec["train"]) == {"float32", "bfloat16"}
            for compute, case in rec["train"].items():
                assert case["load"]["status"] == "ok" and case["load"]["weights_dtype"] == "float32"
                assert case["load"]["trainable_parameters"] > 0
                flops = case["flops"]
                assert flops["status"] == "ok" and flops["compute_dtype"] == compute
                fwd, fwd_bwd = flops["forward"], flops["forward_backward"]
                assert 0 < fwd["flops"] < fwd_bwd["flops"] and fwd["attention_flops"] > 0
                for part in (fwd, fwd_bwd):
                    assert part["tflops_per_s"] > 0 and part["fraction_of_bf16_matmul_peak"] > 0
                train = case["train"]
                assert train["status"] == "ok" and train["mini_batch"] == batch
                assert train["update_samples_per_s"] > 0 and train["step_samples_per_s"] > 0
                assert len(train["updates"]) == result["settings"]["updates"]
                assert {"max_abs", "mean_abs"} <= set(train["rollout_vs_recomputed_log_prob"])
                ratio = train["first_on_policy_ratio_mean"]
                # Old log-probs recomputed by the same weights in the update's micro-batch layout: the ratio is 1.
                if compute == "float32":
                    assert abs(ratio - 1.0) <= 1e-3, (name, mode, ratio)
                else:
                    assert abs(ratio - 1.0) <= 1e-2, (name, mode, ratio)

                # The same updates with the transformer FSDP2-sharded over a gloo group of one rank.
                sharded = case["fsdp2_train"]
                assert sharded["status"] == "ok", sharded.get("traceback")
                assert (
                    sharded["backend"] == "gloo" and sharded["world_size"] == 1 and sharded["sharded_blocks"] == counts["blocks"]
                )
                assert sharded["mixed_precision"] == {"param_dtype": compute, "reduce_dtype": "float32"}
                assert sharded["finite"] is True and sharded["nonfinite_metrics"] == []
                assert len(sharded["updates"]) == result["settings"]["updates"] and sharded["mini_batch"] == batch
                assert sharded["update_samples_per_s"] > 0 and sharded["peak_memory_gib"] is None
                assert abs(sharded["first_on_policy_ratio_mean"] - 1.0) <= 1e-3, (name, mode, compute, sharded["updates"][0])
                # Same fresh weights and old log-probs as `train`: the same first gradient (bit-equal seen in fp32;
                # bf16: ~1% apart, parameters cast by FSDP2's policy rather than by autocast alone).
                rel = sharded["first_grad_norm_rel_diff_vs_train"]
                assert rel <= (1e-5 if compute == "float32" else 5e-2), (name, mode, compute, rel)
                gathered = sharded["gathered_state"]
                assert gathered["all_finite"] is True and gathered["tensors"] > 0
                assert sharded["trainable_parameters"] == counts["trainable"] == case["load"]["trainable_parameters"]
                assert gathered["parameter_elements"] == counts["trainable"], (name, mode, gathered)
                assert gathered["elements"] == counts["state"], (name, mode, gathered)  # SD3.5 full: + its pos_embed buffer
                assert gathered["parameter_elements_equal_trainable"] is True

"""Device selection, mirroring verl's `auto_set_device`: cuda, else Ascend npu, else cpu.

An explicit `trainer.device` wins when that device exists; asking for one that is absent is a
clear error before anything expensive starts.
"""

from __future__ import annotations

import importlib
import os

import torch

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig, with_updates


def npu_count() -> int:
    """Ascend NPUs visible to this process (0 when `torch_npu` is not installed)."""
    try:
        torch_npu = importlib.import_module("torch_npu")  # noqa: F841  (registers torch.npu)
    except Exception:
        return 0
    try:
        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception:
        return 0


def available_devices() -> dict[str, int]:
    """How many devices of each kind this process sees; `cpu` counts cores."""
    return {
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "npu": npu_count(),
        "cpu": os.cpu_count() or 1,
    }


def detect_device() -> str:
    """cuda when available, else npu when torch_npu has devices, else cpu."""
    counts = available_devices()
    if counts["cuda"] > 0:
        return "cuda"
    if counts["npu"] > 0:
        return "npu"
    return "cpu"


def auto_set_device(config: OmniFlowConfig) -> OmniFlowConfig:
    """Resolve `trainer.device` (auto -> the detected device); error if an explicit one is absent."""
    requested = config.trainer.device
    if requested == "auto":
        return with_updates(config, {"trainer.device": detect_device()})
    if requested != "cpu" and available_devices()[requested] == 0:
        raise ConfigError(
            [
                ConfigProblem(
                    "trainer.device",
                    f"no {requested} device is visible to this process; use trainer.device=auto "
                    f"(picks {detect_device()} here) or trainer.device=cpu",
                    requested,
                )
            ]
        )
    return config

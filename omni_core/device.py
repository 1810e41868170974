"""Device selection, mirroring verl's `auto_set_device`: cuda, else Ascend npu, else cpu.

An explicit `trainer.device` wins when that device exists; asking for one that is absent is a
clear error before anything expensive starts. torch is imported only when the machine shows an
accelerator driver (or torch is loaded already): on a CPU-only machine `omniflow validate` then
answers without paying torch's import (about a second and 200 MB).
"""

from __future__ import annotations

import glob
import importlib
import os
import sys

from omni_core.config import ConfigError, ConfigProblem, OmniFlowConfig, with_updates

# torch.distributed backend of each device type (the training ranks' process group).
PROCESS_GROUP_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}

# Device files of the NVIDIA (CUDA), WSL (dxg), ROCm (kfd, also torch.cuda) and Ascend drivers.
# /proc/driver/nvidia exists once the driver is loaded, even before /dev/nvidiaN is created on first use.
ACCELERATOR_DRIVER_FILES = ("/dev/nvidia[0-9]*", "/proc/driver/nvidia/gpus/*", "/dev/dxg", "/dev/kfd", "/dev/davinci[0-9]*")


def accelerator_driver_present() -> bool:
    """Whether any accelerator driver shows on this machine (without importing torch)."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DRIVER_FILES)


def npu_count() -> int:
    """Ascend NPUs visible to this process (0 when `torch_npu` is not installed)."""
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except Exception:
        return 0
    import torch

    try:
        return int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception:
        return 0


def available_devices() -> dict[str, int]:
    """How many devices of each kind this process sees; `cpu` counts cores."""
    counts = {"cuda": 0, "npu": 0, "cpu": os.cpu_count() or 1}
    if "torch" in sys.modules or accelerator_driver_present():
        import torch

        counts["cuda"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        counts["npu"] = npu_count()
    return counts


def detect_device(counts: dict[str, int] | None = None) -> str:
    """cuda when available, else npu when torch_npu has devices, else cpu."""
    counts = counts or available_devices()
    if counts["cuda"] > 0:
        return "cuda"
    if counts["npu"] > 0:
        return "npu"
    return "cpu"


def auto_set_device(config: OmniFlowConfig) -> OmniFlowConfig:
    """Resolve `trainer.device` (auto -> the detected device); error if an explicit one is absent. A run that
    joins a cluster (`ray_kwargs.ray_init.address`) may name a device its driver lacks: the cluster's GPUs are
    checked once connected (`ray_cluster.check_cluster_devices`)."""
    requested = config.trainer.device
    if requested == "cpu" or requested != "auto" and config.ray_kwargs.ray_init.address:
        return config
    counts = available_devices()
    if requested == "auto":
        return with_updates(config, {"trainer.device": detect_device(counts)})
    if counts[requested] == 0:
        raise ConfigError(
            [
                ConfigProblem(
                    "trainer.device",
                    f"no {requested} device is visible to this process; use trainer.device=auto "
                    f"(picks {detect_device(counts)} here) or trainer.device=cpu",
                    requested,
                )
            ]
        )
    return config

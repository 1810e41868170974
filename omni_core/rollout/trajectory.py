"""``Trajectory``: the record one rollout batch hands to rewards, the trainer and the transfer queue.

Only the SDE window is stored (docs/design.md section 5). With B samples, window
length W and per-sample latent shape ``S`` (SD3 ``(C, h, w)``, FLUX packed ``(N, 4C)``):

============== ===================== =====================================================================
field          shape / dtype          meaning
============== ===================== =====================================================================
latents        [B, W+1, *S] fp32      window-start latent, then the output of each in-window step
log_probs      [B, W] fp32            log-prob of each in-window transition (NaN if not computed)
timesteps      [B, W] fp32            scheduler timestep (sigma * 1000) fed to the model at each step
sigmas         [B, W+1] fp32          sigma of each stored latent (``sigmas[:, j]`` -> ``sigmas[:, j+1]``)
sigma_max      [B] fp32               substitute for sigma == 1 in the ``sde`` std (``schedule_sigmas[1]``)
window_start   [B] int64              index of the first SDE step in the full schedule
cond           dict[str, [B, ...]]    prompt embeddings (``prompt_embeds [B, L, D]``, ``pooled_prompt_embeds
                                      [B, P]``, ``negative_*`` with CFG), fp32
images         [B, 3, H, W] uint8     decoded final images
prompts        list[str] (B)          the prompt of each sample
sample_seeds   [B] int64              63-bit per-sample seed (``derive_sample_seed``)
prompt_index   [B] int64              index of the prompt in the dataset / batch (the GRPO group id)
sample_index   [B] int64              index of the sample within its prompt's group
============== ===================== =====================================================================

Transition ``j`` goes from ``latents[:, j]`` to ``latents[:, j+1]``. ``to_columns`` / ``from_columns`` are
the TransferQueue row schema (the rollout worker writes it, the training actor reads it back);
``index_select`` / ``cat`` pick and join samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_FLOAT_FIELDS = ("latents", "log_probs", "timesteps", "sigmas", "sigma_max")
_LONG_FIELDS = ("window_start", "sample_seeds", "prompt_index", "sample_index")
_TENSOR_FIELDS = _FLOAT_FIELDS + _LONG_FIELDS + ("images",)
COND_PREFIX = "cond."


@dataclass
class Trajectory:
    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sigma_max: torch.Tensor
    window_start: torch.Tensor
    cond: dict[str, torch.Tensor]
    images: torch.Tensor
    prompts: list[str]
    sample_seeds: torch.Tensor
    prompt_index: torch.Tensor
    sample_index: torch.Tensor

    def __post_init__(self) -> None:
        # fp32 storage whatever the model dtype: log-prob ratios must be recomputed in fp32.
        for name in _FLOAT_FIELDS:
            setattr(self, name, getattr(self, name).float())
        for name in _LONG_FIELDS:
            setattr(self, name, getattr(self, name).long())
        self.cond = {k: v.float() for k, v in self.cond.items()}
        self.prompts = list(self.prompts)
        b, w = self.log_probs.shape
        checks = {
            "latents": (self.latents.shape[:2], (b, w + 1)),
            "timesteps": (self.timesteps.shape, (b, w)),
            "sigmas": (self.sigmas.shape, (b, w + 1)),
            "images": (self.images.shape[:1], (b,)),
            "prompts": ((len(self.prompts),), (b,)),
        }
        checks |= {name: (getattr(self, name).shape, (b,)) for name in ("sigma_max",) + _LONG_FIELDS}
        checks |= {COND_PREFIX + k: (v.shape[:1], (b,)) for k, v in self.cond.items()}
        bad = {k: tuple(got) for k, (got, want) in checks.items() if tuple(got) != want}
        if bad:
            raise ValueError(f"Trajectory with B={b}, W={w}: inconsistent shapes {bad}")
        if self.images.dtype != torch.uint8:
            raise ValueError(f"Trajectory.images must be uint8, got {self.images.dtype}")

    @property
    def batch_size(self) -> int:
        return self.log_probs.shape[0]

    @property
    def window_size(self) -> int:
        return self.log_probs.shape[1]

    def __len__(self) -> int:
        return self.batch_size

    def to(self, device: torch.device | str) -> Trajectory:
        moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        cond = {k: v.to(device) for k, v in self.cond.items()}
        return Trajectory(**moved, cond=cond, prompts=self.prompts)

    def index_select(self, index: torch.Tensor | Sequence[int]) -> Trajectory:
        """The samples at ``index`` (in that order), as a new Trajectory."""
        idx = torch.as_tensor(index, dtype=torch.long)
        picked = {name: getattr(self, name)[idx.to(getattr(self, name).device)] for name in _TENSOR_FIELDS}
        cond = {k: v[idx.to(v.device)] for k, v in self.cond.items()}
        return Trajectory(**picked, cond=cond, prompts=[self.prompts[i] for i in idx.tolist()])

    @classmethod
    def cat(cls, parts: Sequence[Trajectory]) -> Trajectory:
        """Concatenate along the batch; all parts need the same window length, latent shape and cond keys."""
        if not parts:
            raise ValueError("Trajectory.cat needs at least one part")
        keys = set(parts[0].cond)
        if any(set(p.cond) != keys for p in parts):
            raise ValueError(f"cannot cat trajectories with different cond keys: {[sorted(p.cond) for p in parts]}")
        joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in _TENSOR_FIELDS}
        cond = {k: torch.cat([p.cond[k] for p in parts]) for k in parts[0].cond}
        prompts = [s for p in parts for s in p.prompts]
        return cls(**joined, cond=cond, prompts=prompts)

    def to_columns(self, window: bool = True) -> dict[str, torch.Tensor]:
        """The TransferQueue row schema: one ``[B, ...]`` column per field, ``cond.<key>`` for the prompt
        embeddings; the prompts themselves are not stored. ``window=False`` keeps only the images and the
        per-sample ids (a validation row)."""
        names = _TENSOR_FIELDS if window else ("images", *_LONG_FIELDS[1:])
        columns = {name: getattr(self, name) for name in names}
        if window:
            columns |= {COND_PREFIX + k: v for k, v in self.cond.items()}
        return columns

    @classmethod
    def from_columns(cls, columns: dict[str, object]) -> Trajectory:
        """A training batch from the columns ``get_trajectories`` returns (the inverse of ``to_columns``;
        other columns, such as rewards, are ignored; prompts come back empty)."""
        cond = {k.removeprefix(COND_PREFIX): v for k, v in columns.items() if k.startswith(COND_PREFIX)}
        tensors = {name: columns[name] for name in _TENSOR_FIELDS}
        return cls(**tensors, cond=cond, prompts=[""] * len(columns["latents"]))

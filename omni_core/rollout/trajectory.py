"""``Trajectory``: the record one rollout batch hands to rewards, the trainer and the transfer queue.

Only the SDE window is stored (reference/diffusion-rl.md §1.6; DESIGN.md §5). With B samples, window
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

Transition ``j`` goes from ``latents[:, j]`` to ``latents[:, j+1]``. ``to_rows`` / ``from_rows`` split a
batch into one dict per sample (no batch dim) and back, for a key-value queue; ``index_select`` / ``cat``
do the same on whole batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

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

    def to_rows(self) -> list[dict[str, object]]:
        """One dict per sample: tensors without the batch dim, ``cond.<key>`` for the cond entries,
        ``prompt`` (str) and the integer ids as Python ints."""
        rows = []
        for i in range(self.batch_size):
            row: dict[str, object] = {name: getattr(self, name)[i] for name in _FLOAT_FIELDS + ("images",)}
            row |= {COND_PREFIX + k: v[i] for k, v in self.cond.items()}
            row |= {name: int(getattr(self, name)[i]) for name in _LONG_FIELDS}
            row["prompt"] = self.prompts[i]
            rows.append(row)
        return rows

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, object]]) -> Trajectory:
        """Inverse of ``to_rows`` (rows may come from different batches with the same W and shapes)."""
        if not rows:
            raise ValueError("Trajectory.from_rows needs at least one row")
        stacked = {name: torch.stack([torch.as_tensor(r[name]) for r in rows]) for name in _FLOAT_FIELDS + ("images",)}
        ints = {name: torch.tensor([int(r[name]) for r in rows], dtype=torch.long) for name in _LONG_FIELDS}
        cond_keys = [k for k in rows[0] if k.startswith(COND_PREFIX)]
        cond = {k.removeprefix(COND_PREFIX): torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in cond_keys}
        return cls(**stacked, **ints, cond=cond, prompts=[str(r["prompt"]) for r in rows])


# Names of the per-row fields (for a queue schema).
ROW_FIELDS = tuple(f.name for f in fields(Trajectory) if f.name not in ("cond", "prompts")) + ("prompt",)

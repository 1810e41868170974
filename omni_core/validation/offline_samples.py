"""Offline samples (`algorithm.sample_source=offline`: verl-omni's offline Diffusion-DPO) and `data.custom_cls`.

An offline run trains on a data set's preference pairs (`omni_core.data.preference_pairs`): no rollout, no reward,
no validation images (verl-omni skips its validation too). What it cannot be combined with is refused here, naming
the keys: a loss other than Diffusion-DPO's, a validation it cannot run, and the keys of a rollout and its scoring,
which nothing would read. `data.custom_cls` is verl's hook for a user's dataset class; OmniFlow runs no dataset code
of its choosing, so the only class accepted is verl-omni's offline DPO data set, whose file layout OmniFlow reads.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.validation.refused import config_value, default_config

# verl-omni's offline DPO data set, as its recipe names it (data.custom_cls.*); the path may be written with pkg://.
OFFLINE_DPO_DATASET = {
    "path": "verl_omni.utils.dataset.offline_dpo_dataset",
    "name": "OfflineDPODataset",
    "collate_fn": "offline_dpo_collate_fn",
}
# Keys of the rollout and its scoring that an offline run never reads, with what stands in for them.
NOT_READ_OFFLINE = {
    "actor_rollout_ref.rollout.n": "each prompt's samples are its pair's two images",
    "actor_rollout_ref.rollout.agent.num_workers": "there are no rollout workers",
    "data.gen_batch_size": "nothing is generated",
    "trainer.v1.sampler.drop_incomplete_groups": "no group can fail to generate",
    "reward.custom_reward_function.path": "the pairs carry their scores (win_score, lose_score)",
    "reward.reward_functions": "the pairs carry their scores (win_score, lose_score)",
}


def offline_sample_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    return [*_custom_cls_problems(config), *(_offline_problems(config) if config.algorithm.sample_source == "offline" else [])]


def _custom_cls_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    cls = config.data.custom_cls
    given = {"path": cls.path, "name": cls.name, "collate_fn": cls.collate_fn}
    if all(v is None for v in given.values()):
        return []
    path = (cls.path or "").removeprefix("pkg://").removesuffix(".py").replace("/", ".")
    known = path == OFFLINE_DPO_DATASET["path"] and cls.name == OFFLINE_DPO_DATASET["name"]
    known = known and cls.collate_fn in (None, OFFLINE_DPO_DATASET["collate_fn"])
    if not known:
        return [
            ConfigProblem(
                "data.custom_cls",
                "OmniFlow runs no dataset class of its own choosing: it reads prompt files (data.custom_cls null) or, "
                "with algorithm.sample_source=offline, verl-omni's offline DPO pair files (data.custom_cls.path="
                f"pkg://{OFFLINE_DPO_DATASET['path']}, name={OFFLINE_DPO_DATASET['name']}); remove the key or name that class",
                given,
            )
        ]
    if config.algorithm.sample_source != "offline":
        return [
            ConfigProblem(
                "data.custom_cls",
                "names verl-omni's offline DPO data set (preference pairs), which only offline samples read: set "
                "algorithm.sample_source=offline, or remove the key to train on prompts",
                given,
            )
        ]
    return []


def _offline_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    arr, trainer = config.actor_rollout_ref, config.trainer
    loss_mode = arr.actor.diffusion_loss.loss_mode
    if loss_mode != "dpo":
        p.append(
            ConfigProblem(
                "algorithm.sample_source",
                f"offline samples are a data set's preference pairs, which only Diffusion-DPO trains on (loss_mode=dpo, "
                f"model.algorithm=dpo, model.model_type=diffusion_dpo_model, algorithm.trainer_type=direct_preference, "
                f"algorithm.paired_preference=true), not loss_mode={loss_mode}; set those keys or sample_source=online",
                "offline",
            )
        )
    if config.data.val_files is not None:
        asked = [
            (key, value)
            for key, value, on in (
                ("trainer.val_before_train", trainer.val_before_train, trainer.val_before_train),
                ("trainer.test_freq", trainer.test_freq, trainer.test_freq > 0),
                ("trainer.val_only", trainer.val_only, trainer.val_only),
            )
            if on
        ]
        for key, value in asked:
            p.append(
                ConfigProblem(
                    key,
                    "an offline run samples no images, so there is nothing to validate (verl-omni skips its validation "
                    "too): set trainer.val_before_train=false and trainer.test_freq=-1 (trainer.val_only=false), or "
                    "data.val_files=null",
                    value,
                )
            )
    defaults = default_config()
    for key, why in NOT_READ_OFFLINE.items():
        value = config_value(config, key)
        if value != config_value(defaults, key):
            p.append(
                ConfigProblem(
                    key,
                    f"is not read with algorithm.sample_source=offline ({why}); drop the key",
                    list(value) if isinstance(value, tuple) else value,
                )
            )
    return p

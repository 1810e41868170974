"""Reward entries that are not files: built-in and added names, model rewards (local folders) and reward servers (URLs).

Checked before anything starts, without loading a model or calling a server: the entry's keys fit its kind
(`omni_core.rewards.entries`; the one place a config's entries are checked, the loader leaves them to this), a
name is a built-in or a reward a recipe or package adds (`omni_core.rewards.plugins`, read without importing it), a
model reward's folder holds a model, an aesthetic head file exists, a server URL is http(s) with a host. And
`reward.reward_model.enable` stays false (verl-omni's vLLM-served judge).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.unsupported import REWARD_MODEL_REASON
from omni_core.models.hub import TRANSFORMERS_SKIP, hub_problem, is_hub_id
from omni_core.rewards.entries import display_url, entry_kind, given_entry_keys, refused_entry_keys
from omni_core.rewards.names import BUILTIN_REWARD_NAMES, MODEL_REWARD_NAMES, PACKAGED_REWARD_NAMES
from omni_core.rewards.plugins import added_reward_names

HEAD_SUFFIXES = (".safetensors", ".pth", ".pt")

# verl-omni passes an entry's other keys to compute_score as keyword arguments; OmniFlow has no such channel.
EXTRA_ENTRY_KEYS = (
    "verl-omni's extra entry keys (passed to compute_score as keyword arguments) are not supported: put the value in "
    "your reward file and remove this key"
)


def reward_model_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    if config.reward.reward_model.enable:
        return [ConfigProblem("reward.reward_model", f"not supported by OmniFlow: {REWARD_MODEL_REASON}", True)]
    return []


def entry_problems(key: str, spec: object) -> list[ConfigProblem]:
    """Problems of one entry `reward.reward_functions[i]` (`key`): its keys, and what a non-file entry names (a reward
    file itself is checked by `rewards.reward_problems`)."""
    given = given_entry_keys(spec)
    refused = refused_entry_keys(given)
    if refused:
        return [
            ConfigProblem(
                f"{key}.{k}",
                f"not supported by OmniFlow: {why}" + (f"; {EXTRA_ENTRY_KEYS}" if why.startswith("unknown key") else ""),
                given[k],
            )
            for k, why in sorted(refused.items())
        ]
    kind = entry_kind(given)
    if kind == "file":
        return []  # the file itself: `rewards.reward_problems`
    if kind in ("server", "verl_http"):
        return _server_problems(key, spec)
    if kind == "model":
        return _model_problems(key, spec)
    if kind == "packaged":
        return []  # the model ships in an installed package: nothing to point at
    name = getattr(spec, "name", None)
    added = added_reward_names()
    if not name:
        return [
            ConfigProblem(
                key,
                f"needs a name (a built-in: {', '.join(BUILTIN_REWARD_NAMES + PACKAGED_REWARD_NAMES)}; a model reward: {', '.join(MODEL_REWARD_NAMES)} "
                f"with model_path{_added_text(added)}), a path (a reward file) or a server_url (a reward server)",
                None,
            )
        ]
    if name not in BUILTIN_REWARD_NAMES and name not in added:
        return [
            ConfigProblem(
                f"{key}.name",
                f"no built-in reward of that name; built-ins: {', '.join(BUILTIN_REWARD_NAMES + PACKAGED_REWARD_NAMES)}; model rewards: "
                f"{', '.join(MODEL_REWARD_NAMES)} (with model_path){_added_text(added)}; or give a path to your own "
                "compute_score file, or a server_url",
                name,
            )
        ]
    return []


def _added_text(added: dict[str, str]) -> str:
    """The rewards recipes or packages add, as the errors above list them (nothing when there are none)."""
    if not added:
        return ""
    return "; added by recipes or packages: " + ", ".join(f"{n} ({owner})" for n, owner in sorted(added.items()))


def _server_problems(key: str, spec: object) -> list[ConfigProblem]:
    url = str(getattr(spec, "server_url", None) or "")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        shown = display_url(url)  # never the credentials or query of a malformed URL (`user:pw@host/score`)
        return [
            ConfigProblem(
                f"{key}.server_url", "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8765/score", shown
            )
        ]
    return []


def _model_problems(key: str, spec: object) -> list[ConfigProblem]:
    name = getattr(spec, "name", None)
    p: list[ConfigProblem] = []
    model_path = getattr(spec, "model_path", None)
    if not model_path:
        p.append(
            ConfigProblem(
                f"{key}.model_path",
                f"{name} needs model_path, the CLIP model (config.json + weights) and its processor files: a local "
                "folder or a Hugging Face Hub id (e.g. yuvalkirstain/PickScore_v1; openai/clip-vit-large-patch14 for aesthetic)",
                None,
            )
        )
    elif is_hub_id(model_path):
        reason = hub_problem(model_path, getattr(spec, "revision", None), f"{key}.model_path", skip=TRANSFORMERS_SKIP)
        if reason:
            p.append(ConfigProblem(f"{key}.model_path", reason, model_path))
    elif not (Path(model_path).expanduser() / "config.json").is_file():
        p.append(
            ConfigProblem(
                f"{key}.model_path",
                "no model folder (config.json) there; point it at the local model folder or a Hugging Face Hub id",
                model_path,
            )
        )
    processor_path = getattr(spec, "processor_path", None)
    if is_hub_id(processor_path):
        reason = hub_problem(processor_path, None, f"{key}.processor_path", skip=TRANSFORMERS_SKIP)
        if reason:
            p.append(ConfigProblem(f"{key}.processor_path", reason, processor_path))
    elif processor_path and not Path(processor_path).expanduser().is_dir():
        p.append(
            ConfigProblem(
                f"{key}.processor_path",
                "no such folder; point it at the CLIPProcessor's local folder or a Hugging Face Hub id",
                processor_path,
            )
        )
    if name == "aesthetic":
        head = getattr(spec, "head_path", None)
        if not head:
            p.append(
                ConfigProblem(f"{key}.head_path", "aesthetic needs head_path, the MLP head (.safetensors, or LAION's .pth)", None)
            )
        elif not Path(head).expanduser().is_file():
            p.append(ConfigProblem(f"{key}.head_path", "no such file; point it at the aesthetic MLP head", head))
        elif Path(head).suffix not in HEAD_SUFFIXES:
            p.append(ConfigProblem(f"{key}.head_path", f"expected a {' or '.join(HEAD_SUFFIXES)} file", head))
    return p

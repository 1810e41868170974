"""One entry of `reward.reward_functions`: which kind it is and which keys that kind takes; light (no torch).

Six kinds, told apart by the keys an entry gives (first match wins):

  verl_http  `path: pkg://verl_omni.utils.reward_score.http_scorer_client` (verl-omni's HTTP scorer client): a
             server term in flow_grpo's pickle format that sends each sample's ground_truth as its prompt, as
             that client does
  file       `path` (+ `function`): a Python file with a compute_score-style function
  server     `server_url`: a reward server (`omni_core.rewards.server_client`)
  model      `name` one of MODEL_REWARD_NAMES: a model loaded from `model_path` (`omni_core.rewards.model_rewards`)
  packaged   `name` one of PACKAGED_REWARD_NAMES: a model shipped in an installed package (`ocr`: `omni_core.rewards.ocr`)
  builtin    `name` one of BUILTIN_REWARD_NAMES

A key the entry's kind does not take is refused with the keys it does take, so a typo or a key of another kind
never passes silently. Validation applies this to a loaded entry's non-default values and unknown keys (a dumped
and reloaded config carries every field; the schema keeps unknown keys for this), and the reward manager to the
entries it is built from (a library user may skip validation).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from omni_core.rewards.names import MODEL_REWARD_NAMES, PACKAGED_REWARD_NAMES

__all__ = [
    "ALL_ENTRY_KEYS",
    "ENTRY_KEYS",
    "VERL_HTTP_CLIENT",
    "display_url",
    "entry_kind",
    "given_entry_keys",
    "refused_entry_keys",
]

VERL_HTTP_CLIENT = "pkg://verl_omni.utils.reward_score.http_scorer_client"


def display_url(url: str) -> str:
    """A server entry's `url` as errors and logs show it: without its query string and fragment and without anything up
    to the last `@` (a `user:password@` part; either may carry a secret). Written for malformed URLs too, as a config
    error shows them: no scheme (`user:pw@host/score`), an unencoded `/` in a password. The host stays as written
    (an IPv6 host keeps its brackets); a path holding an `@` is shown from after it."""
    base = re.split(r"[?#]", url, maxsplit=1)[0]
    scheme, sep, rest = base.partition("://")
    if not sep:
        scheme, rest = "", base
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


_SERVER_KEYS = ("server_url", "headers", "batch_size", "max_concurrency", "request_timeout_s", "max_retries", "retry_backoff")
ENTRY_KEYS: dict[str, tuple[str, ...]] = {
    "builtin": ("name", "weight"),
    "file": ("name", "path", "function", "weight"),
    "model": ("name", "model_path", "processor_path", "revision", "head_path", "dtype", "batch_size", "weight"),
    "packaged": ("name", "batch_size", "weight"),
    "server": ("name", *_SERVER_KEYS, "format", "prompts_from", "weight"),
    "verl_http": ("name", "path", "function", *_SERVER_KEYS, "prompts_from", "weight"),
}
ALL_ENTRY_KEYS: frozenset[str] = frozenset(k for keys in ENTRY_KEYS.values() for k in keys)

_REQUIRED = (
    "OmniFlow never turns a failed reward into a score: a failed sample gets advantage 0 and is left out of its group's "
    "statistics, and reward.max_failure_ratio decides when failures stop the step (0 stops at the first failure, as "
    "required=true does). Remove this key and set reward.max_failure_ratio"
)


def entry_kind(entry: Mapping[str, Any]) -> str:
    """The kind of an entry given as the mapping of its keys (see the module docstring)."""
    path = entry.get("path")
    if path and str(path).rstrip("/") == VERL_HTTP_CLIENT:
        return "verl_http"
    if path:
        return "file"
    if entry.get("server_url"):
        return "server"
    if entry.get("name") in MODEL_REWARD_NAMES:
        return "model"
    if entry.get("name") in PACKAGED_REWARD_NAMES:
        return "packaged"
    return "builtin"


def refused_entry_keys(entry: Mapping[str, Any]) -> dict[str, str]:
    """Keys of `entry` that its kind does not take -> why (naming the keys it does take)."""
    kind = entry_kind(entry)
    allowed = set(ENTRY_KEYS[kind])
    if kind == "model" and entry.get("name") != "aesthetic":
        allowed.discard("head_path")
    refused: dict[str, str] = {}
    for key in entry:
        if key == "required":
            refused[key] = _REQUIRED
        elif key not in allowed:
            what = {
                "builtin": f"a built-in reward entry ({entry.get('name')!r})",
                "file": "a reward-file entry (path)",
                "model": f"a {entry.get('name')} model entry",
                "packaged": f"a {entry.get('name')} entry (its model ships in an installed package)",
                "server": "a reward-server entry (server_url)",
                "verl_http": "verl-omni's http_scorer_client entry",
            }[kind]
            known = "" if key in ALL_ENTRY_KEYS else "unknown key; "
            refused[key] = f"{known}{what} takes {', '.join(k for k in ENTRY_KEYS[kind] if k in allowed)}"
    if kind == "verl_http" and entry.get("function") not in (None, "compute_score"):
        refused["function"] = f"verl-omni's http_scorer_client has only compute_score, not {entry.get('function')!r}"
    return refused


def given_entry_keys(entry: Any) -> dict[str, Any]:
    """The keys an entry gives: a mapping's own keys, a name string as `{name}`, or a pydantic entry's fields whose
    value is not the field's default (what a user set, also after the config was dumped and loaded again)."""
    if isinstance(entry, str):
        return {"name": entry}
    if isinstance(entry, Mapping):
        return dict(entry)
    fields = getattr(type(entry), "model_fields", None)
    if fields is None:  # a plain object with attributes
        return {k: v for k, v in vars(entry).items() if v is not None}
    given = {}
    for key, info in fields.items():
        value = getattr(entry, key)
        if value != info.get_default(call_default_factory=True):
            given[key] = value
    given.update(getattr(entry, "model_extra", None) or {})  # keys the schema kept without a field (all refused)
    return given

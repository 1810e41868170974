"""Security and cache hygiene (issue 11, items 17-21): cache keys carry the OmniFlow version, cached results
are JSON, a local cluster listens on loopback only, deployment runs take reward files only from allowed
folders (checked on a real served deployment in test_deployments.py), a joined cluster without Ray token auth is named
in the log, and a reward server's URL is shown without its credentials."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest


# ------------------------------------------------------------------ 17: the OmniFlow version in cache keys
def test_cache_keys_change_with_the_omniflow_version_and_the_code_that_shapes_the_value(tmp_path):
    from omni_core.cache_keys import CODE_FILES, OMNI_CORE_DIR, code_version, key_of, omniflow_version

    prompts = tmp_path / "train.txt"
    prompts.write_text("a red circle\n")
    fields = {"max_prompt_length": 77}
    installed = key_of("dataset", [prompts], fields)
    # The installed version is what a key carries by default; another release string gives another key.
    assert installed == key_of("dataset", [prompts], fields, version=omniflow_version())
    assert key_of("dataset", [prompts], fields, version="0.1.0") != key_of("dataset", [prompts], fields, version="0.2.0")
    # Each kind hashes the omni_core sources that shape its value (an editable install keeps one version
    # across commits), and those files exist, so a moved module cannot silently drop out of the hash.
    for kind, files in CODE_FILES.items():
        assert all((OMNI_CORE_DIR / f).is_file() for f in files), (kind, files)
    assert code_version("dataset", "1.0").split("+")[1] != code_version("prompt-embeddings", "1.0").split("+")[1]


# ------------------------------------------------------------------ 19: cached results are JSON, not pickle
def test_cached_setup_results_are_json_files_and_a_cache_hit_returns_equal_records(prefect_api, tiny_sd3_dir, tmp_path):
    from omniflow.tasks.load_tokenizer import _cache_key as tokenizer_key
    from omniflow.tasks.load_tokenizer import load_tokenizer
    from omniflow.tasks.prepare_dataset import _cache_key as dataset_key
    from omniflow.tasks.prepare_dataset import prepare_dataset
    from prefect import flow
    from prefect.settings import get_current_settings

    from omni_core.config.loader import load_config

    # verl-omni rows with everything a record holds: chat prompt, negative prompt, ground truth, extra_info.
    rows = [
        {
            "prompt": [{"role": "user", "content": "a sign that says OMNI"}],
            "negative_prompt": "blurry",
            "data_source": "ocr",
            "reward_model": {"style": "rule", "ground_truth": ["OMNI", 1]},
            "extra_info": {"split": "train", "nested": {"k": [1.5, None]}},
        },
        {"prompt": "a blue square"},
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.txt").write_text("a green dot\n")
    cfg = load_config(
        overrides=[
            f"actor_rollout_ref.model.path={tiny_sd3_dir}",
            f"data.train_files={train}",
            f"data.val_files={tmp_path / 'val.txt'}",
        ]
    )

    @flow(name="json-cached-setup")
    def setup_twice():
        runs = []
        for name in ("first", "again"):
            tok = load_tokenizer.with_options(task_run_name=f"tok-{name}")(cfg.actor_rollout_ref.model, return_state=True)
            data = prepare_dataset.with_options(task_run_name=f"data-{name}")(cfg.data, tok.result(), return_state=True)
            runs.append((tok, data))
        return runs

    (tok1, data1), (tok2, data2) = setup_twice()
    # The tokenizer of the session's tiny model may already be cached by an earlier test (one PREFECT_HOME per
    # session); the dataset of this test's own files is new.
    assert tok1.name in ("Completed", "Cached") and data1.name == "Completed"
    assert (tok2.name, data2.name) == ("Cached", "Cached")
    assert tok2.result() == tok1.result() and tok1.result().path == str((Path(tiny_sd3_dir) / "tokenizer").resolve())
    train1, val1 = data1.result()
    train2, val2 = data2.result()  # read back from the JSON file
    assert (train2, val2) == (train1, val1)
    assert train2[0].ground_truth == ["OMNI", 1] and train2[0].extra_info == {"split": "train", "nested": {"k": [1.5, None]}}
    assert train2[0].prompt == "a sign that says OMNI" and train2[0].negative_prompt == "blurry" and train2[1].index == 1

    storage = Path(get_current_settings().results.local_storage_path).expanduser()
    for key in (
        tokenizer_key(None, {"model": cfg.actor_rollout_ref.model}),
        dataset_key(None, {"data": cfg.data, "tokenizer": tok1.result()}),
    ):
        record = json.loads((storage / key).read_bytes())  # Prefect's result record: JSON metadata + the result
        assert record["metadata"]["serializer"]["type"] == "json", record["metadata"]
        json.loads(record["result"])  # the value itself is JSON text, not a base64 pickle


# ------------------------------------------------------------------ 18: a local cluster listens on loopback only
def assert_listens_on_loopback_only(processes: list) -> None:
    """Every TCP socket in LISTEN state of `processes` (psutil) is bound to a loopback address, and those of the
    run's cluster are among them (GCS, TransferQueue's controller and storage units). Asked of a real run that
    started its own cluster: `omniflow train`'s second run in `test_api_faults.py` (Ray, TransferQueue, its actors
    and the embedded Prefect API), so no run of its own is started here."""
    import psutil

    listening = []
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            listening += [
                (proc.name(), c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN
            ]
    names = " ".join(name for name, _, _ in listening)
    assert "TransferQueueController" in names and "SimpleStorageUnit" in names and "gcs_server" in names, listening
    exposed = [entry for entry in listening if not _is_loopback(entry[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def _is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback seen from a dual-stack socket
    return (mapped or addr).is_loopback


def test_loopback_check_tells_loopback_from_routable_addresses():
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("::ffff:127.0.0.1")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("192.0.2.2") and not _is_loopback("::")


# ------------------------------------------------------------------ 20: reward files of deployment runs
def test_a_deployment_run_refuses_a_reward_file_outside_the_allowed_folders_and_a_plain_call_accepts_it(tmp_path, tiny_sd3_dir):
    import os

    from omni_core.config import ConfigError
    from omni_core.validation import prepare_run_config
    from omni_core.validation.rewards import ALLOWED_REWARD_DIRS_ENV, EXAMPLE_REWARDS_DIR, deployment_reward_dirs

    mine = tmp_path / "mine"
    mine.mkdir()
    reward = mine / "reward.py"
    reward.write_text("def compute_score(data_source, solution_image, ground_truth, extra_info):\n    return 0.0\n")
    model = f"actor_rollout_ref.model.path={tiny_sd3_dir}"  # a real pipeline folder, built by the fixture
    overrides = [model, f"reward.custom_reward_function.path={reward}"]

    # A user's own call (omniflow train, Python): any path.
    assert prepare_run_config(None, overrides).reward.custom_reward_function.path == str(reward)

    # A deployment run with the default allowance (only examples/rewards): refused, naming the env var.
    allowed = deployment_reward_dirs({})
    assert allowed == [EXAMPLE_REWARDS_DIR]
    with pytest.raises(ConfigError) as err:
        prepare_run_config(None, overrides, allowed_reward_dirs=allowed)
    assert "reward.custom_reward_function.path" in str(err.value) and ALLOWED_REWARD_DIRS_ENV in str(err.value)
    # A `..` path that leaves an allowed folder is outside it too; the same rule holds for reward_functions.
    sneaky = f"{EXAMPLE_REWARDS_DIR}/{os.path.relpath(reward, EXAMPLE_REWARDS_DIR)}"  # examples/rewards/../../..
    assert ".." in sneaky and Path(sneaky).resolve() == reward.resolve()
    with pytest.raises(ConfigError, match=r"reward\.reward_functions\[0\]\.path"):
        prepare_run_config(
            None, [model, f"reward.reward_functions=[{{path: {sneaky}, weight: 1.0}}]"], allowed_reward_dirs=allowed
        )

    # The project's own example and a folder the serving side allows are accepted.
    example = EXAMPLE_REWARDS_DIR / "brightness_reward.py"
    prepare_run_config(None, [model, f"reward.custom_reward_function.path={example}"], allowed_reward_dirs=allowed)
    served = deployment_reward_dirs({ALLOWED_REWARD_DIRS_ENV: os.pathsep.join(["/nonexistent", str(mine)])})
    prepare_run_config(None, overrides, allowed_reward_dirs=served)


# ------------------------------------------------------------------ 21: a joined cluster without token auth
_JOIN = """
import sys
from omni_core.config import load_config
from omni_core.distributed.ray_cluster import close_run, start_run_cluster

cfg = load_config(overrides=[f"ray_kwargs.ray_init.address={sys.argv[1]}", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"])
cluster = start_run_cluster(cfg)
close_run(None, cluster.owns_ray)
print("AUTH_WARNING=" + repr(cluster.auth_warning))
"""


def _join_a_head(mode: str) -> tuple[str, str]:
    """Start a real Ray head (`ray start --head`, auth `mode`, `tests/ray_heads.py`), join it as a run does
    (`start_run_cluster` with ray_kwargs.ray_init.address) in another process; returns the head's address and
    that process's output. The client is a run as a user starts it: no RAY_AUTH_MODE (OmniFlow picks it) and
    the cluster's token in its environment."""
    import subprocess
    import sys

    from ray_heads import RayNode, ray_cluster

    with ray_cluster(RayNode(num_cpus=16), auth_mode=mode) as cluster:
        cmd = [sys.executable, "-c", _JOIN, cluster.address]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cluster.client_env)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return cluster.address, out.stdout


def test_a_joined_cluster_without_token_auth_is_named_in_the_run_log():
    """Two real heads: one with RAY_AUTH_MODE=disabled gets the warning (its address and the fix), one with
    token auth none. The probe is a GCS request without a token, which only the unauthenticated cluster answers."""
    from omni_core.distributed.ray_auth import token_auth_warning

    address, disabled = _join_a_head("disabled")
    warning = disabled.rsplit("AUTH_WARNING=", 1)[1].strip()
    gcs = warning.split("joined cluster ", 1)[1].split(": anyone", 1)[0]  # Ray reports the node's routable IP
    assert gcs.endswith(":" + address.rsplit(":", 1)[1]), (address, warning)
    assert warning == repr(token_auth_warning(gcs)) and "RAY_AUTH_MODE=token" in warning, warning
    _, token = _join_a_head("token")
    assert "AUTH_WARNING=None" in token, token


# ------------------------------------------------------------------ a reward server's URL, as errors show it
URL_SECRET = "pa55-w0rd"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"http://scorer:{URL_SECRET}@scorer.internal:8765/score", "http://scorer.internal:8765/score"),
        (f"https://api.example/v1/score?token={URL_SECRET}&x=1", "https://api.example/v1/score"),
        (f"https://u:{URL_SECRET}@api.example/score?key={URL_SECRET}#{URL_SECRET}", "https://api.example/score"),
        (f"http://u:{URL_SECRET}@[::1]:8080/score", "http://[::1]:8080/score"),  # IPv6 keeps its brackets
        ("http://127.0.0.1:8765/score", "http://127.0.0.1:8765/score"),  # nothing to hide: unchanged
        # Malformed, as a config error shows them: no scheme; an unencoded "/" in the password; an encoded "@".
        (f"scorer:{URL_SECRET}@scorer.internal/score?token={URL_SECRET}", "scorer.internal/score"),
        (f"http://u:{URL_SECRET}/x@host/score", "http://host/score"),
        (f"http://u:{URL_SECRET}%40more@host/score", "http://host/score"),
    ],
)
def test_display_url_hides_credentials_query_and_fragment(url, shown):
    from omni_core.rewards.entries import display_url  # also omni_core.rewards.server_client.display_url

    assert display_url(url) == shown
    assert URL_SECRET not in display_url(url)


def test_a_malformed_server_url_in_the_config_is_refused_without_its_credentials():
    """A URL missing its scheme parses as scheme `user` with the password in the path (urlsplit): the error must
    still not show the password (it once showed `user://<password>@host/score`)."""
    from omni_core.config import load_config
    from omni_core.validation import config_problems

    url = f"scorer:{URL_SECRET}@scorer.internal/score?token={URL_SECRET}"
    cfg = load_config(overrides=[f"reward.reward_functions=[{{server_url: '{url}'}}]"])
    (problem,) = [p for p in config_problems(cfg) if p.key == "reward.reward_functions[0].server_url"]
    assert "must be an http:// or https:// URL" in problem.message
    assert URL_SECRET not in str(problem) and URL_SECRET not in problem.message and URL_SECRET not in str(problem.value)
    assert "scorer.internal/score" in str(problem)

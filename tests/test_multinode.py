"""A run on a two-node Ray cluster built as a user builds one (`tests/ray_heads.py`): `ray start --head` plus
a second raylet joined by `ray start --address=...`, each with 4 logical CPUs and a custom resource naming it.
The run is `trainer.nnodes=2 x n_gpus_per_node=1` ddp ranks with 2 rollout workers, and reserves all 8 CPUs:
TransferQueue's controller and 2 storage units (3, placed first, on both nodes), then the run's placement
group of 2 bundles (a rank and its colocated rollout worker: 2 CPUs each), then the fit_epoch task (1).
Neither node has the 4 free CPUs that would hold both bundles, so PACK places one bundle on each node,
as it spreads a real cluster's ranks when one node's GPUs cannot hold them all.

* `omniflow train ray_kwargs.ray_init.address=<head>` trains its first epoch; Ray's state API shows the two training
  ranks on different nodes (their gloo group spans the nodes), each rank's rollout worker on its rank's node,
  TransferQueue's storage units on both nodes (TQ places them round-robin), and one shared-storage probe
  task per node. The run is then stopped (SIGTERM): its actors go, the cluster it joined stays up.
* A checkpoint folder that resolves per node fails the run at start with the node that cannot see it: each
  raylet runs with its own HOME (as two hosts have two home disks) and `trainer.default_local_dir=~/...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ray_heads import RayNode, ray_cluster

pytestmark = pytest.mark.timeout(600)

NODE_CPUS = 4
NODE_RESOURCES = ("omniflow_test_node_a", "omniflow_test_node_b")

# Ray's state API, asked from a process that joins the cluster (the test process may hold another cluster).
_STATE = """
import json, sys
from ray.util.state import list_actors, list_nodes, list_tasks

address, task_name = sys.argv[1], sys.argv[2]
nodes = [{"id": n.node_id, "ip": n.node_ip, "state": n.state, "resources": n.resources_total} for n in list_nodes(address=address)]
actors = [{"name": a.name, "class": a.class_name, "node": a.node_id, "state": a.state} for a in list_actors(address=address, limit=10000)]
tasks = [{"node": t.node_id, "state": t.state} for t in list_tasks(address=address, filters=[("name", "=", task_name)], limit=10000)]
print("STATE=" + json.dumps({"nodes": nodes, "actors": actors, "tasks": tasks}))
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(cluster, {resource name: HOME of that node's raylet}); the head runs the dashboard (Ray's state API)."""
    homes = {name: tmp_path_factory.mktemp(f"home-{name[-1]}") for name in NODE_RESOURCES}
    nodes = [RayNode(num_cpus=NODE_CPUS, resources={name: 1}, env={"HOME": str(home)}) for name, home in homes.items()]
    with ray_cluster(nodes[0], nodes[1:], auth_mode="token", include_dashboard=True) as cluster:
        yield cluster, homes


def _cluster_state(cluster, task_name: str) -> dict:
    cmd = [sys.executable, "-c", _STATE, cluster.address, task_name]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cluster.tool_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.rsplit("STATE=", 1)[1])


def _node_by_resource(state: dict) -> dict[str, str]:
    """{custom resource of a node: its node id}, for the alive nodes."""
    return {r: n["id"] for n in state["nodes"] if n["state"] == "ALIVE" for r in n["resources"] if r in NODE_RESOURCES}


def test_a_run_joined_by_address_trains_with_its_actors_on_both_nodes_and_a_stop_leaves_the_cluster_up(
    two_nodes, flow_overrides, prefect_api, tmp_path
):
    """The run trains its first epoch across both nodes, then is stopped (SIGTERM, as a UI cancel or a scheduler's
    stop reaches the flow): it ends with exit 130 and the interruption line, its actors are gone from the cluster,
    and the cluster it joined (not its own) stays up with both nodes alive."""
    import signal

    from test_cli_runs import _latest, _wait_for

    from omni_core.checkpoint import find_latest, verify_checkpoint
    from omni_core.distributed.shared_storage import PROBE_PREFIX, PROBE_TASK_NAME

    cluster, _ = two_nodes
    ckpt = tmp_path / "ckpt"  # one folder both "nodes" of this machine see: shared storage
    overrides = [
        *flow_overrides,
        f"ray_kwargs.ray_init.address={cluster.address}",
        f"trainer.default_local_dir={ckpt}",
        "trainer.total_epochs=3",
        "trainer.experiment_name=multinode",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.strategy=ddp",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.hybrid_engine=false",  # rollout workers of their own, placed on their ranks' nodes
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",  # one per node (auto would size from this box)
    ]
    # The session's Prefect API, as a cluster run uses one server that every node reaches (docs/scale-out.md).
    env = {**cluster.client_env, "PYTHONUNBUFFERED": "1", "PREFECT_API_URL": prefect_api}
    log = tmp_path / "train.log"
    run = subprocess.Popen(
        [sys.executable, "-m", "omniflow.flows.cli", "train", *overrides], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env
    )
    try:
        _wait_for(lambda: _latest(ckpt) == "1", run, 480, log)  # the first epoch trained, on both nodes
        assert (ckpt / "global_step_1" / "actor" / "model.safetensors").is_file()
        assert not [p for p in ckpt.rglob("*") if p.name.startswith(PROBE_PREFIX)], "probe files left behind"
        state = _cluster_state(cluster, PROBE_TASK_NAME)
    except BaseException:
        run.kill()
        raise

    node_of = _node_by_resource(state)
    assert sorted(node_of) == sorted(NODE_RESOURCES), (state["nodes"], cluster.health())
    actors = {a["name"]: a["node"] for a in state["actors"] if a["name"] and a["state"] == "ALIVE"}
    units = {name: node for name, node in actors.items() if name.startswith("TransferQueueStorageUnit#")}
    assert len(units) == 2 and set(units.values()) == set(node_of.values()), actors
    run_actors = {name.split("-", 3)[3]: node for name, node in actors.items() if name.startswith("omniflow-multinode-")}
    ranks = [run_actors["training-actor"], run_actors["training-actor-rank1"]]
    workers = [run_actors["rollout-worker-0"], run_actors["rollout-worker-1"]]
    assert set(ranks) == set(node_of.values()), actors  # one rank per node
    assert workers == ranks, actors  # rollout worker j in rank j's bundle (colocated, as on a GPU)
    run_nodes = {*units.values(), *ranks, actors["TransferQueueController"]}
    assert run_nodes == set(node_of.values()), actors
    # The shared-storage check ran its rounds (write, look, remove) on each node.
    probes = [t["node"] for t in state["tasks"]]
    assert set(probes) == set(node_of.values()) and {t["state"] for t in state["tasks"]} == {"FINISHED"}, state

    # The stop, while the run trains its next epochs on the cluster it joined.
    run.send_signal(signal.SIGTERM)
    code = run.wait(timeout=120)
    text = log.read_text()
    assert code == 130, text[-4000:] + "\n" + cluster.health()
    assert "omniflow: interrupted; the last checkpoint is intact and the run's processes are stopped" in text, text[-3000:]
    assert "Check failed" not in text and "Traceback" not in text, text[-4000:]
    verify_checkpoint(find_latest(ckpt))
    after = _cluster_state(cluster, PROBE_TASK_NAME)
    alive = [a["name"] for a in after["actors"] if a["state"] == "ALIVE" and (a["name"] or "").startswith("omniflow-")]
    assert alive == [], alive  # the run's ranks, rollout workers and control actor are gone
    assert [n["state"] for n in after["nodes"]] == ["ALIVE", "ALIVE"], cluster.health()  # the cluster is not the run's to stop


_JOIN = """
import json, sys
import ray.util.state
from omni_core.config import ConfigError, load_config
from omni_core.distributed.ray_cluster import start_run_cluster

address, model = sys.argv[1], sys.argv[2]
overrides = [f"ray_kwargs.ray_init.address={address}", "trainer.default_local_dir=~/omniflow-ckpt", f"actor_rollout_ref.model.path={model}"]
try:
    start_run_cluster(load_config(overrides=overrides))
    problems = None
except ConfigError as exc:
    problems = [{"key": p.key, "message": p.message} for p in exc.problems]
names = {a["name"] for a in ray.util.state.list_actors(address=address, filters=[("state", "=", "ALIVE")])}
print("RESULT=" + json.dumps({"problems": problems, "alive_actors": sorted(n for n in names if n)}))
"""


def test_a_checkpoint_folder_one_node_does_not_see_fails_the_run_naming_that_node(two_nodes, tiny_sd3_dir, tmp_path):
    """Node a's raylet and the driver share a HOME (the driver runs on the head host), node b has its own:
    `~/omniflow-ckpt` and `~/tiny-sd3` are node-local folders, as on two hosts without a shared home."""
    cluster, homes = two_nodes
    home_a, home_b = (homes[r] for r in NODE_RESOURCES)
    (home_a / "tiny-sd3").symlink_to(tiny_sd3_dir)  # the model only node a has
    env = {**cluster.client_env, "HOME": str(home_a)}
    out = subprocess.run(
        [sys.executable, "-c", _JOIN, cluster.address, "~/tiny-sd3"], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.rsplit("RESULT=", 1)[1])
    nodes = _cluster_state(cluster, "-")
    node_of = _node_by_resource(nodes)
    ip = next(n["ip"] for n in nodes["nodes"] if n["id"] == node_of[NODE_RESOURCES[1]])

    problems = result["problems"]
    assert problems is not None, f"the run started although node b does not see its folders\n{cluster.health()}"
    by_key = {p["key"]: p["message"] for p in problems}
    assert sorted(by_key) == ["actor_rollout_ref.model.path", "trainer.default_local_dir"], problems
    folder_msg, model_msg = by_key["trainer.default_local_dir"], by_key["actor_rollout_ref.model.path"]
    b = f"node {node_of[NODE_RESOURCES[1]]} ({ip})"
    assert folder_msg.startswith(f"{b} cannot see the checkpoint folder {home_a / 'omniflow-ckpt'}"), folder_msg
    assert f"resolves the folder to {home_b / 'omniflow-ckpt'}" in folder_msg and "ReadWriteMany" in folder_msg, folder_msg
    assert model_msg.startswith(f"{b} cannot read {home_b / 'tiny-sd3' / 'model_index.json'} (FileNotFoundError"), model_msg
    assert node_of[NODE_RESOURCES[0]] not in folder_msg + model_msg, problems  # node a sees both
    # The check runs before the TransferQueue starts, and leaves no probe file (nor the folder it made on b).
    assert not any(n.startswith("TransferQueue") for n in result["alive_actors"]), result
    assert not (home_a / "omniflow-ckpt").exists() and not (home_b / "omniflow-ckpt").exists()


def test_a_probe_is_read_back_by_name_and_removing_it_removes_only_the_folders_it_made(tmp_path):
    """The three rounds of the check in one process (each node runs the same functions)."""
    from omni_core.config import load_config
    from omni_core.distributed.shared_storage import PROBE_PREFIX, look, remove_probe, write_probe

    folder = tmp_path / "a" / "b"
    trainer = load_config(overrides=[f"trainer.default_local_dir={folder}"]).trainer
    first, second = write_probe(trainer, "tok"), write_probe(trainer, "tok")
    assert (first.folder, first.created, second.created) == (str(folder), str(tmp_path / "a"), None)
    assert first.probe.startswith(PROBE_PREFIX + "tok-") and first.probe != second.probe and first.error is None
    (folder / "forged").write_text("not a probe's content")
    model = ("actor_rollout_ref.model.path", str(tmp_path / "model" / "model_index.json"))
    seen = look(trainer, [first.probe, second.probe, "never-written", "forged"], [model])
    assert seen.probes == {first.probe, second.probe}
    assert seen.unreadable == ((*model, "FileNotFoundError: No such file or directory"),)
    remove_probe(second)
    remove_probe(first)
    assert os.listdir(folder) == ["forged"]  # a folder that holds other files stays
    (folder / "forged").unlink()
    remove_probe(write_probe(trainer, "tok"))  # the folder existed: it stays, empty
    assert os.listdir(folder) == []
    fresh = load_config(overrides=[f"trainer.default_local_dir={tmp_path / 'c' / 'd'}"]).trainer
    remove_probe(write_probe(fresh, "tok"))
    assert not (tmp_path / "c").exists()  # the folders the probe made went with it

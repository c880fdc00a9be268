"""Placement on Ray: the layout rules as pure functions, and a real two-node Ray cluster on this machine.

The cluster is two `ray start` nodes on 127.0.0.1 with one CPU each, so the run's rollout engine and its
trainer rank cannot share a node. Where each actor ran is read back from Ray's own actor table (the
GCS), not from Molt's report. Both nodes are stopped afterwards, whatever happens: each `ray start
--block` process takes its node's processes down with it.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt_train.config import Config, ConfigError
from molt_train.placement import Slot, bundles, check_fits, node_order, turn_threads

RAY = str(Path(sys.executable).with_name("ray"))
ENV = os.environ | {"RAY_AUTH_MODE": "disabled"}  # two local nodes; token auth is for real clusters


def test_trainer_ranks_of_one_node_are_consecutive():
    assert node_order(["b", "a", "b", "a", "c"]) == [0, 2, 1, 3, 4]
    assert node_order(["a", "a"]) == [0, 1]


def test_bundles_follow_the_flags_and_a_run_larger_than_the_cluster_is_refused():
    config = Config()
    config.engine.data_parallel_size, config.engine.tensor_parallel_size, config.actor.world_size = 2, 4, 8
    engines, trainer, reward = bundles(config, gpus=True)
    assert engines == [{"GPU": 4, "CPU": 1}] * 2 and trainer == [{"GPU": 1, "CPU": 1}] * 8 and reward == []
    check_fits(config, engines + trainer, {"GPU": 16, "CPU": 64})
    with pytest.raises(ConfigError, match=r"--engine.data_parallel_size 2 x --engine.tensor_parallel_size 4 \+ "
                                          r"--actor.world_size 8: the run places 16 GPUs and the Ray cluster has 8"):
        check_fits(config, engines + trainer, {"GPU": 8, "CPU": 64})
    engines, trainer, _ = bundles(config, gpus=False)
    assert engines == [{"CPU": 4}] * 2 and trainer == [{"CPU": 1}] * 8
    config.reward.model = "tiny:reward"  # a device of its own
    engines, trainer, reward = bundles(config, gpus=True)
    assert reward == [{"GPU": 1, "CPU": 1}]
    with pytest.raises(ConfigError, match=r"--actor.world_size 8 \+ --reward.model: the run places 17 GPUs"):
        check_fits(config, engines + trainer + reward, {"GPU": 16, "CPU": 64})


def test_engines_and_trainer_take_every_cpu_for_their_turns_only_when_synchronous_on_a_local_cpu_ray():
    config = Config()
    config.train.async_queue_size = 0
    config.engine.data_parallel_size, config.actor.world_size = 2, 3
    assert turn_threads(config, 12, gpus=False) == (6, 4)
    config.engine.tensor_parallel_size = 4  # 8 engine processes share the 12 CPUs while they generate
    assert turn_threads(config, 12, gpus=False) == (1, 4)
    assert turn_threads(config, 12, gpus=True) == (None, None)
    config.ray.address = "auto"  # a joined cluster's other CPUs are not the run's
    assert turn_threads(config, 12, gpus=False) == (None, None)
    config.ray.address, config.train.async_queue_size = None, 16  # asynchronous: both compute at once
    assert turn_threads(config, 12, gpus=False) == (None, None)


def test_a_slots_threads_reach_its_process(ray_address):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from ray.util.placement_group import placement_group, remove_placement_group

    @ray.remote
    def threads():
        import torch

        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()

    group = placement_group([{"CPU": 1}])
    ray.get(group.ready())
    try:
        strategy = PlacementGroupSchedulingStrategy(group, 0)
        assert ray.get(threads.options(**Slot(strategy, 1, 0, threads=2).options()).remote()) == ("2", 2)
        assert ray.get(threads.options(**Slot(strategy, 1, 0).options()).remote()) == ("1", 1)  # Ray's: its CPUs
    finally:
        remove_placement_group(group)


def test_colocate_is_refused_on_a_cluster_without_gpus(ray_address):
    import asyncio

    from molt_train.placement import Placement

    config = Config()
    config.actor.colocate = True
    with pytest.raises(ConfigError, match="--actor.colocate: trainer and engines share GPUs, and this Ray "
                                          "cluster has none"):
        asyncio.run(Placement.reserve(config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(address: str, code: str):
    """Run `code` (which prints JSON) in a fresh Python connected to the cluster at `address`."""
    script = f"import json, ray\nray.init(address={address!r}, log_to_driver=False)\n{code}"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def two_nodes(tmp_path):
    """The address of a two-node Ray cluster (one CPU per node), stopped at teardown."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    nodes = []
    try:
        for name, args in (("head", ["--head", "--port", str(port), "--include-dashboard", "false"]),
                           ("worker", ["--address", address])):
            log = open(tmp_path / f"ray-{name}.log", "w")
            nodes.append(subprocess.Popen([RAY, "start", *args, *common], env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            deadline = time.monotonic() + 120
            while _query(address, "print(len([n for n in ray.nodes() if n['Alive']]))") < len(nodes):
                assert time.monotonic() < deadline, f"the {name} node did not join: {tmp_path}/ray-{name}.log"
                time.sleep(1)
        yield address
    finally:
        for node in nodes:  # `ray start --block` stops its node's processes on SIGTERM
            os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)


def test_the_rendezvous_on_another_node_is_found_while_rank_0_holds_its_slot(two_nodes):
    """A slot on the node that is not the driver's, its CPU held by a running actor (as rank 0 holds its
    slot when the weight-sync channel opens): the rendezvous task still runs there and answers."""
    found = _query(two_nodes, """
import asyncio
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from molt_train.placement import Slot
from molt_train.trainer import rendezvous

group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
ray.get(group.ready())
on_nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
here = ray.get_runtime_context().get_node_id()
bundle = next(index for index, node in on_nodes.items() if node != here)
slot = Slot(PlacementGroupSchedulingStrategy(group, bundle), 1, 0)

@ray.remote
class Rank:
    def node(self):
        return ray.get_runtime_context().get_node_id()

rank = Rank.options(**slot.options()).remote()
rank_node = ray.get(rank.node.remote())

class OneRank:
    def nodes(self):
        return {"engines": [], "trainer": [on_nodes[bundle]]}
    def trainer_rank(self, index):
        return slot

host, port = asyncio.run(asyncio.wait_for(rendezvous(OneRank()), 60))
print(json.dumps({"here": here, "rank": rank_node, "slot": on_nodes[bundle], "port": port}))""")
    assert found["rank"] == found["slot"] != found["here"] and found["port"] > 0


def test_engine_and_trainer_on_two_nodes_sync_weights_and_learn(two_nodes, tmp_path):
    """The default task, joined to the cluster with --ray.address: the engine on one node, the trainer
    on the other, the weights broadcast between them after every step, and the reward rises."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "molt_train.cli", "--ray.address", two_nodes, "--out", str(out),
                             "--steps", "50", "--log.tensorboard", "false"],
                            capture_output=True, text=True, env=ENV, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    actors = _query(two_nodes, """
actors = ray._private.state.actors().values()
print(json.dumps({a["ActorClassName"]: a["Address"]["NodeID"] for a in actors
                  if a["ActorClassName"] in ("RolloutWorker", "PolicyRank")}))""")
    assert set(actors) == {"RolloutWorker", "PolicyRank"}
    assert actors["RolloutWorker"] != actors["PolicyRank"], "the engine and the trainer shared a node"
    assert "placement: engines on node 0, trainer ranks on node 1 (2 node(s))" in result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and rows[-1]["version"] == 50  # every step's weights reached the engine
    first, last = (sum(r["reward/mean"] for r in part) / len(part) for part in (rows[:10], rows[-10:]))
    print(f"two nodes: mean reward of steps 1-10 {first:.3f}, of steps 41-50 {last:.3f}; "
          f"mismatch/kl at the end {rows[-1]['mismatch/kl']}")
    assert last > first + 0.1
    shutil.rmtree(out / "checkpoints", ignore_errors=True)

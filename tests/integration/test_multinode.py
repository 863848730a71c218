"""Multi-node on torch's own launcher, as 2 "nodes" of 2 processes on this machine: two
``torch.distributed.run`` agents with ``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT``, and the same through the recipes (two ``recipes/train.py`` processes, each
one node, ``trainer.num_nodes=2``).

What one machine cannot show: a real network between the nodes (everything here is loopback),
NCCL (gloo on CPU only), and the rendezvous host being one particular machine (on 127.0.0.1
both agents may serve the store; the first to bind does).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.models import STAGE3, loss_of, make_model, make_optimizer
from tests.support.nodes import ROOT, free_port, python, run_nodes
from tests.worlds.multinode_engine import CLIP, global_batches

TRAIN = str(ROOT / "recipes" / "train.py")


def torchrun(port: int, run_id: str, *script: str) -> list[str]:
    return python("-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", run_id, *script)


# ------------------------------------------------------------------------------ the engine
def reference_training() -> tuple[list[float], list[float], dict[str, torch.Tensor],
                                  dict[str, torch.Tensor]]:
    """One process on the whole global batch: (losses, gradient norms, final and initial
    weights)."""
    model = make_model("mlp")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer("sgd", model)
    losses, norms = [], []
    for data in global_batches(4):
        loss = loss_of("mlp", model, data)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, model.state_dict(), initial


# fp32, and the only difference from the reference is the order of the sums: a gradient
# element is the mean of 16 per-sample terms, summed 4 by 4 on each rank and then over the 4
# ranks instead of 16 in one matmul. Each order is within a few ulps (eps = 1.2e-7) of the
# exact sum relative to the terms' magnitude, and SGD passes a relative gradient difference
# on to the update unchanged (momentum and the clipping factor are linear in it); six steps
# through this small network compound it to the measured 1.4e-7 of a tensor's largest
# weight, 1.3e-7 for the norms. 1e-5 leaves 70x for another machine's summation kernels
# while a single wrongly reduced step (a rank's quarter of the batch missing: ~25 % of a
# gradient) is caught 10^4 times over.
TOL = 1e-5


def check_against_reference(out: Path, ranks: list[dict], suffix: str = "") -> None:
    """Losses, gradient norms (the global one, on every rank) and final weights against one
    process on the global batch, at TOL."""
    losses, norms, weights, initial = reference_training()
    assert min(norms) > CLIP, "clipping never engaged: the norm's parity would not cover it"
    for step, loss in enumerate(losses):
        got = sum(r["losses"][step] for r in ranks) / 4  # each rank's mean over its quarter
        assert got == pytest.approx(loss, rel=TOL), f"step {step}"
        for r in ranks:
            assert r["norms"][step] == pytest.approx(norms[step], rel=TOL), (step, r["rank"])
    final = torch.load(out / f"weights{suffix}.pt")
    assert sorted(final) == sorted(weights)
    for key, ref in weights.items():
        assert (final[key] - ref).abs().max() <= TOL * ref.abs().max(), key
    assert max(((weights[k] - initial[k]).abs().max() / weights[k].abs().max()).item()
               for k in weights) > 1e-2, "training did not move the weights: parity is vacuous"


def test_engine_trains_across_two_nodes_as_one_process_on_the_global_batch(
        tmp_path: Path) -> None:
    """Stage 3 over 4 ranks on 2 nodes (torchrun agents, c10d rendezvous) against one process
    training on the concatenation of the 4 ranks' batches: losses, clipped gradient norms
    (clipping engaged) and final weights; ranks 0-1 on one node, 2-3 on the other. Then the
    same with hybrid sharding, one group per node."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    nodes = run_nodes([torchrun(port, "engine", "tests/worlds/multinode_engine.py", str(out))] * 2,
                      tmp_path / "logs", timeout=240)
    assert nodes.ok, nodes.tail()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["group_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["world_size"] for r in ranks} == {4}
    check_against_reference(out, ranks)
    check_bytes_sent(ranks)
    # Hybrid sharding, each node a group of 2: the same training, and between the nodes only
    # the all-reduce of each rank's gradient shard, 2 (R-1)/R of it with R = 2 groups (ring
    # volume), i.e. 4 bytes per element of this rank's shards.
    hybrid = [json.loads((out / f"rank{r}-hybrid.json").read_text()) for r in range(4)]
    check_against_reference(out, hybrid, "-hybrid")
    for r in hybrid:
        for sent in r["sent"]:
            assert sent["across_groups"] == 4 * r["shard_numel"], sent
            assert 0 < sent["within_groups"] < first_total(ranks), sent


def first_total(ranks: list[dict]) -> int:
    return ranks[0]["sent"][0]["total"]


def check_bytes_sent(ranks: list[dict]) -> None:
    """``engine.comm_bytes()`` across nodes: every rank sends the same bytes per collective in
    every step (ZeRO's traffic is symmetric; which node a rank is on changes nothing), and a
    step's total lies within what stage 3 must send for this model.

    Per step and rank, with N = 4 and Psi = 4163 fp32 parameters, 203 of them below the
    persistence threshold (40 elements: biases and the norm), kept whole and all-reduced:
    parameters gathered in forward and again in backward, gradients reduce-scattered, each
    (N-1)/N of the buffer -> 3 (N-1)/N 4 (Psi - 203); the kept ones' all-reduce 2 (N-1)/N 4
    203. That is the lower bound (36,858 bytes). Above it only padding: every parameter and
    every shard starts on a 16-element boundary (< 16 (N + 1) elements per parameter, 12
    parameters), so at most 3 (N-1)/N 4 (Psi + 16 (N + 1) 12) (46,107), which also covers
    the global norm's one-scalar all-reduce. That is the first step; from the second the
    forward's last units stay whole for backward, one gather (and its 16-byte order
    header per peer) less each, every step alike."""
    sizes = [p.numel() for p in make_model("mlp").parameters()]
    threshold = STAGE3["mlp"]["param_persistence_threshold"]
    n, psi, params = 4, sum(sizes), len(sizes)
    kept = sum(size for size in sizes if size < threshold)
    assert (psi, kept, params) == (4163, 203, 12)  # the figures argued above
    low = (n - 1) / n * 4 * (3 * (psi - kept) + 2 * kept)
    high = 3 * (n - 1) / n * 4 * (psi + 16 * (n + 1) * params)
    assert ranks[0]["num_params"] == psi
    first, steady = ranks[0]["sent"][0], ranks[0]["sent"][1]
    for r in ranks:
        for step, sent in enumerate(r["sent"]):
            assert sent == (first if step == 0 else steady), (r["rank"], step, sent, first)
    assert low <= first["total"] <= high, first
    assert first["all_gather"] > 0 and first["reduce_scatter"] > 0, first
    kept = ranks[0]["kept"]
    assert kept["units"] > 0, kept
    assert first["all_gather"] - steady["all_gather"] == (
        (n - 1) / n * 4 * kept["numel"] + kept["units"] * 16 * (n - 1)), (first, steady, kept)


def test_lightning_trainer_with_num_nodes_2_on_its_own_launcher(tmp_path: Path) -> None:
    """``Trainer(strategy=ZeroStrategy(stage=3), devices=2, num_nodes=2)`` started on each of
    2 nodes by Lightning's own launcher (``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK``; it
    starts the node's second process): Lightning's ranks, and training as one process on the
    global batch. (Under torchrun, Lightning's other way, every multi-node recipe job runs:
    the recipes' tests below, one node's workers started as ``python -m
    torch.distributed.run ... worker.py``.)"""
    out = tmp_path / "out"
    out.mkdir()
    nodes = run_nodes([python("tests/worlds/multinode_lightning.py", str(out))] * 2,
                      tmp_path / "logs",
                      env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
                      envs=[{"NODE_RANK": "0"}, {"NODE_RANK": "1"}])
    assert nodes.ok, nodes.tail()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["node_rank"], r["local_rank"], r["world_size"]) for r in ranks] == [
        (0, 0, 4), (0, 1, 4), (1, 0, 4), (1, 1, 4)]
    check_against_reference(out, ranks)
    # ZeroStrategy creates the group with ZeroConfig.timeout (600 s), not gloo's 30 minutes.
    assert all(r["group_timeout"] == r["engine_timeout"] == 600.0 for r in ranks), ranks


# ------------------------------------------------------------------------------ the recipes
FAST = ("trainer=fast", "model.size=tiny", "trainer.max_steps=6")


def recipe(port: int, *overrides: str, multirun: bool = False) -> list[str]:
    """One node's Hydra process of a 2-node job."""
    return python(TRAIN, *(["-m"] if multirun else []), *FAST, "trainer.num_nodes=2",
                  f"trainer.rdzv_endpoint=127.0.0.1:{port}", *overrides)


def metrics_of(directory: Path) -> dict:
    return json.loads((directory / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: the same zero3 job as one node of 4 processes, uninterrupted."""
    job = tmp_path_factory.mktemp("one-node") / "job"
    nodes = run_nodes([python(TRAIN, *FAST, "trainer.devices=4", f"hydra.run.dir={job}")],
                      job.parent / "logs")
    assert nodes.ok, nodes.tail()
    return metrics_of(job)


# Rank 3 SIGKILLs itself after step 5 in the first attempt (as a lost node would), in every
# job of the sweep; set on both nodes since the rendezvous decides which node gets ranks 2-3.
KILL_RANK_3 = {"ZS_FAULT_KILL_STEP": "5", "ZS_FAULT_KILL_RANK": "3"}


def test_recipe_sweep_on_two_nodes_restarts_and_matches_one_node(one_node: dict,
                                                                 tmp_path: Path) -> None:
    """Two Hydra processes run ``-m strategy=zero3,ddp`` as 2 nodes of 2 in one shared sweep
    directory (node 1's workers as new interpreters, ``trainer.preload=false``, a node-local
    key). Job by job they meet (one rendezvous id per job, ports P and P+1), rank 3 is killed
    after step 5, all 4 workers restart across both nodes and resume from the step-4
    checkpoint: the zero3 job ends with the 1-node uninterrupted run's weights bit for bit
    (same 4 ranks, same data, same gloo collectives: nothing depends on which node a rank is
    on), DDP with the same losses; metrics.json says N = 4 on 2 nodes, the report is written
    once, by the Hydra process that started rank 0 of the first job."""
    sweep, port = tmp_path / "sweep", free_port(span=2)
    common = ("strategy=zero3,ddp", "trainer.checkpoint_every=2", f"hydra.sweep.dir={sweep}")
    nodes = run_nodes([recipe(port, *common, multirun=True),
                       recipe(port, *common, "trainer.preload=false", multirun=True)],
                      tmp_path / "logs", env=KILL_RANK_3, timeout=400)
    assert nodes.ok, nodes.tail()
    log = "\n".join(nodes.logs)
    for job, used in ((0, port), (1, port + 1)):
        assert log.count(f"--rdzv-endpoint 127.0.0.1:{used} --rdzv-id gpt-tiny-") == 2, job
    dirs = sorted(p for p in sweep.iterdir() if p.is_dir())
    for job in dirs:  # rank 0 says so, on whichever node it is
        checkpoint = job / "checkpoints" / "last.ckpt"
        assert f"Restoring states from the checkpoint path at {checkpoint}" in log, job.name
    jobs = {m["strategy"]: m for m in map(metrics_of, dirs)}
    assert sorted(jobs) == ["ddp", "zero3"]
    for m in jobs.values():
        assert (m["world_size"], m["nodes"], m["requested"]["world_size"]) == (4, 2, 4)
        assert [r["rank"] for r in m["ranks"]] == [0, 1, 2, 3] and m["steps"] == 6
    assert jobs["zero3"]["weights_sha256"] == one_node["weights_sha256"]
    assert jobs["zero3"]["train_loss"] == one_node["train_loss"]
    assert jobs["zero3"]["val_loss"] == one_node["val_loss"]
    # DDP: same data and initial weights, fp32 sums in another order (test_recipes' bound)
    assert jobs["ddp"]["val_loss"] == pytest.approx(one_node["val_loss"], rel=1e-4)
    writers = [i for i, text in enumerate(nodes.logs) if "sweep report: " + str(sweep) in text]
    assert len(writers) == 1 and (sweep / "report.md").exists()
    # The other names the writer: the Hydra process that started rank 0 of job 0 (zero3).
    other = nodes.logs[1 - writers[0]]
    assert "sweep report: left to the node that ran rank 0 of job 0-" in other
    assert f"(its Hydra process {jobs['zero3']['launcher']})" in other


def test_recipe_job_with_one_shard_group_per_node(one_node: dict, tmp_path: Path) -> None:
    """``strategy.zero.shard_group_size=2`` through the recipe launcher on 2 nodes of 2: the
    engine's options read back from the run and the losses of the plain 4-rank job (fp32 sums
    in another order, as for DDP above). What crosses between the nodes is asserted on the
    engine's own counters in the first test of this file."""
    job, port = tmp_path / "job", free_port(span=2)
    common = ("strategy.zero.shard_group_size=2", f"hydra.run.dir={job}")
    nodes = run_nodes([recipe(port, *common), recipe(port, *common)], tmp_path / "logs",
                      timeout=300)
    assert nodes.ok, nodes.tail()
    m = metrics_of(job)
    assert (m["world_size"], m["nodes"], m["zero_options"]) == (4, 2, "shard_group_size=2")
    assert m["val_loss"] == pytest.approx(one_node["val_loss"], rel=1e-4)
    assert m["train_loss"] == pytest.approx(one_node["train_loss"], rel=1e-4)


def test_nodes_with_their_own_job_directories_each_get_the_metrics(one_node: dict,
                                                                   tmp_path: Path) -> None:
    """Each node writes into a directory of its own (no shared filesystem), checkpoints off:
    rank 0 writes its node's metrics.json and the other node's local rank 0 the same record
    into its own, so both Hydra processes read the job's result (here bit-identical to the
    1-node run's)."""
    port, dirs = free_port(span=2), [tmp_path / "node0", tmp_path / "node1"]
    nodes = run_nodes([recipe(port, "trainer.checkpoint_every=0", f"hydra.run.dir={d}")
                       for d in dirs], tmp_path / "logs", timeout=300)
    assert nodes.ok, nodes.tail()
    records = [metrics_of(d) for d in dirs]
    assert records[0] == records[1], "the same record (rank 0's) on both nodes"
    assert records[0]["world_size"] == 4 and records[0]["nodes"] == 2
    assert records[0]["weights_sha256"] == one_node["weights_sha256"]
    for log in nodes.logs:  # each Hydra process read it and printed the job's summary
        assert "[gpt-tiny-zero3] zero3 x4: loss" in log


def test_checkpoints_need_every_node_to_see_rank_0s_job_directory(tmp_path: Path) -> None:
    """Checkpoints are one directory every rank writes into: nodes that do not see rank 0's
    job directory are refused on every rank, before training, naming the keys."""
    port = free_port(span=2)
    nodes = run_nodes([recipe(port, "trainer.checkpoint_every=2", "trainer.max_restarts=0",
                              f"hydra.run.dir={tmp_path / d}") for d in ("node0", "node1")],
                      tmp_path / "logs", timeout=300)
    assert nodes.returncodes == [1, 1], nodes.tail()
    for log in nodes.logs:  # ranks 0-1 are the node whose directory rank 0's is
        assert ("trainer.checkpoint_every=2 with trainer.num_nodes=2: every rank writes its "
                "shards into one checkpoint directory") in log, log[-3000:]
        assert "but ranks [2, 3] do not see it" in log, log[-3000:]
    for d in ("node0", "node1"):  # refused before the first step: nothing written
        assert sorted(p.name for p in (tmp_path / d).iterdir()) == [".hydra", "job.yaml",
                                                                    "train.log"]


# ------------------------------------------------------------------------------ recipe keys
def _compose(overrides: list[str], hydra: bool = False):  # noqa: ANN202
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from recipes import schema

    schema.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


@pytest.mark.parametrize(("overrides", "named"), [
    (["trainer.num_nodes=0"], "trainer.num_nodes=0: must be 1 or more"),
    (["trainer.num_nodes=2"], "trainer.num_nodes=2 needs trainer.rdzv_endpoint=HOST:PORT"),
    (["trainer.rdzv_endpoint=node0:29400"],
     "trainer.rdzv_endpoint='node0:29400' with trainer.num_nodes=1: a one-node job"),
    (["trainer.num_nodes=2", "trainer.rdzv_endpoint=node0"], "'node0' is not HOST:PORT"),
    (["trainer.num_nodes=2", "trainer.rdzv_endpoint=:29400"], "':29400' is not HOST:PORT"),
    (["trainer.num_nodes=2", "trainer.rdzv_endpoint=node0:65535"],
     "'node0:65535' is not HOST:PORT with PORT in 1..65534"),
])
def test_bad_multi_node_keys_are_refused_naming_them(overrides: list[str], named: str) -> None:
    from recipes import launch

    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        launch.check_job(_compose(["trainer=fast", *overrides]))


def test_a_node_without_an_endpoint_starts_no_worker(tmp_path: Path) -> None:
    nodes = run_nodes([python(TRAIN, *FAST, "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}")],
                      tmp_path / "logs", timeout=120)
    assert nodes.returncodes == [1]
    assert "trainer.num_nodes=2 needs trainer.rdzv_endpoint" in nodes.logs[0]
    assert "torch.distributed.run --" not in nodes.logs[0], "a worker was started"


def test_each_job_of_a_sweep_meets_under_its_own_id_on_alternating_ports() -> None:
    """What the agent is started with: one node on its own; several with the c10d rendezvous
    at the endpoint, job k under an id derived from the job and on PORT + k % 2."""
    from recipes import agent, rendezvous

    one = _compose(["trainer=fast"]).trainer
    assert rendezvous.job_rendezvous(one, "gpt-tiny-zero3", 3) is None
    assert agent.torchrun_args(2, 3, Path("job.yaml"))[0] == "--standalone"
    two = _compose(["trainer=fast", "trainer.num_nodes=2",
                    "trainer.rdzv_endpoint=node0:29400"]).trainer
    got = [rendezvous.job_rendezvous(two, "gpt-tiny-zero3", n) for n in (None, 0, 1, 2)]
    assert [(r.endpoint, r.run_id) for r in got] == [
        ("node0:29400", "gpt-tiny-zero3-run"), ("node0:29400", "gpt-tiny-zero3-job0"),
        ("node0:29401", "gpt-tiny-zero3-job1"), ("node0:29400", "gpt-tiny-zero3-job2")]
    argv = agent.torchrun_args(2, 3, Path("job.yaml"), got[2])
    assert argv[:8] == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        "node0:29401", "--rdzv-id", "gpt-tiny-zero3-job1"]
    assert "--standalone" not in argv and argv[8:10] == ["--nproc_per_node", "2"]


def test_node_local_keys_are_neither_compared_nor_in_job_directory_names() -> None:
    """A node may set trainer.preload (and the other node-local keys) differently: the
    ranks do not compare them, and the job's directory name, which must be the same on
    every node sharing the sweep directory, leaves them (and the endpoint) out."""
    from recipes.nodes import NODE_LOCAL, disagreements, flat_config

    overrides = ["trainer.num_nodes=2", "trainer.rdzv_endpoint=node0:29400"]
    naming = _compose(overrides, hydra=True).hydra.job.config.override_dirname
    # and where the Ray launcher finds or starts its cluster: the same job wherever it runs
    ray_placement = {f"launcher.{k}" for k in ("address", "temp_dir", "num_cpus",
                                               "object_store_mb", "storage_path")}
    assert set(naming.exclude_keys) == {*NODE_LOCAL, "trainer.rdzv_endpoint", *ray_placement}
    mine = flat_config(_compose(overrides))
    assert not set(NODE_LOCAL) & set(mine) and mine["trainer.num_nodes"] == 2
    other = {**mine, "optim.lr": 0.5, "model.size": "base"}
    assert disagreements([mine, mine, other, other]) == [
        "model.size: rank 0 has 'small', ranks [2, 3] have 'base'",
        f"optim.lr: rank 0 has {mine['optim.lr']!r}, ranks [2, 3] have 0.5"]
    assert disagreements([mine] * 4) == []


# ------------------------------------------------------------------------------ Accelerate
ACCELERATE_CONF = ROOT / "conf" / "accelerate"
ACCELERATE_RUN = ["--model", "mlp", "--steps", "6", "--accum", "2", "--zero-opt",
                  "unit_numel=1000", "--zero-opt", "param_persistence_threshold=0"]


def accelerate_launch(config: str, out: Path, *launch_args: str) -> list[str]:
    return python("-m", "accelerate.commands.launch", "--config_file",
                  str(ACCELERATE_CONF / config), *launch_args,
                  str(ROOT / "recipes" / "accelerate_train.py"), *ACCELERATE_RUN, "--out", str(out))


def test_accelerate_launch_on_two_machines_equals_one_machine_of_four(tmp_path: Path) -> None:
    """conf/accelerate/multi_machine.yaml (2 machines, 4 processes in all, c10d rendezvous
    on main_process_ip:main_process_port) launched twice, ``--machine_rank 0`` and ``1``:
    ZeroAccelerator at stage 3 trains the same as one machine's 4 processes, bit for bit
    (the same 4 ranks on the same data with the same gloo collectives; only the launch
    differs): every micro-batch's loss, every step's norm and learning rate, the final
    weights and the evaluation after training."""
    port, env = free_port(), {"ZERO_STRATEGY_CONFIG": str(ACCELERATE_CONF / "zero3.yaml")}
    two = run_nodes([accelerate_launch("multi_machine.yaml", tmp_path / "two",
                                       "--main_process_port", str(port), "--machine_rank", str(k))
                     for k in (0, 1)], tmp_path / "logs-two", env=env, first_serves=port)
    assert two.ok, two.tail()
    one = run_nodes([accelerate_launch("multi_process.yaml", tmp_path / "one",
                                       "--num_processes", "4")], tmp_path / "logs-one", env=env)
    assert one.ok, one.tail()
    ranks = {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text())
                    for r in range(4)] for name in ("two", "one")}
    for a, b in zip(ranks["two"], ranks["one"]):
        assert (a["num_processes"], a["zero_config"]["stage"]) == (4, 3)
        for key in ("losses", "norms", "lrs", "reduced", "eval_loss"):
            assert a[key] == b[key], (a["rank"], key)
    assert ranks["two"][0]["weights"] == ranks["one"][0]["weights"]
    assert ranks["one"][0]["moved"] > 1e-2, "training did not move the weights"

"""The recipes and the Lightning integration on a real SLURM (tests/support/slurm.py starts a
one-host cluster; skipped with the reason where SLURM is not installed or cannot run):

- a Hydra sweep with ``hydra/launcher=submitit_slurm`` runs each job as a SLURM job, which
  unpickles the task function in a fresh interpreter (the recipes are a package), and writes
  one report with the rows, columns and losses of the same sweep run locally;
- ``Trainer(strategy="zero3")`` under ``srun --ntasks-per-node=2`` finds Lightning's
  SLURMEnvironment and matches ``strategy="ddp"`` under the same ``srun``.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import slurm
from tests.support.nodes import ROOT, environment

TRAIN = str(ROOT / "recipes" / "train.py")
# Both jobs of a sweep side by side on 2 cores: tiny model, few steps.
BASE = ["-m", "model.size=tiny", "trainer.limit_val_batches=2"]
SWEEP = ["strategy=ddp,zero3", "trainer.max_steps=6", "trainer.val_check_interval=3"]
SUBMITIT = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug",
            "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=1",
            "hydra.launcher.cpus_per_task=2", "hydra.launcher.timeout_min=20"]


@pytest.fixture(autouse=True)
def _empty_queue(request: pytest.FixtureRequest):
    """Each test starts on an empty queue: a job a previous test left behind (a sweep job
    still completing, a requeued task) would hold the host's two CPUs, and the next test's
    srun would wait for them until its timeout (seen once in CI: 600 s)."""
    if "cluster" in request.fixturenames:
        slurm.cancel_all(request.getfixturevalue("cluster"))
    yield


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    reason = slurm.why_not()
    if reason is not None:
        pytest.skip(reason)
    running = slurm.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield running
    finally:
        slurm.stop(running)


def _sweep(directory: Path, extra: list[str], env: dict[str, str],
           sweep: list[str] = SWEEP) -> list[dict[str, str]]:
    done = subprocess.run([sys.executable, TRAIN, *BASE, *sweep, *extra,
                           f"hydra.sweep.dir={directory}"], cwd=directory.parent,
                          env=environment(env), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    with open(directory / "report.csv") as f:
        return list(csv.DictReader(f))


def test_submitit_sweep_runs_each_job_on_slurm_with_one_report(
        cluster: slurm.Cluster, tmp_path: Path) -> None:
    # The local reference runs beside the SLURM sweep: most of a job's time there is waiting
    # for the scheduler, not computing.
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_sweep, tmp_path / "local", [], {})
        on_slurm = _sweep(tmp_path / "slurm", SUBMITIT, cluster.env)
        local = reference.result()
    # Every job ran as a SLURM job of this cluster: submitit kept its record of each.
    jobs = sorted((tmp_path / "slurm" / ".submitit").glob("*/*_result.pkl"))
    assert len(jobs) == 2, list((tmp_path / "slurm" / ".submitit").rglob("*"))
    assert (tmp_path / "slurm" / "report.md").read_text().count("\n| ") == 3  # header + 2 rows
    assert [r.keys() for r in on_slurm] == [r.keys() for r in local]
    assert [r["strategy"] for r in on_slurm] == [r["strategy"] for r in local] == ["ddp", "zero3"]
    # The same jobs, so the same arithmetic: losses equal to the last bit.
    for column in ("first_loss", "train_loss", "val_loss"):
        assert [r[column] for r in on_slurm] == [r[column] for r in local], column


def _srun(cluster: slurm.Cluster, out: Path, strategy: str) -> list[dict]:
    out.mkdir()
    command = ["srun", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
               f"--job-name=zs-{strategy}", "--kill-on-bad-exit=1", "--time=10",
               sys.executable, "-m", "tests.worlds.multinode_lightning", str(out), strategy, "1"]
    try:
        done = subprocess.run(command, cwd=ROOT, env=environment(cluster.env),
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:  # say what the queue held: waiting, or hung
        raise AssertionError(f"srun ({strategy}) did not end in 600 s; the queue:\n"
                             + cluster.run("squeue", "-a", "-o", "%i %j %T %M %R")
                             + cluster.logs()) from e
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:] + cluster.logs()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_lightning_zero3_under_srun_matches_ddp(cluster: slurm.Cluster, tmp_path: Path) -> None:
    import torch

    ddp, zero3 = (_srun(cluster, tmp_path / s, s) for s in ("ddp", "zero3"))
    for records in (ddp, zero3):
        assert [r["rank"] for r in records] == [0, 1]
        assert {r["environment"] for r in records} == {"SLURMEnvironment"}
        assert {r["world_size"] for r in records} == {2}
    # fp32 on 2 ranks: DDP all-reduces the gradients where stage 3 reduce-scatters them, the
    # same sums in another order (a few ulps, ~1e-7 relative, per step), over 6 SGD steps.
    for a, b in zip(ddp, zero3):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-6)
    wa, wb = (torch.load(tmp_path / s / "weights.pt") for s in ("ddp", "zero3"))
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-5, atol=1e-6)


def _complete_checkpoint(sweep: Path, number: int) -> bool:
    jobs = list(sweep.glob(f"{number}-*"))
    if not jobs:
        return False
    last = jobs[0] / "checkpoints" / "last.ckpt"
    return last.is_file() or (last / "latest").exists() or (last / ".metadata").exists()


def _array_task(cluster: slurm.Cluster, number: int) -> str:
    """The SLURM id (``<array>_<task>``) of sweep job ``number``, still in the queue."""
    tasks = dict(line.split() for line in
                 cluster.run("squeue", "-r", "-h", "-o", "%K %i").splitlines())
    assert str(number) in tasks, f"job {number} ended before it was interrupted: {tasks}"
    return tasks[str(number)]


def test_interrupted_jobs_resume_where_uninterrupted_ones_end(
        cluster: slurm.Cluster, tmp_path: Path) -> None:
    """Job 0 is told its time is up (SIGUSR2, what ``--signal=USR2@90`` sends): submitit's
    hook in the job requeues it. Job 1 is requeued by SLURM itself (``scontrol requeue``, as
    a preemption with PreemptMode=REQUEUE does). Both start again, resume from their last
    checkpoint, and end on the losses of the same sweep run without interruption."""
    import time

    # 48 steps leave each job ~40 after its first checkpoint: it is interrupted within a poll
    # (0.1 s) and a SLURM command of that checkpoint (24 steps: one job had ended first).
    steps = ["strategy=zero2,zero3", "trainer.max_steps=48", "trainer.checkpoint_every=4",
             "trainer.val_check_interval=24"]
    interrupt = {0: ("scancel", "--signal=USR2"), 1: ("scontrol", "requeue")}
    sweep = tmp_path / "slurm"
    hydra = subprocess.Popen(
        [sys.executable, TRAIN, *BASE, *steps, *SUBMITIT, f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=environment(cluster.env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        ids: dict[int, str] = {}
        while len(ids) < len(interrupt):
            assert hydra.poll() is None, hydra.stdout.read()[-6000:] if hydra.stdout else ""
            assert time.monotonic() < deadline, f"no checkpoint within 10 minutes: {ids}"
            for number, command in interrupt.items():
                if number not in ids and _complete_checkpoint(sweep, number):
                    ids[number] = _array_task(cluster, number)
                    cluster.run(*command, ids[number])
            time.sleep(0.1)
        out, _ = hydra.communicate(timeout=900)
    finally:
        if hydra.poll() is None:
            hydra.kill()
    assert hydra.returncode == 0, out[-6000:]
    # Each job started twice (submitit logs each start) and the second run resumed from the
    # first one's checkpoint (Lightning says so); job 0 was requeued by submitit's hook.
    for job_id in ids.values():
        out = next((sweep / ".submitit").rglob(f"{job_id}_0_log.out")).read_text()
        err = next((sweep / ".submitit").rglob(f"{job_id}_0_log.err")).read_text()
        assert out.count("Starting with JobEnvironment") == 2, out[-3000:]
        # Lightning's lines go through the job's logging (stdout), its warnings to stderr.
        assert "Restoring states from the checkpoint path" in out + err, (out + err)[-3000:]
    assert "Requeued job" in next((sweep / ".submitit").rglob(f"{ids[0]}_0_log.out")).read_text()
    with open(sweep / "report.csv") as f:
        interrupted = list(csv.DictReader(f))
    # The reference after, not beside: two sweeps sharing the cores ran longer in all (194 s
    # against 170 s), the SLURM jobs' requeue and restart being compute too.
    straight = _sweep(tmp_path / "local", [], {}, sweep=steps)
    assert [r["strategy"] for r in interrupted] == ["zero2", "zero3"]
    # Where they end (the first loss of a resumed run is that of its first step after the
    # checkpoint): the final train loss and the final model's val loss, to the last bit.
    for column in ("train_loss", "val_loss"):
        assert [r[column] for r in interrupted] == [r[column] for r in straight], column


def test_a_job_on_two_nodes_forms_one_world_from_the_allocation(
        cluster: slurm.Cluster, tmp_path: Path) -> None:
    """``hydra.launcher.nodes=2``: one task on each node starts that node's worker, and the
    rendezvous comes from the allocation (no trainer.num_nodes or rdzv_endpoint set). The
    world is 2 ranks, as a one-node job with trainer.devices=2, and its losses equal that
    job's (the same ranks and data, over gloo either way)."""
    sweep = ["strategy=zero3", "trainer.max_steps=6", "trainer.val_check_interval=3"]
    two_nodes = _sweep(tmp_path / "slurm", [
        "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug",
        "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=20",
        "trainer.devices=1"], cluster.env, sweep=sweep)
    one_node = _sweep(tmp_path / "local", [], {}, sweep=sweep)
    job = next((tmp_path / "slurm").glob("0-*"))
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["nodes"] == 2 and metrics["world_size"] == 2, metrics
    for column in ("first_loss", "train_loss", "val_loss"):
        assert [r[column] for r in two_nodes] == [r[column] for r in one_node], column


ACCELERATE_CONF = ROOT / "conf" / "accelerate"
ACCELERATE_RUN = ["--model", "mlp", "--steps", "6", "--accum", "2", "--zero-opt",
                  "unit_numel=1000", "--zero-opt", "param_persistence_threshold=0"]


def _accelerate_srun(cluster: slurm.Cluster, out: Path, mode: str) -> list[dict]:
    """``srun --nodes=2 --ntasks-per-node=1``, each task ``accelerate launch`` with
    conf/accelerate/multi_machine.yaml, its machine rank and machine 0's address from SLURM
    (what docs/cluster.md's sbatch script runs). Both nodes are this host here, so node 1
    starts 3 s later: on one host Accelerate refuses to start machine 0 once machine 1's
    agent holds the port (different hosts do not share ports)."""
    from tests.support.nodes import free_port

    launch = (
        '[ "$SLURM_NODEID" = 0 ] || sleep 3; exec "$0" -m accelerate.commands.launch '
        f"--config_file {ACCELERATE_CONF / 'multi_machine.yaml'} --num_machines 2 "
        f"--num_processes 2 --machine_rank $SLURM_NODEID "
        f"--main_process_ip $SLURM_LAUNCH_NODE_IPADDR --main_process_port {free_port()} "
        f"{ROOT / 'recipes' / 'accelerate_train.py'} --mode {mode} "
        f"{' '.join(ACCELERATE_RUN)} --out {out}")
    command = ["srun", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
               "--kill-on-bad-exit=1", "--time=10", "bash", "-c", launch, sys.executable]
    env = {**cluster.env, "ZERO_STRATEGY_CONFIG": str(ACCELERATE_CONF / "zero3.yaml")}
    done = subprocess.run(command, cwd=ROOT, env=environment(env), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:] + cluster.logs()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_accelerate_zero3_on_two_slurm_nodes_matches_ddp(cluster: slurm.Cluster,
                                                         tmp_path: Path) -> None:
    ddp, zero3 = (_accelerate_srun(cluster, tmp_path / m, m) for m in ("ddp", "zero"))
    for a, b in zip(ddp, zero3):
        assert a["num_processes"] == b["num_processes"] == 2
        assert b["zero_config"]["stage"] == 3
        # fp32 on 2 ranks: the same sums as DDP's all-reduce in another order (reduce-
        # scatter), a few ulps per step, over 6 steps of 2 micro-batches.
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-6)

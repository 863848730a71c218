"""Ray Train: every entry point runs as a ``TorchTrainer`` job, checkpoints reach Ray a worker's
own shard files at a time, and a run continues exactly after a killed worker and at another
worker count.

One local Ray serves the module (2 CPUs, a 150 MB object store, tests/support/ray_cluster.py),
stopped at the end with no process of it left. The jobs, in the order the fixtures start them:

- ``entry``: tests/worlds/ray_entry_points.py as one Ray job of 2 workers (Lightning at stages
  1, 2, 3 and 3 with offload, Fabric, the engine, Accelerate, ZeroTrainer, with_zero(SFTTrainer))
  and the same world under torchrun, side by side;
- ``restarts``: tests/worlds/ray_engine.py as one run in three jobs: 2 workers with one killed
  mid-step 5 (``FailureConfig(max_failures=1)``), then 1 worker, then 2 again, each job
  continuing the run from its latest checkpoint;
- the recipes as a Ray job from the command line (``launcher=ray``), a two-job sweep;
- the complete examples of docs/ray.md, as scripts connecting to this Ray.

The whole module skips, with the reason, where Ray is not installed or cannot start.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("ray", reason="Ray Train is an optional extra: pip install zero-strategy[ray]")

import zero_strategy as zs  # noqa: E402
from tests.support import ray_cluster  # noqa: E402
from tests.support.nodes import ROOT, environment  # noqa: E402
from tests.worlds import ray_engine  # noqa: E402
from tests.worlds import ray_entry_points as entry_points  # noqa: E402

NAMES = list(entry_points.SCENARIOS)
WORLD = 2
# Both runs execute the same code from the same seeds on 2 gloo processes: the arithmetic is
# the same, operation for operation (measured: every loss and weight bit-identical). 1e-6
# relative is the bound; a rank training on the wrong samples, a missed reduction or
# a step lost on resume moves a loss by 1e-2 or more.
PARITY = 1e-6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    try:
        started = ray_cluster.start(tmp_path_factory.mktemp("ray-storage"))
    except Exception as e:  # noqa: BLE001 - whatever keeps Ray from starting here
        pytest.skip(f"Ray cannot start here: {type(e).__name__}: {e}")
    yield started
    left = ray_cluster.stop(started)
    assert not left, f"Ray processes were still running after ray.shutdown (killed): {left}"


@pytest.fixture(scope="module")
def entry(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both runs of every entry point: ``out/ray`` and ``out/torchrun``."""
    out = tmp_path_factory.mktemp("entry")
    script = ROOT / "tests" / "worlds" / "ray_entry_points.py"
    # Started first and left to run beside the Ray job: Ray's start-up is mostly waiting.
    with open(out / "torchrun.log", "w") as log:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(WORLD), str(script), str(out / "torchrun"), ",".join(NAMES)],
            cwd=out, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            result = ray_cluster.fit(cluster, entry_points.train_func,
                                     {"out": str(out / "ray"), "names": NAMES}, "entry")
            assert result.error is None, result.error
            assert torchrun.wait(timeout=600) == 0, (out / "torchrun.log").read_text()[-4000:]
        finally:
            if torchrun.poll() is None:
                torchrun.kill()
    return out


def ranks(folder: Path) -> list[dict[str, Any]]:
    found = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in found:
        assert "error" not in r, f"{folder} rank {r['rank']}:\n{r['error']}"
    return found


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(((a[k].float() - b[k].float()).abs().max()
                / b[k].float().abs().max().clamp_min(1e-12)).item() for k in a)


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name", NAMES)
def test_entry_point_under_ray_equals_torchrun(entry: Path, name: str) -> None:
    """Every rank's losses and the final weights of the Ray job against torchrun's run."""
    ray_ranks, torchrun_ranks = ranks(entry / "ray" / name), ranks(entry / "torchrun" / name)
    for got, want in zip(ray_ranks, torchrun_ranks):
        assert len(got["losses"]) == len(want["losses"]) >= entry_points.STEPS
        assert got["losses"] == pytest.approx(want["losses"], rel=PARITY), got["rank"]
        assert len(set(want["losses"])) > 1, "every step had the same loss: nothing trained"
    weights = torch.load(entry / "ray" / name / "weights.pt")
    assert relative(weights, torch.load(entry / "torchrun" / name / "weights.pt")) <= PARITY


# ------------------------------------------------------------------------------ checkpoints
def _reports() -> list[tuple[str, str, str]]:
    """What the entry job reported, in order: (scenario, the folder the report is a copy of,
    where in Ray's checkpoint it lies: "" or Ray's own callbacks' subfolder)."""
    s = entry_points.STEPS
    steps = range(entry_points.SAVE_EVERY, s + 1, entry_points.SAVE_EVERY)
    found = [("lightning_z1", f"ckpt/epoch=0-step={s}.ckpt", "checkpoint.ckpt")]
    for name in ("lightning_z2", "lightning_z3", "lightning_z3off"):
        found += [(name, f"ckpt/epoch=0-step={k}.ckpt", "") for k in steps]
    found += [("fabric_z3", f"step-{k}", "") for k in steps]
    found += [("engine_z3", f"step-{k:08d}", "") for k in range(
        ray_engine.SAVE_EVERY, ray_engine.UNINTERRUPTED + 1, ray_engine.SAVE_EVERY)]
    found += [("accelerate_z2", f"step-{k}", "") for k in steps]
    for k in steps:  # Ray's callback first, then ours, at each save
        found += [("trainer_z3", f"checkpoint-{k}", "checkpoint"),
                  ("trainer_z3", f"checkpoint-{k}", "")]
    found += [("sft_z3", f"checkpoint-{k}", "checkpoint") for k in steps]
    return found


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in ray_cluster.files(folder)}


def tags(folder: Path) -> list[Path]:
    """The tag directories of our checkpoints under ``folder`` (each holds a manifest)."""
    return sorted(p.parent for p in folder.rglob("manifest.json"))


def test_each_report_is_the_saved_checkpoint_whole(cluster: Any, entry: Path) -> None:
    """Ray's merged directory of every report of ours holds the files the entry point saved,
    byte for byte, and every checkpoint of ours in any report passes the verifier. Ray's own
    callbacks' reports are compared otherwise: its Lightning callback saves its own checkpoint
    at the epoch's end (Lightning's loop state differs from ModelCheckpoint's of the same step,
    the weights do not); its transformers callback copies the whole ``checkpoint-N/`` on every
    worker as soon as that worker has saved, so a file another rank is still writing can reach
    Ray truncated (seen: rank 0's ``rng_state_0.pth``, uploaded last by rank 1), and only our
    ``zero_checkpoint/``, complete on every rank once any save returns, is compared. The
    engine's saved folder is gone once reported (its consolidated weights are compared)."""
    reported = ray_cluster.checkpoints(cluster, "entry")
    expected = _reports()
    assert len(reported) == len(expected), [p.name for p in reported]
    for ray_dir, (name, saved, inside) in zip(reported, expected):
        merged = ray_dir / inside
        found = tags(merged)
        assert found, f"{ray_dir}: no checkpoint of ours in the report of {name}"
        for tag in found:
            zs.open_reader(tag).verify_all()
        local = entry / "ray" / name / saved
        if name == "lightning_z1":
            assert relative(zs.consolidate(merged), zs.consolidate(local)) == 0
        elif name == "engine_z3":
            if saved == f"step-{ray_engine.UNINTERRUPTED:08d}":
                final = f"weights-{ray_engine.UNINTERRUPTED}.pt"
                assert relative(zs.consolidate(merged), torch.load(local.parent / final)) == 0
        elif inside:  # Ray's transformers callback
            assert sorted(ray_cluster.files(merged)) == sorted(ray_cluster.files(local))
            ours = "zero_checkpoint"
            assert digests(merged / ours) == digests(local / ours), f"{name}: {ray_dir}"
        else:
            assert digests(merged) == digests(local), f"{name}: {ray_dir} is not {local}"


def _uploads(name: str, entry: Path) -> list[list[dict[str, Any]]]:
    """Each rank's uploads (files, bytes) in the scenario's reports made by our code."""
    return [r["reports"] for r in ranks(entry / "ray" / name)]


@pytest.mark.parametrize("name", ["lightning_z3", "fabric_z3", "engine_z3", "accelerate_z2",
                                  "trainer_z3"])
def test_each_worker_uploads_only_the_files_its_rank_wrote(entry: Path, name: str) -> None:
    """Rank 1 uploads its shard alone, rank 0 its shard and everything else (the manifest
    once): no file twice, none missing (the merged folders are complete, test above)."""
    zero, one = _uploads(name, entry)
    assert len(zero) == len(one) > 0
    for mine, theirs in zip(zero, one):
        assert theirs["files"] and all(f.endswith("shard-00001.safetensors")
                                       for f in theirs["files"]), theirs["files"]
        assert not set(mine["files"]) & set(theirs["files"])
        assert any(f.endswith("manifest.json") for f in mine["files"])
        assert not any(f.endswith("shard-00001.safetensors") for f in mine["files"])


def model_state_bytes() -> int:
    """fp32 weights plus AdamW's two states: 12 bytes per parameter (ray_engine's model)."""
    model, _ = ray_engine.build()
    return 12 * sum(p.numel() for p in model.parameters())


def test_each_upload_is_one_nth_of_the_model_states(entry: Path) -> None:
    """The engine's reports (1.8M parameters): rank 1 uploads its shard, 1/N of the 21 MB of
    weights and AdamW states plus safetensors' header and the padding of each unit to a
    multiple of N (under 1 %); rank 0 its shard plus the manifest, the module file and the
    client state (under 2 % here)."""
    share = model_state_bytes() / WORLD
    zero, one = _uploads("engine_z3", entry)
    for mine, theirs in zip(zero, one):
        assert share <= theirs["bytes"] <= 1.01 * share, (theirs["bytes"], share)
        assert share <= mine["bytes"] <= 1.02 * share, (mine["bytes"], share)


def test_a_report_holds_no_more_than_the_ranks_share_in_memory(entry: Path) -> None:
    """Peak RSS growth per rank while reporting. The upload alone (Fabric's and Accelerate's
    ``report`` of a folder already written) links files and lets Ray copy them: a few pages,
    plus what Ray allocates on its first report (2.1 MB seen once, 28 KB usually); reading
    the rank's shard file into memory would cost its size, about the rank's share, so half
    the share is the bound that tells the two apart.
    ``save_and_report`` also writes the shard, through one CPU tensor per unit and optimizer
    state (the writer's flat copies of the AdamW states, 8/12 of the rank's share) and
    safetensors' serialisation of the file. The two can be alive at once: 8/12 of the share
    plus the whole file, 1.67 shares (seen: 1.42 in one CI run, at most 1.0 in others); a
    gather of the model to report would hold N shares of model states before any write."""
    share = model_state_bytes() / WORLD
    for rank in _uploads("engine_z3", entry):
        for report in rank:
            bound = share * (8 / 12 + 1)
            assert 0 <= report["save_and_report_rss_growth"] <= bound, (report, share)
    for name in ("fabric_z3", "accelerate_z2"):
        for rank in _uploads(name, entry):
            for report in rank:
                assert report["peak_rss_growth"] <= share / 2, (name, report, share)


# ------------------------------------------------------------------------------ restarts
@pytest.fixture(scope="module")
def restarts(cluster: Any, entry: Path, drivers: Any,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run in three jobs (see the module docstring); ``entry`` first, whose engine run is
    the uninterrupted one, and the ``drivers`` started, which run beside."""
    out = tmp_path_factory.mktemp("restarts")
    name = "restarts"
    snapshot = cluster.storage / name / "checkpoint_manager_snapshot.json"
    result = ray_cluster.fit(cluster, ray_engine.train_func,
                             {"out": str(out), "stop": ray_engine.UNINTERRUPTED,
                              "kill": ray_engine.KILL, "snapshot": str(snapshot)},
                             name, max_failures=1)
    assert result.error is None, result.error
    for workers, stop in ray_engine.RESIZES:
        result = ray_cluster.fit(cluster, ray_engine.train_func, {"out": str(out), "stop": stop},
                                 name, workers=workers)
        assert result.error is None, result.error
    return out


def steps(out: Path) -> list[dict[str, Any]]:
    """Rank 0's line per step, in the order they ran."""
    return [json.loads(line) for line in (out / "steps-rank0.jsonl").read_text().splitlines()]


def test_a_killed_worker_is_restarted_from_the_last_report(restarts: Path,
                                                            entry: Path) -> None:
    """Rank 1 SIGKILLed in the middle of step 5: Ray starts both workers again, they resume
    from the checkpoint of step 4 and compute the uninterrupted run's losses of steps 5 and
    6 (the entry job's engine run, same code, same world size) and its weights."""
    starts = sorted(p.name for p in restarts.glob("started-*"))
    assert starts == ["started-0-world2", "started-1-world2", "started-2-world1",
                      "started-3-world2"]
    ran = steps(restarts)
    first = [s["step"] for s in ran if s["attempt"] == 0]
    second = [s["step"] for s in ran if s["attempt"] == 1]
    kill_step = ray_engine.KILL[0]
    assert first == list(range(1, kill_step)) and second == [kill_step, kill_step + 1]
    uninterrupted = ranks(entry / "ray" / "engine_z3")[0]["losses"]
    resumed = [s["loss"] for s in ran if s["attempt"] == 1]
    assert resumed == pytest.approx(uninterrupted[kill_step - 1:], rel=PARITY)
    final = f"weights-{ray_engine.UNINTERRUPTED}.pt"
    assert relative(torch.load(restarts / final),
                    torch.load(entry / "ray" / "engine_z3" / final)) <= PARITY


def test_a_run_continues_at_another_worker_count(restarts: Path) -> None:
    """The same run, 2 workers to step 6, then 1 to step 8, then 2 to step 10: each job
    resumes from the last, whatever the worker count that wrote it, and continues with the
    losses and ends with the weights of one process trained uninterrupted on the same data.

    The bound is the distance between two single-process references that round differently
    (the whole batch's gradient in one sum, and summed over its halves apart as two ranks
    sum it; the project's twin references, tests/support/space.py), times 4: summation order
    is all that separates the jobs from the reference (measured on 2026-11-28: 1.2 to 1.4x
    the twins' 5.5e-6 of a tensor's largest weight). A resumed job that lost AdamW's
    moments, a step or a rank's data is off by 1e-3 or more."""
    last = ray_engine.RESIZES[-1][1]
    losses, weights = ray_engine.reference(last)
    twin_losses, twin = ray_engine.reference(last, halves=True)
    bound = 4 * max(relative(twin, weights), 1e-7)
    # A loss is also summed in another order itself (the mean of the ranks' means): a few
    # ulps (1.2e-7 each) apart even for equal weights, hence the floor of 16 ulps.
    loss_bound = max(4 * max(abs(a - b) / abs(b) for a, b in zip(twin_losses, losses)), 2e-6)
    ran = steps(restarts)
    begin = ray_engine.UNINTERRUPTED
    for attempt, (workers, stop) in enumerate(ray_engine.RESIZES, start=2):
        part = [s for s in ran if s["attempt"] == attempt]
        assert [s["step"] for s in part] == list(range(begin + 1, stop + 1))
        assert {s["world"] for s in part} == {workers}
        assert [s["loss"] for s in part] == pytest.approx(losses[begin:stop], rel=loss_bound)
        begin = stop
    assert relative(torch.load(restarts / f"weights-{begin}.pt"), weights) <= bound


# ------------------------------------------------------------------------------ recipes, docs
SWEEP = ("model.size=tiny", "trainer.max_steps=4", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "trainer.checkpoint_every=2",
         "trainer.progress_bar=false", "data.batch_size=2")


@dataclass
class Driver:
    """A script driving this module's Ray from a process of its own."""

    proc: subprocess.Popen
    folder: Path

    def finish(self, timeout: float = 900) -> tuple[int, str]:
        """Its exit status and output, once it ends."""
        code = self.proc.wait(timeout=timeout)
        return code, (self.folder / "output.log").read_text()


@pytest.fixture(scope="module")
def drivers(cluster: Any, entry: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Started together once the entry job is done, and left to run beside the restarts'
    jobs (Ray queues their workers for the CPUs; their start-up is mostly waiting):

    - ``sweep``: ``python recipes/train.py -m launcher=ray launcher.address=...``, a sweep of
      one stage-3 job (each job is a Ray job as any other; one keeps the tier's time);
    - docs/ray.md's complete examples, each a script in a fresh directory (``RAY_ADDRESS``).
    """
    from tests.support.doc_blocks import RAY_EXAMPLES

    commands: dict[str, tuple[list[str], dict[str, str]]] = {"sweep": (
        [sys.executable, str(ROOT / "recipes" / "train.py"), "-m", "launcher=ray",
         f"launcher.address={cluster.address}", "strategy=zero3", *SWEEP,
         "hydra.sweep.dir=multirun"], {})}
    for where, code in RAY_EXAMPLES:
        commands[where] = ([sys.executable, "example.py"], {"RAY_ADDRESS": cluster.address,
                                                            "EXAMPLE": code})
    started: dict[str, Driver] = {}
    for i, (name, (command, extra)) in enumerate(commands.items()):
        folder = tmp_path_factory.mktemp(f"driver{i}")
        if "EXAMPLE" in extra:
            (folder / "example.py").write_text(extra.pop("EXAMPLE"))
        with open(folder / "output.log", "w") as log:
            started[name] = Driver(subprocess.Popen(
                command, cwd=folder, env=environment(extra), stdout=log,
                stderr=subprocess.STDOUT), folder)
    yield started
    for driver in started.values():
        if driver.proc.poll() is None:
            driver.proc.kill()
            driver.proc.wait()


def test_a_recipe_sweep_runs_as_ray_train_jobs(drivers: dict[str, Driver],
                                               restarts: Path) -> None:
    """The job ran as a Ray Train job of 2 workers: its checkpoints are in its Ray storage,
    each a complete checkpoint of ours; the sweep report has its row, as under torchrun."""
    code, output = drivers["sweep"].finish()
    assert code == 0, output[-6000:]
    sweep = drivers["sweep"].folder / "multirun"
    (job,) = [p.parent for p in sweep.glob("*/metrics.json")]
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 4
    assert metrics["strategy"] == "zero3" and metrics["train_loss"] < metrics["first_loss"]
    reported = [p for p in (job / "ray").glob("*/checkpoint_*") if p.is_dir()]
    assert len(reported) == 2, reported  # trainer.checkpoint_every=2 of 4 steps
    for folder in reported:
        (tag,) = tags(folder)
        assert tag.relative_to(folder) == Path("last.ckpt/checkpoint")
        zs.open_reader(tag).verify_all()
    table = (sweep / "report.md").read_text()
    assert "| zero3 |" in table and (sweep / "report.csv").exists()


def test_the_docs_examples_run(drivers: dict[str, Driver]) -> None:
    examples = [name for name in drivers if name != "sweep"]
    assert len(examples) == 2
    for where in examples:
        code, output = drivers[where].finish()
        assert code == 0, f"{where}:\n{output[-6000:]}"
        assert "loss " in output, where

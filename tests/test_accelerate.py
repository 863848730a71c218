"""Accelerate integration: real ``accelerate launch`` runs on 2 CPU processes, against plain
Accelerate DDP running the same loop, plus the plugin config's loading and validation.

The launched runs (tests/accelerate_launch.py) all start in the module fixtures: plain DDP, and
ZeRO stages 1-3 and stage 3 with offload, each a full run that saves its state half-way; then
each ZeRO variant relaunched from that state. fp32, accumulation 2, clipping at 1.0 (engaged).
And a GPT-2 with dropout on a shuffled loader at stage 3, saved after 6 of 12 steps and resumed,
its final model exported with ``save_model`` and reloaded with ``from_pretrained``.
And Muon beside AdamW prepared together at stage 2 (tests/accelerate_optimizers.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from tests import several_optimizers as so
from tests.accelerate_launch import CONF, Job, Outcome, run_jobs
from zero_strategy.accelerate import CONFIG_ENV, ZeroPlugin
from zero_strategy.config import ZeroConfig

TOL = 1e-5  # fp32: only the summation order differs from DDP
STEPS, ACCUM, SAVE_AT, CLIP = 6, 2, 3, 1.0
COMMON = ["--model", "mlp", "--steps", str(STEPS), "--accum", str(ACCUM), "--clip", str(CLIP)]
SMALL_UNITS = ["--zero-opt", "unit_numel=1000", "--zero-opt", "param_persistence_threshold=0"]
# Shipped plugin files (named by $ZERO_STRATEGY_CONFIG) with code overrides sized for the tiny
# MLP, so stage 3 really shards it and stages 1-2 use several buckets.
VARIANTS = {
    "zero1": ("zero1.yaml", ["--zero-opt", "bucket_numel=1000"]),
    "zero2": ("zero2.yaml", ["--zero-opt", "bucket_numel=1000"]),
    "zero3": ("zero3.yaml", SMALL_UNITS),
    "zero3_offload": ("zero3_offload.yaml", SMALL_UNITS),
    "zero3_disk": ("zero3_disk.yaml", SMALL_UNITS),
}
# The recipe's 2-layer GPT-2 (dropout 0.1) on a shuffled loader, one batch per step.
GPT2_STEPS, GPT2_SAVE_AT = 12, 6
GPT2 = ["--model", "gpt2", "--shuffle", "--steps", str(GPT2_STEPS), "--accum", "1",
        "--zero-opt", "unit_numel=5000", "--zero-opt", "param_persistence_threshold=100"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate")


@pytest.fixture(scope="module")
def outcomes(work: Path) -> dict[str, Outcome]:
    """Every launch of the module: full runs (the ZeRO ones save at SAVE_AT), each ZeRO variant
    resumed from its saved state, the GPT-2 pair, a bad-config launch and a plain-python run."""
    # First: the GPT-2 pair is the longest chain (transformers' import is most of each launch).
    gpt2_env, gpt2_ckpt = {CONFIG_ENV: str(CONF / "zero3.yaml")}, str(work / "gpt2-ckpt")
    jobs = [Job("gpt2", [*GPT2, "--save-at", str(GPT2_SAVE_AT), "--save-dir", gpt2_ckpt,
                         "--export-dir", str(work / "gpt2-export")], work / "gpt2", env=gpt2_env),
            Job("gpt2-resumed", [*GPT2, "--resume", gpt2_ckpt], work / "gpt2-resumed",
                env=gpt2_env, after="gpt2"),
            Job("ddp", ["--mode", "ddp", *COMMON], work / "ddp"),
            Job("optimizers", [], work / "optimizers",
                script=Path(__file__).parent / "accelerate_optimizers.py")]
    for name, (plugin, overrides) in VARIANTS.items():
        env, ckpt = {CONFIG_ENV: str(CONF / plugin)}, str(work / f"{name}-ckpt")
        jobs.append(Job(name, [*COMMON, *overrides, "--save-at", str(SAVE_AT), "--save-dir", ckpt],
                        work / name, env=env))
        jobs.append(Job(f"{name}-resumed", [*COMMON, *overrides, "--resume", ckpt],
                        work / f"{name}-resumed", env=env, after=name))
    # Rank 1 SIGKILLed after step 5 of a run checkpointing every 2 steps, launched with
    # restarts: the relaunched workers resume from step 4 (tests fault tolerance).
    jobs.append(Job("zero3-killed", [*COMMON, *SMALL_UNITS, "--checkpoint-every", "2",
                                     "--checkpoint-dir", str(work / "zero3-killed-ckpt")],
                    work / "zero3-killed", launch_args=["--max_restarts", "1"],
                    env={CONFIG_ENV: str(CONF / "zero3.yaml"), "ZS_FAULT_KILL_STEP": "5"}))
    bad = work / "bad_plugin.yaml"
    bad.write_text("stage: 3\nofload_params: true\n")
    # Not launched: the plugin file is read in every process the same way, so one process
    # shows the refusal without paying for a 2-process launch.
    jobs.append(Job("bad", COMMON, work / "bad", env={CONFIG_ENV: str(bad)}, launch=False))
    # Not launched: one process, world of one; ACCELERATE_MIXED_PRECISION is what a launch sets.
    # A loss scale of 2**40 overflows fp16 for certain: every step must be skipped.
    jobs.append(Job("single", ["--model", "mlp", "--steps", "3", "--zero-config",
                               str(CONF / "zero2.yaml"), "--zero-opt",
                               "loss_scale={initial_scale: 1099511627776.0}"], work / "single",
                    env={"ACCELERATE_MIXED_PRECISION": "fp16"}, launch=False))
    return run_jobs(jobs)


@pytest.fixture(scope="module")
def runs(outcomes: dict[str, Outcome]) -> dict[str, Outcome]:
    return outcomes


@pytest.fixture(scope="module")
def resumed(outcomes: dict[str, Outcome]) -> dict[str, Outcome]:
    return {name: outcomes[f"{name}-resumed"] for name in VARIANTS}


def _ok(outcome: Outcome, world: int = 2) -> list[dict]:
    assert outcome.returncode == 0, outcome.log[-4000:]
    assert [r["rank"] for r in outcome.ranks] == list(range(world)), outcome.log[-4000:]
    return outcome.ranks


def _close(a: float, b: float, tol: float = TOL) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=1e-7)


def _weights_rel(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    diff = sum((x - y) ** 2 for k in a for x, y in zip(a[k], b[k], strict=True))
    return math.sqrt(diff / sum(x * x for k in a for x in a[k]))


# ------------------------------------------------------------------------ launched runs
def test_cpu_launch_is_distributed_without_being_told(runs: dict[str, Outcome]) -> None:
    for name in ["ddp", *VARIANTS]:
        for r in _ok(runs[name]):
            assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU"
            assert r["device"].startswith("cpu") and r["mixed_precision"] == "no"
            assert r["unwrapped"] == "MLP", "unwrap_model must give the user's module"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_plugin_file_and_code_overrides_reach_the_engine(runs: dict[str, Outcome],
                                                         name: str) -> None:
    plugin, overrides = VARIANTS[name]
    expected = {**yaml.safe_load((CONF / plugin).read_text()),
                **{k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in overrides
                                                         if o != "--zero-opt")}}
    for r in _ok(runs[name]):
        for key, value in expected.items():
            assert r["zero_config"][key] == value, f"{name}: {key}"
        assert r["zero_config"]["precision"] == "32-true"  # from mixed_precision 'no'


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_plain_accelerate_ddp(runs: dict[str, Outcome], name: str) -> None:
    ref, got = _ok(runs["ddp"]), _ok(runs[name])
    for rank, (a, b) in enumerate(zip(ref, got)):
        assert len(b["losses"]) == STEPS * ACCUM and len(b["norms"]) == STEPS
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
            assert _close(x, y), f"{name} rank {rank} micro-batch {i}: loss {y} vs DDP {x}"
        for i, (x, y) in enumerate(zip(a["norms"], b["norms"], strict=True)):
            assert _close(x, y), f"{name} rank {rank} step {i}: grad norm {y} vs DDP {x}"
        assert a["lrs"] == b["lrs"]
        final = [(i + 1) % ACCUM == 0 for i in range(STEPS * ACCUM)]
        assert [n > 0 for n in b["reduced"]] == final, "accumulate() must skip the reduction"
    assert min(ref[0]["norms"]) > CLIP, "clipping never engaged: parity would not cover it"
    assert ref[0]["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
    rel = _weights_rel(ref[0]["weights"], got[0]["weights"])
    assert rel <= TOL, f"{name}: final weights differ from DDP's by {rel:.2e}"
    assert _close(ref[0]["eval_loss"], got[0]["eval_loss"]), "no_grad evaluation after training"
    # optimizer.state_dict() on the prepared optimizer: torch's format, the same parameter
    # indices and keys as plain Accelerate's; each state's sum of |x| agrees to the elements' fp32
    # summation-order difference (steps exactly).
    theirs, ours = ref[0]["optimizer_state"], got[0]["optimizer_state"]
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        assert sorted(ours[index]) == sorted(entry), index
        for key, value in entry.items():
            assert _close(ours[index][key], value), (index, key)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_resume_equals_uninterrupted_run(runs: dict[str, Outcome],
                                         resumed: dict[str, Outcome], name: str) -> None:
    full, again = _ok(runs[name]), _ok(resumed[name])
    for rank, (a, b) in enumerate(zip(full, again)):
        assert b["start_step"] == SAVE_AT and b["steps"] == STEPS
        tail = a["losses"][SAVE_AT * ACCUM:]
        assert len(b["losses"]) == len(tail)
        for i, (x, y) in enumerate(zip(tail, b["losses"])):
            assert _close(x, y), f"{name} rank {rank}: loss {i} after resume {y} vs {x}"
        for x, y in zip(a["norms"][SAVE_AT:], b["norms"], strict=True):
            assert _close(x, y), f"{name} rank {rank}: grad norm after resume"
        assert a["lrs"][SAVE_AT:] == b["lrs"], "the scheduler and the optimizer's lr resume"
    rel = _weights_rel(full[0]["weights"], again[0]["weights"])
    assert rel <= TOL, f"{name}: resumed final weights differ by {rel:.2e}"
    assert _close(full[0]["eval_loss"], again[0]["eval_loss"])


def test_resume_with_dropout_and_a_shuffled_loader_is_bit_exact(
        runs: dict[str, Outcome]) -> None:
    """The documented resume (load_state, then skip_first_batches for the rest of the epoch)
    repeats the uninterrupted run's batches and dropout masks: equal losses and weights, bit for
    bit. Plain Accelerate's skipped loader draws one number from the global generator after
    load_state restored it, shifting every later dropout mask on CPU; ZeroAccelerator's does
    not (``skip_first_batches``)."""
    full, again = _ok(runs["gpt2"]), _ok(runs["gpt2-resumed"])
    for a, b in zip(full, again):
        assert b["start_step"] == GPT2_SAVE_AT and b["steps"] == GPT2_STEPS
        assert b["losses"] == a["losses"][GPT2_SAVE_AT:]
        assert b["lrs"] == a["lrs"][GPT2_SAVE_AT:]
    assert again[0]["weights"] == full[0]["weights"]
    assert again[0]["eval_loss"] == full[0]["eval_loss"]


def test_save_model_and_from_pretrained_give_the_trained_weights(
        runs: dict[str, Outcome], work: Path) -> None:
    """Stage 3, sharded parameters: ``accelerator.save_model`` writes the consolidated
    weights (safetensors; the tied ``lm_head.weight`` once, as Accelerate does), the config
    beside them makes a ``from_pretrained`` folder, and ``GPT2LMHeadModel.from_pretrained``
    gives exactly the weights ``accelerator.get_state_dict`` returned."""
    from safetensors.torch import load_file

    rank0 = _ok(runs["gpt2"])[0]
    assert rank0["zero_config"]["stage"] == 3
    export = rank0["export"]
    assert export["files"] == ["config.json", "model.safetensors"]
    assert export["keys_equal"] and export["max_abs_diff"] == 0.0, export
    saved = load_file(str(work / "gpt2-export" / "model.safetensors"))
    assert set(saved) == set(rank0["weights"]) - {"lm_head.weight"}
    for key, tensor in saved.items():
        assert tensor.flatten().tolist() == rank0["weights"][key], key


def test_the_resumed_loader_leaves_the_global_generator_alone() -> None:
    """The cause and the fix in isolation: starting a DataLoader's iterator draws from the
    global generator; after what ZeroAccelerator.skip_first_batches applies it does not, and the
    batches are the same. A loader with the user's own generator is left as it is."""
    from torch.utils.data import DataLoader

    from zero_strategy.integrations.accelerate import _seed_workers_from_a_copy

    def first_batch(loader: DataLoader) -> tuple[list[int], bool]:
        torch.manual_seed(3)
        before = torch.get_rng_state()
        batch = next(iter(loader))
        return batch.tolist(), torch.equal(before, torch.get_rng_state())

    order = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    loader = DataLoader(torch.arange(10), batch_size=4, sampler=order)
    assert first_batch(loader) == (order[:4], False)
    _seed_workers_from_a_copy(loader)
    assert first_batch(loader) == (order[:4], True)
    own = torch.Generator()
    loader = DataLoader(torch.arange(10), batch_size=4, shuffle=True, generator=own)
    _seed_workers_from_a_copy(loader)
    assert loader.generator is own


def test_save_state_layout(runs: dict[str, Outcome], work: Path) -> None:
    """Accelerate's own files for everything but the model and optimizer, which are sharded."""
    _ok(runs["zero3"])
    folder = work / "zero3-ckpt"
    names = {p.name for p in folder.iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "scheduler.bin",
            "custom_checkpoint_0.pkl", "zero_checkpoint"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "optimizer.bin"}
    tag = folder / "zero_checkpoint" / (folder / "zero_checkpoint" / "latest").read_text()
    shards = {p.name for p in tag.iterdir()}
    assert {"manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"} <= shards


def test_bad_plugin_config_fails_before_training(runs: dict[str, Outcome], work: Path) -> None:
    outcome = runs["bad"]
    assert outcome.returncode != 0
    assert "ofload_params" in outcome.log and str(work / "bad_plugin.yaml") in outcome.log
    assert not outcome.ranks, "nothing may train with a bad plugin config"


def test_plain_python_run_with_the_engines_fp16_loss_scaling(runs: dict[str, Outcome]) -> None:
    """Without a launcher: a process group of one. Accelerate's fp16 -> the engine's 16-mixed,
    whose loss scaler (not a GradScaler) skips overflowing steps, and the scheduler with them."""
    (r,) = _ok(runs["single"], world=1)
    assert r["distributed_type"] == "DistributedType.NO" and r["mixed_precision"] == "fp16"
    assert r["zero_config"]["stage"] == 2 and r["zero_config"]["precision"] == "16-mixed"
    assert not r["grad_scaler"], "Accelerate's GradScaler must stay off"
    assert r["skipped"] == [True] * 3 and r["moved"] == 0.0
    assert len(set(r["lrs"])) == 1, "a skipped step must not advance the scheduler"


def test_several_optimizers_match_single_process_training(runs: dict[str, Outcome]) -> None:
    """``prepare(model, muon, adamw, scheduler)``: one engine step per optimizer step (the
    second part's ``step()`` takes its turn), the weights of one process training on the global
    batch, the scheduler changing the Muon part's lr only, each wrapper's ``state_dict()`` its
    own part's (tolerance: so.TOL)."""
    for r in _ok(runs["optimizers"]):
        assert r["engine_steps"] == so.STEPS
        assert r["rel"] <= so.TOL, f"weights differ from single-process training by {r['rel']}"
        assert r["moved"] > 1e-2
        # Accelerate steps the scheduler once per process (2) at each optimizer step.
        assert r["lr"] == [[so.MUON_LR * so.muon_factor(2 * i), so.ADAMW_LR]
                           for i in range(so.STEPS)]
        muon, adamw = r["part_states"]
        assert list(muon) == ["0", "1", "2"] and all(k == ["momentum_buffer"]
                                                     for k in muon.values())
        assert len(adamw) == 9 and all(k == ["exp_avg", "exp_avg_sq", "step"]
                                       for k in adamw.values())


def test_several_optimizers_double_step_and_state_round_trip(runs: dict[str, Outcome]) -> None:
    """Muon stepped twice after one backward is refused; ``load_state`` restores both parts'
    weights, states and lrs exactly: the step replayed after it (AdamW first) gives the same
    weights as the step before it."""
    for r in _ok(runs["optimizers"]):
        assert "optimizer 0 (Fp32Muon) was stepped twice without a backward" in r["double_step"]
        assert r["loaded_lr"] == [so.MUON_LR * so.muon_factor(2 * so.STEPS), so.ADAMW_LR]
        assert r["loaded_rel"] == 0.0 and r["replayed_rel"] == 0.0


# ------------------------------------------------------------------------ plugin config
@pytest.mark.parametrize("path", sorted(CONF.glob("zero*.yaml")), ids=lambda p: p.name)
def test_shipped_plugin_configs_load(path: Path) -> None:
    config = ZeroPlugin.from_config(path).resolve("no" if "fp16" not in path.name else "fp16")
    assert isinstance(config, ZeroConfig)
    assert f"zero{config.stage}" in path.name


def test_shipped_accelerate_config_loads_in_accelerate() -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONF / "multi_process.yaml"))
    assert config.num_processes == 2 and config.distributed_type.value == "MULTI_GPU"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("stage: 3\nstagee: 2\n", "'stagee'"),                 # unknown key
        ("stage: '3'\n", "stage"),                             # wrong type
        ("stage: 3.0\n", "stage"),                             # a float ZeroConfig would accept
        ("stage: 4\n", "stage"),                               # invalid value
        ("stage: 2\noffload_optimizer: 'yes'\n", "offload_optimizer"),
        ("stage: 2\nbucket_numel: 1.0e6\n", "bucket_numel"),
        ("stage: 2\nunit_numel: 100\n", "unit_numel"),         # stage-3 knob at stage 2
        ("precision: 16-mixed\nloss_scale: {initial: 2.0}\n", "loss_scale.initial"),
        ("loss_scale: {growth_interval: 'often'}\n", "loss_scale.growth_interval"),
        ("- stage\n", "mapping"),
        ("stage: [3\n", "YAML"),
    ],
)
def test_bad_plugin_config_names_key_and_file(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "plugin.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        ZeroPlugin.from_config(path)
    assert named in str(err.value) and str(path) in str(err.value)


def test_wrong_type_in_code_names_the_arguments() -> None:
    with pytest.raises(ValueError, match=r"ZeroPlugin\(\.\.\.\) arguments: prefetch"):
        ZeroPlugin(stage=3, prefetch="no")


def test_missing_file_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "nope.yaml"))
    with pytest.raises(FileNotFoundError, match=rf"nope\.yaml \(named by \${CONFIG_ENV}\)"):
        ZeroPlugin.from_config()


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Code keyword arguments > the file (explicit path > $ZERO_STRATEGY_CONFIG) > defaults."""
    env_file, explicit = tmp_path / "env.yaml", tmp_path / "explicit.yaml"
    env_file.write_text("stage: 2\nbucket_numel: 123\n")
    explicit.write_text("stage: 1\n")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert ZeroPlugin.from_config().resolve("no") == ZeroConfig()  # nothing set: defaults
    monkeypatch.setenv(CONFIG_ENV, str(env_file))
    assert ZeroPlugin.from_config().resolve("no") == ZeroConfig(stage=2, bucket_numel=123)
    assert ZeroPlugin.from_config(explicit).resolve("no") == ZeroConfig(stage=1)
    overridden = ZeroPlugin.from_config(stage=1, offload_optimizer=True)
    assert overridden.resolve("no") == ZeroConfig(stage=1, bucket_numel=123,
                                                  offload_optimizer=True)
    assert ZeroPlugin(stage=0).resolve("no") == ZeroConfig(stage=0)  # code only: no env file


@pytest.mark.parametrize(
    ("options", "mixed", "precision"),
    [
        ({}, "no", "32-true"), ({}, "bf16", "bf16-mixed"), ({}, "fp16", "16-mixed"),
        ({"precision": "bf16-true"}, "no", "bf16-true"),
        ({"precision": "bf16-true"}, "bf16", "bf16-true"),
        ({"precision": "16-mixed", "loss_scale": {"hysteresis": 1}}, "fp16", "16-mixed"),
    ],
)
def test_mixed_precision_mapping(options: dict, mixed: str, precision: str) -> None:
    assert ZeroPlugin(**options).resolve(mixed).precision == precision


def test_contradicting_precisions_fail() -> None:
    with pytest.raises(ValueError, match="contradicts Accelerate's mixed_precision='bf16'"):
        ZeroPlugin(precision="16-mixed").resolve("bf16")
    with pytest.raises(ValueError, match="'fp8' is not supported"):
        ZeroPlugin().resolve("fp8")
    with pytest.raises(ValueError, match="loss_scale applies to precision='16-mixed' only"):
        ZeroPlugin(loss_scale={"hysteresis": 1}).resolve("bf16")


def test_a_launch_that_accelerate_counts_as_one_process_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What PartialState() created before the accelerator (without cpu=True) leads to on CPU:
    each rank would read the whole data set, so training must not start."""
    import torch

    from zero_strategy.integrations.accelerate import _ensure_process_group

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # whatever ran before
    with pytest.raises(RuntimeError, match="2 processes were launched but Accelerate counts 1"):
        _ensure_process_group(torch.device("cpu"), num_processes=1)


def test_killed_worker_restarts_and_ends_with_the_uninterrupted_weights(
        runs: dict[str, Outcome]) -> None:
    """``accelerate launch --max_restarts 1``: rank 1 dies after step 5, the launcher restarts
    both workers, which resume from the step-4 checkpoint (the newest complete one) and end
    with the uninterrupted zero3 run's weights, bit for bit."""
    killed, full = runs["zero3-killed"], _ok(runs["zero3"])
    assert "exitcode: -9" in killed.log, killed.log[-4000:]
    again = _ok(killed)
    for a, b in zip(full, again):
        assert b["start_step"] == 4 and b["steps"] == STEPS
        assert b["losses"] == a["losses"][4 * ACCUM:]
    assert again[0]["weights"] == full[0]["weights"]

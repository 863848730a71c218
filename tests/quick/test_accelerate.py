"""Accelerate integration, its smallest end-to-end case and the plugin config: a real
``accelerate launch`` of 2 CPU processes at stage 3 (the shipped ``zero3.yaml``) against plain
Accelerate DDP running the same loop, its ``save_state`` layout, a bad plugin file refused
before training, and one plain-python process with fp16 loss scaling; then the plugin
config's loading and validation. Every other shipped plugin file, resuming, GPT-2 with
dropout, several optimizers and a killed worker: tests/integration/test_accelerate_launches.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import accelerate_checks as A
from tests.worlds.accelerate_launch import CONF, Job, Outcome, run_jobs
from zero_strategy.accelerate import CONFIG_ENV, ZeroPlugin
from zero_strategy.config import ZeroConfig


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("accelerate")


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Outcome]:
    bad = work / "bad_plugin.yaml"
    bad.write_text("stage: 3\nofload_params: true\n")
    jobs = [A.ddp_job(work), *A.variant_jobs(work, "zero3", resume=False),
            *A.variant_jobs(work, "zero3_checkpointed", resume=False),
            # Not launched: the plugin file is read in every process the same way, so one
            # process shows the refusal without paying for a 2-process launch.
            Job("bad", A.COMMON, work / "bad", env={CONFIG_ENV: str(bad)}, launch=False),
            # Not launched: one process, world of one; ACCELERATE_MIXED_PRECISION is what a
            # launch sets. A loss scale of 2**40 overflows fp16 for certain: every step must
            # be skipped.
            Job("single", ["--model", "mlp", "--steps", "3", "--zero-config",
                           str(CONF / "zero2.yaml"), "--zero-opt",
                           "loss_scale={initial_scale: 1099511627776.0}"], work / "single",
                env={"ACCELERATE_MIXED_PRECISION": "fp16"}, launch=False)]
    return run_jobs(jobs)


def test_cpu_launch_is_distributed_without_being_told(runs: dict[str, Outcome]) -> None:
    for name in ("ddp", "zero3"):
        A.assert_launched_distributed(runs[name])


def test_plugin_file_and_code_overrides_reach_the_engine(runs: dict[str, Outcome]) -> None:
    A.assert_overrides_reached_the_engine(runs["zero3"], "zero3")


def test_matches_plain_accelerate_ddp(runs: dict[str, Outcome]) -> None:
    A.assert_matches_ddp(runs["ddp"], runs["zero3"], "zero3")


def test_activation_checkpointing_from_the_plugin(runs: dict[str, Outcome]) -> None:
    """activation_checkpointing / offload_activations set through the plugin reach the engine;
    no dropout, so the recomputed run matches plain DDP's arithmetic."""
    A.assert_overrides_reached_the_engine(runs["zero3_checkpointed"], "zero3_checkpointed")
    A.assert_matches_ddp(runs["ddp"], runs["zero3_checkpointed"], "zero3_checkpointed")


def test_the_resumed_loader_leaves_the_global_generator_alone() -> None:
    """The cause and the fix in isolation: starting a DataLoader's iterator draws from the
    global generator; after what ZeroAccelerator.skip_first_batches applies it does not, and the
    batches are the same. A loader with the user's own generator is left as it is."""
    from torch.utils.data import DataLoader

    from zero_strategy.integrations.accelerate.accelerator import _seed_workers_from_a_copy

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
    A.ok(runs["zero3"])
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
    """Without a launcher: a process group of one. Accelerate's fp16 -> the engine's
    16-autocast (autocast over fp32 weights, as Accelerate runs it), whose loss scaler (not a
    GradScaler) skips overflowing steps, and the scheduler with them."""
    (r,) = A.ok(runs["single"], world=1)
    assert r["distributed_type"] == "DistributedType.NO" and r["mixed_precision"] == "fp16"
    assert r["zero_config"]["stage"] == 2 and r["zero_config"]["precision"] == "16-autocast"
    assert not r["grad_scaler"], "Accelerate's GradScaler must stay off"
    assert r["skipped"] == [True] * 3 and r["moved"] == 0.0
    assert len(set(r["lrs"])) == 1, "a skipped step must not advance the scheduler"


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
        ("activation_checkpointing: [3]\n", "activation_checkpointing"),  # not class names
        ("stage: 3\nunit_leaf_classes: GPT2Block\n", "unit_leaf_classes"),  # not a list
        ("offload_activations: disk\n", "needs activation_checkpointing"),
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


def test_lists_of_class_names_load_from_yaml(tmp_path: Path) -> None:
    """A YAML list where ZeroConfig takes a tuple of class names (refused before 2026-11-27:
    the type check knew no tuples)."""
    path = tmp_path / "plugin.yaml"
    path.write_text("stage: 3\nunit_leaf_classes: [GPT2MLP]\n"
                    "activation_checkpointing: [GPT2Block]\noffload_activations: cpu\n")
    config = ZeroPlugin.from_config(path).resolve(None)
    assert config.unit_leaf_classes == ("GPT2MLP",)
    assert config.activation_checkpointing == ("GPT2Block",)
    assert config.offload_activations == "cpu"


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
        ({}, "no", "32-true"), ({}, "bf16", "bf16-autocast"), ({}, "fp16", "16-autocast"),
        ({"precision": "bf16-mixed"}, "bf16", "bf16-mixed"),
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
    with pytest.raises(ValueError, match="loss_scale applies to the fp16 precisions"):
        ZeroPlugin(loss_scale={"hysteresis": 1}).resolve("bf16")


def test_a_launch_that_accelerate_counts_as_one_process_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What PartialState() created before the accelerator (without cpu=True) leads to on CPU:
    each rank would read the whole data set, so training must not start."""
    import torch

    from zero_strategy.integrations.accelerate.accelerator import _ensure_process_group

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # whatever ran before
    with pytest.raises(RuntimeError, match="2 processes were launched but Accelerate counts 1"):
        _ensure_process_group(torch.device("cpu"), num_processes=1)


def _positions(*args: object) -> tuple[int, list[int]] | None:
    """Which argument of ``prepare(*args)`` the engine trains, and its optimizers' positions:
    the selection alone, without building anything (the engine's own parity with empty groups
    is tests/quick/test_optimizer_groups.py; a Trainer whose first group is empty:
    tests/integration/test_transformers_trainer.py)."""
    import types

    from zero_strategy.integrations.accelerate.accelerator import ZeroAccelerator

    unprepared = types.SimpleNamespace(_zero_model=None)
    return ZeroAccelerator._zero_positions(unprepared, args)  # type: ignore[arg-type]


def test_prepare_finds_the_model_of_an_optimizer_whose_first_group_is_empty() -> None:
    """Trainer's "decay" group is empty when only biases and norms train; it crashed prepare
    with IndexError (``param_groups[0]["params"][0]``)."""
    frozen, model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    trained = torch.optim.AdamW([{"params": []}, {"params": [model.bias]}, {"params": []}])
    assert _positions(frozen, model, trained) == (1, [2])
    # An optimizer with no parameter yet (torch accepts one) goes with the call's others,
    nothing = torch.optim.SGD([{"params": []}], lr=0.1)
    assert _positions(frozen, nothing, model, trained) == (2, [1, 3])
    # or with the only model, whose engine then names what is missing.
    assert _positions(model, nothing) == (0, [1])


@pytest.mark.parametrize("args, match", [
    ("two_models_nothing", r"param groups are all empty \(SGD \(argument 2\)\) and 2 models "
                           r"\(arguments \[0, 1\]\)"),
    ("no_model", r"optimizers \(SGD \(argument 0\)\) but not the model"),
    ("foreign", r"got an optimizer \(AdamW, argument 1\) but not the model it was built on"),
    ("two_owners", r"built on different models \(arguments \[0, 1\]\)"),
])
def test_prepare_refuses_what_names_no_single_model(args: str, match: str) -> None:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    nothing = torch.optim.SGD([{"params": []}], lr=0.1)
    calls = {"two_models_nothing": (a, b, nothing), "no_model": (nothing,),
             "foreign": (a, torch.optim.AdamW([{"params": []}, {"params": b.parameters()}])),
             "two_owners": (a, b, torch.optim.AdamW(a.parameters()),
                            torch.optim.AdamW([{"params": []}, {"params": b.parameters()}]))}
    with pytest.raises(ValueError, match=match):
        _positions(*calls[args])

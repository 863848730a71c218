"""The anchors in the recipes (Lightning's FSDPStrategy and DeepSpeedStrategy), the byte
counter that measures them, and the benchmark regimes as experiments. The sweep that runs
an anchor beside zero_strategy, and the DeepSpeed job compared with it, live in
test_recipes.py (they share its sweep); DeepSpeed runs only where the package is installed
(the optional ``anchors`` extra)."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recipes import schema
from tests.support.recipe_runs import FAST, compose_config, run_train

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

ANCHORS = {"fsdp": ("fsdp", 3, False), "deepspeed_stage_1": ("deepspeed", 1, False),
           "deepspeed_stage_2": ("deepspeed", 2, False),
           "deepspeed_stage_3": ("deepspeed", 3, False),
           "deepspeed_stage_2_offload": ("deepspeed", 2, True),
           "deepspeed_stage_3_offload": ("deepspeed", 3, True)}


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_anchor_presets_compose_with_their_implementation_and_stage(name: str) -> None:
    s = compose_config([f"strategy={name}"]).strategy
    assert (str(s.impl), s.stage, s.offload) == ANCHORS[name]
    assert s.name == name and schema.zero_options(s.zero) == {}


@pytest.mark.parametrize(("option", "impl"), [("ddp", "ddp"), ("zero1", "zero"),
                                              ("zero3_offload", "zero")])
def test_existing_presets_name_their_implementation(option: str, impl: str) -> None:
    assert str(compose_config([f"strategy={option}"]).strategy.impl) == impl


def test_fsdp_preset_passes_the_checks_that_run_before_workers() -> None:
    from recipes import launch

    launch.check_job(compose_config(["strategy=fsdp"]))


@pytest.mark.parametrize(("overrides", "named"), [
    (["strategy=fsdp", "strategy.zero.bucket_numel=5"],
     "strategy.zero.bucket_numel: strategy=fsdp is Lightning's FSDPStrategy, which does not "
     "read zero_strategy's options"),
    (["strategy=deepspeed_stage_2", "strategy.zero.offload_optimizer=true"],
     "strategy.zero.offload_optimizer: strategy=deepspeed_stage_2 is Lightning's "
     "DeepSpeedStrategy"),
    (["strategy=ddp", "strategy.zero.prefetch=true"], "Lightning's DDPStrategy"),
    (["strategy=fsdp", "strategy.stage=1"], "strategy.stage=1 with strategy.impl=fsdp: "
                                            "allowed [2, 3]"),
    (["strategy=fsdp", "optim=muon"], "optim.name='muon' with strategy=fsdp"),
    (["strategy=zero2", "strategy.offload=true"], "strategy.zero.offload_optimizer"),
])
def test_options_an_implementation_does_not_read_are_refused_by_name(
        overrides: list[str], named: str) -> None:
    from recipes import launch

    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        launch.check_job(compose_config(overrides))


def test_deepspeed_missing_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where deepspeed is not installed the job fails in the Hydra process, before any worker
    starts, with the command that installs it (checked here on any machine by hiding it)."""
    from recipes import anchors, launch

    real = importlib.util.find_spec
    monkeypatch.setattr(anchors.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ValueError, match=r"strategy=deepspeed_stage_3: the deepspeed package "
                                         r"is not installed; .*pip install -e '\.\[anchors\]'"):
        launch.check_job(compose_config(["strategy=deepspeed_stage_3"]))


def test_wrong_anchor_key_fails_before_any_worker_starts(tmp_path: Path) -> None:
    run = run_train("strategy=fsdp", "strategy.zero.unit_numel=5", *FAST, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "strategy.zero.unit_numel: strategy=fsdp" in out, out[-2000:]
    assert "processes:" not in out


# ------------------------------------------------------------------ the byte counter
class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize(("method", "args", "expected"), [
    # ring all-reduce: 2 (N-1)/N of the tensor, as the engine's own counter
    ("allreduce", ([torch.zeros(1000)],), 2 * 4000 * 3 // 4),
    # all-gather: (N-1)/N of the gathered output
    ("all_gather_single", (torch.zeros(400), torch.zeros(100)), 1600 * 3 // 4),
    # reduce-scatter: (N-1)/N of the input
    ("reduce_scatter_single", (torch.zeros(100), torch.zeros(400)), 1600 * 3 // 4),
    ("_reduce_scatter_base", (torch.zeros(100), torch.zeros(400)), 1600 * 3 // 4),
    ("broadcast", ([torch.zeros(10, dtype=torch.float64)],), 80),
])
def test_counter_uses_the_engines_byte_model(method: str, args: tuple, expected: int) -> None:
    from recipes.comm_count import CommCounter

    counter = CommCounter()
    counter.count(_Group(4), method, args)
    assert counter.total() == expected
    with counter.paused():
        counter.count(_Group(4), method, args)
    counter.count(_Group(1), method, args)  # a world of one sends nothing
    assert counter.total() == expected


def test_counter_wraps_every_process_group_collective_it_names() -> None:
    """The counter sits on the ProcessGroup methods (libraries keep their own references to
    torch.distributed's functions); a method torch renames would go uncounted, so the table
    must name only methods this torch has, and the common ones must be there."""
    from recipes.comm_count import METHODS

    pg = torch.distributed.ProcessGroup
    present = {m for m in METHODS if hasattr(pg, m)}
    assert {"allreduce", "broadcast", "_allgather_base", "_reduce_scatter_base"} <= present
    # Which method torch.distributed's own collectives end in moved (torch 2.9:
    # _allgather_base, later all_gather_single): the counter must see each on this torch.
    result = subprocess.run([sys.executable, "-c", _METHODS_CALLED], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    called = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(called.values()) and set().union(*called.values()) <= present, called


_METHODS_CALLED = """
import json, torch, torch.distributed as dist
from recipes.comm_count import CommCounter
seen = []
counter = CommCounter()
counter.count = lambda group, method, args: seen.append(method)  # one rank sends no bytes
counter.install()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
x = torch.ones(4)
calls = {"all_reduce": lambda: dist.all_reduce(x), "broadcast": lambda: dist.broadcast(x, 0),
         "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4), x),
         "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(4), x)}
called = {}
for name, call in calls.items():
    seen.clear(); call(); called[name] = sorted(set(seen))
dist.destroy_process_group()
print(json.dumps(called))
"""


def test_bytes_not_measured_are_never_shown_as_zero(tmp_path: Path) -> None:
    from recipes import report

    for i, comm in enumerate([None, 2.0**20]):
        (tmp_path / f"{i}-job").mkdir()
        (tmp_path / f"{i}-job" / "metrics.json").write_text(json.dumps({
            "strategy": f"s{i}", "precision": "32-true", "world_size": 2, "samples_per_s": 1.0,
            "ranks": [{"peak_rss_mib": 1, "model_state_bytes": 1, "predicted_bytes": 1}],
            "comm_bytes_per_step": comm, "train_loss": 1.0, "val_loss": 1.0}))
    report.write(tmp_path)
    lines = [ln for ln in (tmp_path / "report.md").read_text().splitlines()
             if ln.startswith(("| s0 ", "| s1 "))]
    sent = [ln.split(" | ")[[h for _, h, _ in report.COLUMNS].index("MiB sent/step/rank")]
            for ln in lines]
    assert sent == ["not measured", "1.00"]
    with open(tmp_path / "report.csv") as f:
        assert [r["comm_mib_per_step"] for r in csv.DictReader(f)] == ["", "1.0"]


# ------------------------------------------------------------------ census and labels
def test_census_counts_each_storage_once_by_the_first_claim() -> None:
    from recipes.anchors import Census

    flat = torch.zeros(100)
    views = [flat[:60], flat[60:]]  # a flat buffer under two parameter views
    c = Census()
    for v in views:
        c.add("params", "p", v)
    c.add("grads", "g", torch.zeros(10))
    c.add("optim", "again", views[0])  # already claimed as a parameter
    assert c.bytes == {"params": 400, "grads": 40, "optim": 0, "other": 0}
    assert c.model_states == 440


def test_anchor_labels_are_read_from_the_strategy_objects() -> None:
    from recipes import anchors, metrics

    assert metrics.strategy_label(anchors.CpuFSDPStrategy()) == ("fsdp", 3)
    assert metrics.strategy_label(anchors.CpuFSDPStrategy(
        sharding_strategy="SHARD_GRAD_OP")) == ("fsdp_shard_grad_op", 2)
    fake_ds = type("CpuDeepSpeedStrategy", (), {})()
    fake_ds.config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert metrics.strategy_label(fake_ds) == ("deepspeed_stage_2_offload", 2)


# ------------------------------------------------------------------ benchmark regimes
@pytest.mark.parametrize(("experiment", "sizes", "millions"), [
    ("bench_throughput", dict(n_layer=4, n_embd=512, n_head=8, vocab=8192, seq=128, batch=4,
                              steps=8), 16.9),
    ("bench_memory", dict(n_layer=12, n_embd=1024, n_head=16, vocab=16384, seq=32, batch=1,
                          steps=4), 168.0),
])
def test_bench_experiments_reproduce_the_shared_benchmark_regimes(
        experiment: str, sizes: dict, millions: float) -> None:
    """The regimes of bench/compare.py (the README's table): architecture, data shape, AdamW at a
    constant 1e-4 with betas (0.9, 0.95) and weight decay 0.1, clipping 1.0, fp32, and the
    timed steps after the recipes' warm-up; the model built from it has the parameter count
    the benchmark lists."""
    from recipes import metrics
    from recipes.models import SIZES, build_model

    cfg = compose_config([f"experiment={experiment}", "strategy=fsdp"])
    knobs = SIZES["gpt"][str(cfg.model.size)]
    assert (knobs["n_layer"], knobs["n_embd"], knobs["n_head"]) == (
        sizes["n_layer"], sizes["n_embd"], sizes["n_head"])
    assert (cfg.data.kind, cfg.data.vocab_size, cfg.model.seq_len, cfg.data.batch_size) == (
        "random", sizes["vocab"], sizes["seq"], sizes["batch"])
    assert cfg.trainer.max_steps - metrics.WARMUP_STEPS == sizes["steps"]
    assert (cfg.optim.lr, list(cfg.optim.betas), cfg.optim.weight_decay) == (1e-4, [0.9, 0.95],
                                                                              0.1)
    assert cfg.optim.min_lr_ratio == 1.0 and cfg.trainer.gradient_clip_val == 1.0
    assert cfg.precision.name == "32-true" and cfg.strategy.name == "fsdp"
    with torch.device("meta"):
        model = build_model("gpt", str(cfg.model.size), vocab_size=cfg.data.vocab_size,
                            seq_len=cfg.model.seq_len, dropout=0.0)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.05)


def test_random_data_is_seeded_and_the_same_for_every_strategy() -> None:
    from recipes.data import random_splits

    a, b = (random_splits(64, 8, 40, 0.1, seed=3) for _ in range(2))
    assert torch.equal(a.train.chunks, b.train.chunks) and len(a.val) == 4
    assert a.train[0]["input_ids"].max() < 64


# ------------------------------------------------------------------ DeepSpeed, where installed
def test_deepspeed_anchor_label_on_the_real_strategy() -> None:
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install -e '.[anchors]')")
    from recipes import anchors

    cfg = SimpleNamespace(strategy=SimpleNamespace(impl="deepspeed", stage=3, offload=False),
                          trainer=SimpleNamespace(accelerator="cpu"))
    module = SimpleNamespace(model=None)
    strategy = anchors.make_anchor_strategy(cfg, module)
    assert anchors.anchor_label(strategy) == ("deepspeed_stage_3", 3)
    assert module.adamw_class is torch.optim.AdamW

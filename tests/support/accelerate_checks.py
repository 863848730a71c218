"""What the Accelerate tests of both tiers share: the launched jobs (tests/worlds/
accelerate_launch.py runs them) and the checks of one ZeRO variant against plain Accelerate
DDP running the same loop. fp32, accumulation 2, clipping at 1.0 (engaged)."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from tests.worlds.accelerate_launch import CONF, Job, Outcome
from zero_strategy.accelerate import CONFIG_ENV

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
    # Each Linear (a stage-3 unit itself here) recomputed in backward, its input on disk.
    "zero3_checkpointed": ("zero3.yaml", [*SMALL_UNITS, "--zero-opt",
                                          "activation_checkpointing=[Linear]", "--zero-opt",
                                          "offload_activations=disk"]),
}
# The recipe's 2-layer GPT-2 (dropout 0.1) on a shuffled loader, one batch per step.
GPT2_STEPS, GPT2_SAVE_AT = 12, 6
GPT2 = ["--model", "gpt2", "--shuffle", "--steps", str(GPT2_STEPS), "--accum", "1",
        "--zero-opt", "unit_numel=5000", "--zero-opt", "param_persistence_threshold=100"]




def ddp_job(work: Path) -> Job:
    return Job("ddp", ["--mode", "ddp", *COMMON], work / "ddp")


def variant_jobs(work: Path, name: str, resume: bool) -> list[Job]:
    """A full run of one shipped plugin file that saves its state half-way, and (``resume``)
    the same run relaunched from that state."""
    plugin, overrides = VARIANTS[name]
    env, ckpt = {CONFIG_ENV: str(CONF / plugin)}, str(work / f"{name}-ckpt")
    jobs = [Job(name, [*COMMON, *overrides, "--save-at", str(SAVE_AT), "--save-dir", ckpt],
                work / name, env=env)]
    if resume:
        jobs.append(Job(f"{name}-resumed", [*COMMON, *overrides, "--resume", ckpt],
                        work / f"{name}-resumed", env=env, after=name))
    return jobs


def ok(outcome: Outcome, world: int = 2) -> list[dict]:
    assert outcome.returncode == 0, outcome.log[-4000:]
    assert [r["rank"] for r in outcome.ranks] == list(range(world)), outcome.log[-4000:]
    return outcome.ranks


def close(a: float, b: float, tol: float = TOL) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=1e-7)


def weights_rel(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    diff = sum((x - y) ** 2 for k in a for x, y in zip(a[k], b[k], strict=True))
    return math.sqrt(diff / sum(x * x for k in a for x in a[k]))




def assert_launched_distributed(outcome: Outcome) -> None:
    for r in ok(outcome):
        assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert r["device"].startswith("cpu") and r["mixed_precision"] == "no"
        assert r["unwrapped"] == "MLP", "unwrap_model must give the user's module"


def assert_overrides_reached_the_engine(outcome: Outcome, name: str) -> None:
    plugin, overrides = VARIANTS[name]
    expected = {**yaml.safe_load((CONF / plugin).read_text()),
                **{k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in overrides
                                                         if o != "--zero-opt")}}
    for r in ok(outcome):
        for key, value in expected.items():
            assert r["zero_config"][key] == value, f"{name}: {key}"
        assert r["zero_config"]["precision"] == "32-true"  # from mixed_precision 'no'


def assert_matches_ddp(ddp: Outcome, variant: Outcome, name: str) -> None:
    ref, got = ok(ddp), ok(variant)
    for rank, (a, b) in enumerate(zip(ref, got)):
        assert len(b["losses"]) == STEPS * ACCUM and len(b["norms"]) == STEPS
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
            assert close(x, y), f"{name} rank {rank} micro-batch {i}: loss {y} vs DDP {x}"
        for i, (x, y) in enumerate(zip(a["norms"], b["norms"], strict=True)):
            assert close(x, y), f"{name} rank {rank} step {i}: grad norm {y} vs DDP {x}"
        assert a["lrs"] == b["lrs"]
        final = [(i + 1) % ACCUM == 0 for i in range(STEPS * ACCUM)]
        assert [n > 0 for n in b["reduced"]] == final, "accumulate() must skip the reduction"
    assert min(ref[0]["norms"]) > CLIP, "clipping never engaged: parity would not cover it"
    assert ref[0]["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
    rel = weights_rel(ref[0]["weights"], got[0]["weights"])
    assert rel <= TOL, f"{name}: final weights differ from DDP's by {rel:.2e}"
    assert close(ref[0]["eval_loss"], got[0]["eval_loss"]), "no_grad evaluation after training"
    # optimizer.state_dict() on the prepared optimizer: torch's format, the same parameter
    # indices and keys as plain Accelerate's; each state's sum of |x| agrees to the elements' fp32
    # summation-order difference (steps exactly).
    theirs, ours = ref[0]["optimizer_state"], got[0]["optimizer_state"]
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        assert sorted(ours[index]) == sorted(entry), index
        for key, value in entry.items():
            assert close(ours[index][key], value), (index, key)


def assert_resume_equals_uninterrupted(full_run: Outcome, resumed: Outcome, name: str
                                        ) -> None:
    full, again = ok(full_run), ok(resumed)
    for rank, (a, b) in enumerate(zip(full, again)):
        assert b["start_step"] == SAVE_AT and b["steps"] == STEPS
        tail = a["losses"][SAVE_AT * ACCUM:]
        assert len(b["losses"]) == len(tail)
        for i, (x, y) in enumerate(zip(tail, b["losses"])):
            assert close(x, y), f"{name} rank {rank}: loss {i} after resume {y} vs {x}"
        for x, y in zip(a["norms"][SAVE_AT:], b["norms"], strict=True):
            assert close(x, y), f"{name} rank {rank}: grad norm after resume"
        assert a["lrs"][SAVE_AT:] == b["lrs"], "the scheduler and the optimizer's lr resume"
    rel = weights_rel(full[0]["weights"], again[0]["weights"])
    assert rel <= TOL, f"{name}: resumed final weights differ by {rel:.2e}"
    assert close(full[0]["eval_loss"], again[0]["eval_loss"])

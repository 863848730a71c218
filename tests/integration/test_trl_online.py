"""TRL's online trainers under ``with_zero``: GRPO (stages 2 and 3, CPU offload, streamed
generation with ``synced_gpus``, LoRA, ``sync_ref_model``, a reward model, TRL's default
bf16), RLOO and online DPO (``trl.experimental``) against the same trainer under plain
Trainer (DDP), two CPU processes, fp32 unless said, one torchrun launch
(tests/worlds/trl_online_run.py). Rewards are a python function: no reward model download.

Tolerance. Both runs draw the same samples (checked exactly: rewards, completion lengths and
the final state of the global torch generator are equal), so what differs is only the order
of a few fp32 sums (gradient buckets, the clipping norm from per-shard sums, stage 3's
gathered flat weights feeding the same matmuls): a few ulps (~1e-7 relative) per step that 3
AdamW steps grow to ~1e-6 at worst, so ``trainer_checks.RTOL`` (1e-5) holds with margin, as
for plain Trainer. Two quantities are differences of nearly equal numbers and are compared
on the scale of what is subtracted instead:
- the policy losses: a mean of advantage-weighted ratios (each ratio exactly 1 in value, on
  policy) which cancels to ~1e-9-1e-8 where every completion has the same length (GRPO's
  first step; RLOO's every step, pure rounding noise around 0) and is ~0.03-0.09 where
  token weighting leaves some of it (GRPO's later steps). Compared with RTOL relative to the
  losses themselves plus ``LOSS_FLOOR``, the rounding of that cancellation (below);
- the KL terms: exp(d) - d - 1 for d the difference of log-probabilities of size ~4, whose
  ulp is ~5e-7; an error e in d moves the KL by ~|d| e, far below 1e-6, the absolute slack
  used. Online DPO's ``rewards/margins`` is beta (0.1) times such differences of summed
  log-probabilities of size ~25 (ulp ~2e-6): a few ulps times beta stay under the same slack.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import trainer_checks as C

SCRIPT = Path(__file__).resolve().parents[1] / "worlds" / "trl_online_run.py"
GRPO_MODES = ["z2", "z3", "z3off", "z3stream"]
SCENARIOS = ["grpo_ddp", *(f"grpo_{m}" for m in GRPO_MODES), "grpo_lora_ddp", "grpo_lora_z3",
             "grpo_sync_ddp", "grpo_sync_z2", "grpo_sync_z3", "grpo_rm_ddp", "grpo_rm_z3",
             "grpo_bf16_ddp", "grpo_bf16_z3", "rloo_ddp", "rloo_z3", "odpo_ddp", "odpo_z2",
             "odpo_z3"]
# same samples: the same python rewards and completion lengths, exactly
EXACT = ("reward", "completions/mean_length", "objective/scores", "val/contain_eos_token")
KL = ("kl", "objective/kl", "rewards/margins")
KL_SLACK = 1e-6
# The cancellation's remainder, in fp32. Per rank a loss is a mean of at most 24 terms (4
# completions x 6 tokens; RLOO: 4 sequences) of size <= 1.5 (advantages normalised within a
# group of 4, or leave-one-out differences of rewards in [0, 1.5]), summed pairwise by torch:
# at most ceil(log2 24) = 5 roundings of 2**-24 (6e-8) relative on partial sums <= 24 x 1.5,
# 5 x 6e-8 x 36 / 24 = 4.5e-7 on the mean. Both runs sum in the same order but on inputs
# differing by ulps (RLOO's rewards carry beta x KL), so each may land anywhere within that:
# 9e-7 apart at most. The Trainer's mean over the 2 ranks adds half an ulp of the result,
# nothing at these sizes. Measured: GRPO's losses equal bit for bit, RLOO's 2.2e-8 apart at
# worst. A loss wrong by a part in 1e4 (3e-6 at GRPO's 0.03) now fails; 1.0 as the scale,
# as before, let anything under 1e-5 pass.
LOSS_FLOOR = 1e-6


def _assert_losses_close(ddp: list[float], zero: list[float], name: str) -> None:
    for i, (x, y) in enumerate(zip(ddp, zero, strict=True)):
        assert abs(x - y) <= C.RTOL * max(abs(x), abs(y)) + LOSS_FLOOR, (
            f"{name} loss[{i}]: {x} vs {y}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return C.launch(tmp_path_factory.mktemp("trl_online"), SCENARIOS, script=SCRIPT)


def _assert_parity(ddp: dict, zero: dict, name: str, weights: bool = True) -> None:
    ddp, zero = C.ok(ddp), C.ok(zero)
    assert zero["rng"] == ddp["rng"], f"{name}: generation consumed the RNG differently"
    C.assert_close_lists(ddp["grad_norm"], zero["grad_norm"], f"{name} grad_norm")
    _assert_losses_close(ddp["loss"], zero["loss"], name)
    for key in EXACT:
        if key in ddp:
            assert ddp[key] == zero[key], f"{name} {key}: {ddp[key]} vs {zero[key]}"
    for key in KL:
        if key in ddp:
            for i, (x, y) in enumerate(zip(ddp[key], zero[key], strict=True)):
                assert abs(x - y) <= C.RTOL * max(abs(x), abs(y)) + KL_SLACK, (name, key, i)
    if weights:
        diff = C.max_rel_diff(C.weights(ddp["final"]), C.weights(zero["final"]))
        assert diff <= C.RTOL, f"{name}: final weights differ from DDP's by {diff:.2e}"


@pytest.mark.parametrize("mode", GRPO_MODES)
def test_grpo_with_reference_model_matches_ddp(runs: dict, mode: str) -> None:
    _assert_parity(runs["grpo_ddp"], runs[f"grpo_{mode}"], f"grpo {mode}")
    assert max(runs["grpo_ddp"]["kl"]) > 0  # the reference model did take part
    assert runs[f"grpo_{mode}"]["models"] == 2  # the policy and TRL's reference


def _assert_reference_sharded(result: dict) -> None:
    """At stage 3 the reference model is a frozen engine holding 1/N of the weights per rank
    (the tiny model's flat units need no padding at N=2), with no gradient, no optimizer
    state and nothing trainable; under DDP each rank holds the whole model."""
    result = C.ok(result)
    assert result["ref"] == "ZeroFrozenModel", result
    assert result["ref_bytes_rank"] * result["world"] == result["model_bytes"], result
    assert result["ref_bytes_sum"] == result["model_bytes"], result
    assert (result["ref_states"], result["ref_grads_optimizer_bytes"],
            result["ref_trainable"]) == (0, 0, 0), result


@pytest.mark.parametrize("name", ["grpo_z3", "grpo_z3off", "grpo_z3stream", "rloo_z3",
                                  "odpo_z3"])
def test_reference_model_is_sharded_and_frozen_at_stage3(runs: dict, name: str) -> None:
    _assert_reference_sharded(runs[name])
    # GRPO and RLOO load it from the policy's folder: streamed into the shards (never whole
    # on a rank); online DPO copies the policy, which is whole until train() shards it.
    assert runs[name]["ref_streamed"] == (not name.startswith("odpo")), runs[name]


@pytest.mark.parametrize("name", ["grpo_ddp", "grpo_z2", "odpo_z2"])
def test_reference_model_is_whole_below_stage3(runs: dict, name: str) -> None:
    """As TRL's prepare_deepspeed does at stages 1-2: the parameters of every model are
    whole on each rank there, the reference's too."""
    result = C.ok(runs[name])
    assert result["ref"] == "GPT2LMHeadModel"
    assert result["ref_bytes_rank"] == result["model_bytes"], result


def test_rloo_matches_ddp(runs: dict) -> None:
    _assert_parity(runs["rloo_ddp"], runs["rloo_z3"], "rloo z3")


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_online_dpo_matches_ddp(runs: dict, mode: str) -> None:
    _assert_parity(runs["odpo_ddp"], runs[f"odpo_{mode}"], f"online dpo {mode}")


def test_grpo_lora_uses_the_base_as_reference_without_a_copy(runs: dict) -> None:
    """LoRA: the reference is the base with the adapter disabled (TRL creates no reference
    model); the run matches DDP's, only the adapter is saved, one GPT-2 is built,
    and at stage 3 the policy, frozen base included, is held 1/N per rank. Models built during
    the run are counted by GPT-2's constructor: the policy alone (with a reference: two)."""
    ddp, z3 = C.ok(runs["grpo_lora_ddp"]), C.ok(runs["grpo_lora_z3"])
    _assert_parity(ddp, z3, "grpo lora z3", weights=False)
    assert max(ddp["kl"]) > 0
    for result in (ddp, z3):
        assert result["ref"] is None and result["models"] == 1, result
        assert result["adapter_only"], result
    assert z3["policy_bytes_sum"] == 4 * z3["policy_numel"], z3  # fp32, no padding at N=2
    assert z3["policy_bytes_rank"] * 2 == z3["policy_bytes_sum"], z3
    _assert_same_adapter(Path(ddp["final"]), Path(z3["final"]))


def _assert_same_adapter(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    x, y = (load_file(p / "adapter_model.safetensors") for p in (a, b))
    assert x.keys() == y.keys() and x
    for key in x:
        scale = max(x[key].abs().max().item(), y[key].abs().max().item(), 1e-12)
        diff = (x[key].double() - y[key].double()).abs().max().item() / scale
        assert diff <= C.RTOL, (key, diff)
    assert any(v.abs().sum() > 0 for k, v in y.items() if "lora_B" in k)  # it trained


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_sync_ref_model_matches_ddp(runs: dict, mode: str) -> None:
    """TRL's sync_ref_model, every step with alpha 0.5: at stage 3 each pair of parameters is
    gathered (the reference's writable) and mixed; the KL against the synced reference, the
    losses and the weights follow DDP's. The sync moved the reference: its KL differs from
    the unsynced run's."""
    _assert_parity(runs["grpo_sync_ddp"], runs[f"grpo_sync_{mode}"], f"grpo sync {mode}")
    synced, unsynced = C.ok(runs["grpo_sync_ddp"])["kl"], C.ok(runs["grpo_ddp"])["kl"]
    assert synced[2] != pytest.approx(unsynced[2], rel=1e-3), (synced, unsynced)


def test_grpo_reward_model_is_sharded_and_scores_as_under_ddp(runs: dict) -> None:
    """A reward *model* (a sequence-classification GPT-2 built in code) beside the python
    reward: TRL prepares it for evaluation as the reference, so at stage 3 it is a frozen
    engine holding half of it per rank; its scores (in the summed reward) equal DDP's within
    the same fp32 bound."""
    ddp, z3 = C.ok(runs["grpo_rm_ddp"]), C.ok(runs["grpo_rm_z3"])
    rm = z3["reward_model"]
    assert rm["type"] == "ZeroFrozenModel" and rm["bytes_rank"] * 2 == rm["whole"], rm
    assert ddp["reward_model"]["bytes_rank"] == ddp["reward_model"]["whole"], ddp
    C.assert_close_lists(ddp["reward"], z3["reward"], "reward with a reward model")
    assert ddp["rng"] == z3["rng"]
    for key in ("loss", "grad_norm"):
        C.assert_close_lists(ddp[key], z3[key], f"rm {key}", rtol=C.RTOL)


def test_same_samples_as_ddp(runs: dict) -> None:
    """The determinism the parity rests on, stated on its own: every ZeRO run generated what
    DDP generated (same rewards) and left the global generator where DDP left it."""
    for name, key in (("grpo_z3", "reward"), ("grpo_z3stream", "reward"),
                      ("rloo_z3", "reward"), ("odpo_z3", "objective/scores")):
        ddp = C.ok(runs[name.split("_")[0] + "_ddp"])
        zero = C.ok(runs[name])
        assert zero[key] == ddp[key] and zero["rng"] == ddp["rng"], name
    assert torch.tensor(C.ok(runs["grpo_ddp"])["reward"]).std() > 0  # samples differ per step
    # The state tracks what was drawn: online DPO samples other shapes than GRPO, same seed.
    assert C.ok(runs["grpo_ddp"])["rng"] != C.ok(runs["odpo_ddp"])["rng"]


def test_grpo_with_trls_default_bf16_matches_ddp(runs: dict) -> None:
    """TRL's default bf16=True: autocast over fp32 weights under DDP, "bf16-autocast" under
    the engine, the frozen reference's forward included (its shards fp32: half the model's
    fp32 bytes per rank). Same samples and generator state; KL and losses at the fp32 bounds
    (equal here: the reference sees the same weights and the same autocast). Gradient norms
    within 1e-4: from step 2 the weights differ by fp32 ulps (reduction order), and where
    that crosses a bf16 rounding boundary an activation moves by 2^-8 relative; over the
    ~28k gradient elements such flips stay near 1e-5 of the norm (measured 5e-6). Weights are
    not compared: Adam turns a flip in a near-zero gradient into an lr-sized step either way
    (measured 8e-4 relative), which the fp32 runs above bound instead."""
    ddp, z3 = C.ok(runs["grpo_bf16_ddp"]), C.ok(runs["grpo_bf16_z3"])
    assert z3["rng"] == ddp["rng"] and z3["reward"] == ddp["reward"]
    C.assert_close_lists(ddp["grad_norm"], z3["grad_norm"], "bf16 grad_norm", rtol=1e-4)
    _assert_losses_close(ddp["loss"], z3["loss"], "bf16")
    for i, (x, y) in enumerate(zip(ddp["kl"], z3["kl"], strict=True)):
        assert abs(x - y) <= C.RTOL * max(abs(x), abs(y)) + KL_SLACK, (i, x, y)
    assert ddp["kl"] != C.ok(runs["grpo_ddp"])["kl"]  # autocast did change the arithmetic
    _assert_reference_sharded(z3)

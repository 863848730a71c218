"""The engine's consolidated weights, losses and gradient norms against DDP's, shared by the
parity tests of every tier (the scenarios: tests/worlds/scenarios_engine.py)."""

from __future__ import annotations

import pytest
import torch

TOL = 1e-5  # fp32: only summation order differs from DDP (bucketed all-reduce, shard norms)


def assert_parity(results: list[dict], clip: float = 0.05) -> None:
    for rank, r in enumerate(results):
        assert r["keys"] and r["shapes"], f"rank {rank}: state dict keys/shapes differ from DDP's"
        assert r["dtypes"] == ["torch.float32"]
        assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
        assert r["rel"] <= TOL, f"rank {rank}: consolidated params differ by {r['rel']:.2e}"
        # Elements whose AdamW denominator fell to the eps scale (GPT-2's key bias, whose true
        # gradient is zero, and elements whose ranks' gradients cancel) turn rounding-level
        # gradient differences into weight differences of up to TOL * gain: compared relative
        # to max|w| + gain, argued in tests/worlds/scenarios_engine.py's AdamWGain.
        assert r["rel_eps_bound"] <= TOL, \
            f"rank {rank}: eps-bound elements differ by {r['rel_eps_bound']:.2e} of max|w| + gain"
        for step, (a, b) in enumerate(zip(r["loss"], r["ref_loss"])):
            assert a == pytest.approx(b, rel=TOL, abs=1e-7), f"rank {rank} step {step} loss"
        for step, (a, b) in enumerate(zip(r["norm"], r["ref_norm"])):
            assert a == pytest.approx(b, rel=TOL), f"rank {rank} step {step} grad norm"
        assert max(r["ref_norm"]) > clip, "clipping never engaged: the test would not cover it"
    assert results[0]["rel"] == results[-1]["rel"], "ranks disagree on consolidated weights"


# fp32: the reference sums the ranks' losses before one backward, the engine averages the
# ranks' gradients in a reduce-scatter/all-reduce; each step's gradients then differ by a few
# ulps (N * 2^-24 ~ 1e-7 relative). AdamW's normalised update passes such relative errors
# through about unchanged, so after 3-6 steps of lr 0.02 the weights agree to ~1e-6; 1e-5
# leaves a margin of 10 while any real divergence (a missed or doubled gradient, a skipped
# or extra update) moves weights by ~lr = 2e-2.
MODEL_CODE_TOL = 1e-5


def assert_global_batch_parity(results: list[dict]) -> None:
    """The engine against one process training on the global batch (user model code,
    tests/worlds/scenarios_model_code.py)."""
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-3, "training did not move the weights: parity would be vacuous"
        assert r["rel"] <= MODEL_CODE_TOL, \
            f"rank {rank}: weights differ from the reference by {r['rel']:.2e}"
        for step, (a, b) in enumerate(zip(r["loss"], r["ref_loss"])):
            assert a == pytest.approx(b, rel=MODEL_CODE_TOL, abs=1e-7), \
                f"rank {rank} step {step} loss"


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
             adam: AdamWGain | None = None, eps_bound: bool = False) -> float:
    """Largest |a - b| of any element, relative to its tensor's largest |b|.

    With ``adam``, the elements AdamW was eps-bound on are left out, or with ``eps_bound=True``
    only they are compared, each relative to its tensor's largest |b| plus its AdamW gain (see
    AdamWGain for why).
    """
    worst = 0.0
    for k in b:
        diff = (a[k].double() - b[k].double()).abs()
        scale = b[k].double().abs().max().clamp_min(1e-12).expand_as(diff)
        if adam is not None and k in adam.bound:
            bound = adam.bound[k] if eps_bound else ~adam.bound[k]
            diff, scale = diff[bound], scale[bound] + (adam.gain[k][bound] if eps_bound else 0)
        elif eps_bound:
            continue
        if diff.numel():
            worst = max(worst, (diff / scale).max().item())
    return worst


EPS_BOUND = 10.0  # AdamW denominators below this many eps: the element's gradient was ~eps


class AdamWGain:
    """Per element, what the reference's AdamW made of its gradients (recorded after each step).

    Why weights trained with AdamW get a per-element bound: the engine's gradients equal DDP's
    up to rounding, but AdamW's step lr * m_hat / (sqrt(v_hat) + eps) divides each element by
    its own gradient scale, so an element with a tiny gradient turns a rounding-level
    difference into a weight difference. To first order, a gradient difference d in every
    step shifts m_hat by d and so each step's weight change by lr * d / (sqrt(v_hat_t) + eps).
    Gradients that agree to TOL of their tensor's largest element G_t (the tolerance the tests
    assert for the gradient norm) thus allow a weight difference of TOL * gain, with
    ``gain = sum_t lr * G_t / (sqrt(v_hat_t) + eps)``.

    Measured (transformers 5.23, torch 2.13): at N=2 the reduced gradients are bit-identical
    to DDP's (DDP multiplies by 1/2 before summing two ranks, the engine divides the sum: both
    exact); only the clipping factor differs, and AdamW is invariant to scaling. At N=3, 1/3
    is inexact, the first step leaves the weights a few ulps apart and from step 2 each rank's
    gradient differs by ~1e-6 of its tensor's largest. In h.0.attn.c_attn.weight[31, 70] (a
    value weight) the three ranks' step-2 gradients +6.1e-4, -3.1e-4, -3.2e-4 cancel to an
    average of -1.0e-5, clipped (x0.104) to -1.05e-6 +- 4.4e-10; its denominator was
    2.45e-6 = 2.45 eps, so that step moved it lr * 0.53 * 4.4e-10 / 2.45e-6 = 0.95e-6 away
    from DDP's (0.53: m_hat's bias correction at step 2); after six steps 1.1e-6 to 1.2e-6,
    1.05e-5 to 1.18e-5 of the tensor's largest weight (0.102) depending on the stage: over
    TOL. Its gain is 4.5, so TOL * (0.102 + 4.5) bounds it 38 times over.

    So elements whose denominator stays above EPS_BOUND * eps are still compared at TOL of
    their tensor's largest weight (measured at most 0.3 of that, N=3); those whose
    denominator fell below it at some step, i.e. whose gradient was at AdamW's eps scale, at
    TOL of max|w| + gain. They include GPT-2's attention key bias (the key part of
    c_attn.bias): softmax is shift-invariant, so its true gradient is exactly zero, what
    arrives is rounding noise (~1e-13) and its denominator is eps itself. Their bound is
    loose where the tensor's other elements have far larger gradients (the key bias and the
    query/key weights of the fused c_attn: gain 8 to 19, bound ~1e-4 against 1e-8 to 1e-7
    measured): that is what AdamW's arithmetic allows there, and still 600 times tighter than
    lr * steps (0.06), six full AdamW steps.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):  # tied: every name
            self._names.setdefault(id(p), []).append(name)
        self.gain: dict[str, torch.Tensor] = {}
        self.bound: dict[str, torch.Tensor] = {}
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if p.grad is None or "exp_avg_sq" not in state:  # not Adam-type, or no grad
                    continue
                correction = 1 - group["betas"][1] ** float(state["step"])
                den = (state["exp_avg_sq"].double() / correction).sqrt() + group["eps"]
                gain = group["lr"] * p.grad.double().abs().max() / den
                bound = den < EPS_BOUND * group["eps"]
                for name in self._names[id(p)]:
                    self.gain[name] = self.gain.get(name, 0) + gain
                    self.bound[name] = self.bound.get(name, torch.zeros_like(bound)) | bound

"""The engine's gradient norm (``core/grads.py: powered_norm``, used by clipping, the logged
``grad_norm`` and the disk tier's summaries) against a float64 reference on long fp32
vectors, the size of a flat shard. Regression: ``torch.linalg.vector_norm`` over one long
fp32 vector was used before and drifted by 3.8e-6 relative (squared) at 62k elements and
8.6e-5 at 1M (tests/integration/test_moe_training.py's stage-2 Qwen3-MoE run failed its
1e-5 weight bound through the clipping factor)."""

from __future__ import annotations

import pytest
import torch

from zero_strategy.core.grads import NORM_ROW, SCALED_ROWS, max_abs, powered_norm


@pytest.mark.parametrize("n", [1, NORM_ROW - 1, NORM_ROW, 62_176, 1_000_003])
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
def test_powered_norm_is_accurate_on_long_vectors(n: int, p: float) -> None:
    g = torch.Generator().manual_seed(n)
    # Magnitudes over several decades, as gradients have.
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
    truth = x.double().abs().pow(p).sum().item()
    got = powered_norm(x, p)
    assert got.dtype == torch.float32 and got.dim() == 0
    # Pairwise sums of fp32 values: a few ulps of the result (2^-24 ~ 6e-8 each); measured
    # under 6e-8 for p=2; 1e-6 leaves room for p=3's larger dynamic range while the old
    # single-vector norm (8.6e-5 at 1M) fails it by far.
    assert abs(got.item() - truth) <= 1e-6 * truth, (got.item(), truth)


def test_powered_norm_reads_views_and_shapes() -> None:
    x = torch.randn(3, 2000)
    assert torch.equal(powered_norm(x[:, :1500], 2.0), powered_norm(x[:, :1500].contiguous(), 2.0))


@pytest.mark.parametrize("rows", [0, 1, SCALED_ROWS, 3 * SCALED_ROWS + 1])
@pytest.mark.parametrize("factor", [2.0**-16, 1 / 1000.0, 3.0])
def test_the_norm_and_max_abs_of_a_product_are_those_of_the_product(rows: int,
                                                                    factor: float) -> None:
    """The disk tier summarises ``grad * factor`` (the fp16 unscale) at reduction without
    materialising it: its squared norm and max-abs must be bit for bit those of the product
    taken whole, which the host tier computes after ``grad.mul_(factor)`` (a block of rows
    left alone at the end, and magnitudes whose squares are subnormal, included)."""
    g = torch.Generator().manual_seed(rows)
    n = rows * NORM_ROW + 517
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 4, (n,), generator=g)
    f = torch.tensor(factor, dtype=torch.float32)
    whole = x.clone().mul_(factor)
    assert torch.equal(powered_norm(x, 2.0, factor=f), powered_norm(whole, 2.0))
    assert torch.equal(max_abs([x])[0] * f, max_abs([whole])[0])
    x[n // 2] = float("nan")
    assert max_abs([x])[0].isnan() and (max_abs([x])[0] * f).isnan()

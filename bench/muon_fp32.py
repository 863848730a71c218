"""torch's Muon with its Newton-Schulz iteration in fp32 instead of bf16.

Two uses: on a CPU without bf16 units a bf16 matmul is ~80x slower than an fp32 one, so the
Muon benchmark runs every system's orthogonalisation in fp32 (``bench/muon_bench.py``); and a
test of an adapter's wiring (which optimizer stepped, with which lr) compares against
single-process training, where bf16 orthogonalisation would turn a last-bit difference of a
gradient (fp32 ops grouped differently over flat shards) into a bf16-sized one.
"""

from __future__ import annotations

from typing import Any

import torch


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float],
                       ns_steps: int, eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration with fp32 matmuls (torch's casts to bf16)."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def use_fp32_newton_schulz() -> None:
    """Every Muon of this process orthogonalises in fp32 from now on."""
    import torch.optim._muon as muon_impl
    muon_impl._zeropower_via_newtonschulz = newton_schulz_fp32


class Fp32Muon(torch.optim.Muon):
    """``torch.optim.Muon`` orthogonalising in fp32 during its own steps only (other Muon
    instances of the process are left as they are). Not elementwise, so the engine places it
    on owners exactly like torch's Muon."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        import torch.optim._muon as muon_impl
        original = muon_impl._zeropower_via_newtonschulz
        muon_impl._zeropower_via_newtonschulz = newton_schulz_fp32
        try:
            return super().step(closure)
        finally:
            muon_impl._zeropower_via_newtonschulz = original

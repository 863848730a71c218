"""Dtypes of each copy of the model state (and of what the collectives send), input casts,
the forward's autocast, and the dynamic loss scaler."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..config import LOSS_SCALED_PRECISIONS, MAX_LOSS_SCALE, LossScaleConfig, ZeroConfig


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each copy of the model state has under a precision name."""

    name: str
    compute_dtype: torch.dtype
    """Parameters as the forward sees them (and as stage 3 gathers them)."""
    master_dtype: torch.dtype
    """The optimizer's copy of this rank's shard."""
    reduce_dtype: torch.dtype
    """Gradients as they are communicated."""
    scales_loss: bool
    """fp16 needs loss scaling to keep small gradients representable."""
    int8_gathers: bool = False
    """Stage-3 parameter all-gathers go over the wire as block-wise int8 (``comm/int8.py``)."""
    int8_reductions: bool = False
    """Gradient reduce-scatters go over the wire as block-wise int8."""
    autocast_dtype: torch.dtype | None = None
    """The "-autocast" modes: the forward runs under ``torch.autocast`` in this dtype over
    the (fp32) compute copy, as transformers' Trainer and Accelerate run mixed precision."""

    @property
    def separate_master(self) -> bool:
        """Mixed modes keep an fp32 master apart from the low-precision compute copy."""
        return self.master_dtype != self.compute_dtype

    @property
    def param_bytes(self) -> int:
        return _itemsize(self.compute_dtype)

    @property
    def grad_bytes(self) -> int:
        return _itemsize(self.compute_dtype)

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Floating-point inputs follow the parameters' dtype, so user code needs no casts."""
        if self.compute_dtype == torch.float32:
            return args, kwargs

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
                return x.to(self.compute_dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def forward_context(self, device: torch.device) -> Callable[[], Any]:
        """What the engine's forward runs inside on ``device``, chosen once per engine: a
        fresh autocast for the "-autocast" modes (around the module's forward only, where
        Accelerate puts it: backward and the optimizer run outside), else nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, device_type=device.type,
                                 dtype=self.autocast_dtype)


_COMPUTE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    # autocast casts per op from fp32 weights: the copy the engine keeps and gathers is fp32
    "bf16-autocast": torch.float32,
    "16-autocast": torch.float32,
}
_AUTOCAST = {"bf16-autocast": torch.bfloat16, "16-autocast": torch.float16}


def make_policy(config: ZeroConfig) -> PrecisionPolicy:
    compute = _COMPUTE[config.precision]
    # "-true" means the whole state is in that dtype, as in Lightning: no fp32 master.
    master = compute if config.precision.endswith("-true") else torch.float32
    reduce = torch.float32 if config.reduce_dtype == "fp32" else compute
    return PrecisionPolicy(
        name=config.precision,
        compute_dtype=compute,
        master_dtype=master,
        reduce_dtype=reduce,
        scales_loss=config.precision in LOSS_SCALED_PRECISIONS,
        int8_gathers=config.quantize_weights == "int8",
        int8_reductions=config.quantize_gradients == "int8",
        autocast_dtype=_AUTOCAST.get(config.precision),
    )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class LossScaler:
    """Dynamic loss scale for fp16 with growth interval, hysteresis and a floor.

    Overflow bookkeeping follows DeepSpeed's meaning of the knobs: with ``hysteresis=h`` the
    h-th overflow since the last growth halves the scale; earlier ones only skip the step.
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.static_scale or config.initial_scale)
        self.good_steps = 0
        self.hysteresis_left = config.hysteresis
        self.skipped_steps = 0

    @property
    def dynamic(self) -> bool:
        return self.config.static_scale is None

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.config.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.config.growth_interval == 0:
            self.scale = min(self.scale * 2.0, MAX_LOSS_SCALE)
            self.hysteresis_left = self.config.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])

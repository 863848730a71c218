"""ZeroConfig validation: every bad value fails at construction, naming the field."""

from __future__ import annotations

import pytest

import zero_strategy as zs
from zero_strategy.config import STAGE3_DEFAULTS


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"stage": 4}, "stage", "(0, 1, 2, 3)"),
        ({"stage": -1}, "stage", "(0, 1, 2, 3)"),
        ({"stage": "3"}, "stage", "(0, 1, 2, 3)"),
        ({"stage": True}, "stage", "(0, 1, 2, 3)"),
        ({"precision": "64-true"}, "precision", "32-true"),
        ({"precision": "fp16"}, "precision", "16-mixed"),
        ({"reduce_dtype": "fp8"}, "reduce_dtype", "fp32"),
        ({"bucket_numel": 0}, "bucket_numel", "positive int"),
        ({"bucket_numel": -5}, "bucket_numel", "positive int"),
        ({"bucket_numel": 1.5}, "bucket_numel", "positive int"),
        ({"stage": 3, "unit_numel": 0}, "unit_numel", "positive int"),
        ({"stage": 3, "param_persistence_threshold": -1}, "param_persistence_threshold", ">= 0"),
        ({"stage": 2, "unit_numel": 10}, "unit_numel", "stage 3 only"),
        ({"stage": 1, "prefetch": True}, "prefetch", "stage 3 only"),
        ({"stage": 2, "param_persistence_threshold": 5}, "param_persistence_threshold", "stage 3"),
        ({"stage": 2, "offload_params": True}, "offload_params", "stage=3"),
        ({"stage": 0, "offload_optimizer": True}, "offload_optimizer", "stage >= 1"),
        ({"offload_optimizer": "yes"}, "offload_optimizer", "'cpu' or 'disk'"),
        ({"stage": 3, "offload_params": "nvme"}, "offload_params", "'cpu' or 'disk'"),
        ({"stage": 3, "offload_params": "disk"}, "offload_params='disk'",
         "offload_optimizer='disk'"),
        ({"stage": 3, "offload_params": "disk", "offload_optimizer": True},
         "offload_params='disk'", "offload_optimizer='disk'"),
        ({"stage": 1, "offload_optimizer": "disk"}, "offload_optimizer='disk'", "stage 2 or 3"),
        ({"stage": 2, "offload_params": "disk", "offload_optimizer": "disk"}, "offload_params",
         "stage=3"),
        ({"stage": 2, "offload_dir": "/tmp/x"}, "offload_dir", "offload_optimizer='disk'"),
        ({"stage": 2, "offload_optimizer": "disk", "offload_dir": ""}, "offload_dir",
         "directory path"),
        ({"stage": 2, "disk_staging_bytes": 1 << 20}, "disk_staging_bytes",
         "offload_optimizer='disk'"),
        ({"stage": 2, "offload_optimizer": "disk", "disk_staging_bytes": 4096},
         "disk_staging_bytes", ">= 16384"),
        ({"stage": 2, "offload_optimizer": "disk", "disk_staging_bytes": True},
         "disk_staging_bytes", "an int"),
        ({"overlap_param_gather": 1}, "overlap_param_gather", "True or False"),
        ({"stage": 2, "shard_group_size": 0}, "shard_group_size", "positive int"),
        ({"stage": 0, "shard_group_size": 2}, "shard_group_size", "stage >= 1"),
        ({"stage": 3, "quantize_weights": "int4"}, "quantize_weights", "'off', 'int8'"),
        ({"stage": 2, "quantize_weights": "int8"}, "quantize_weights", "stage=3"),
        ({"stage": 3, "generation_gather_budget": -1}, "generation_gather_budget",
         "bytes >= 0"),
        ({"stage": 2, "generation_gather_budget": 1 << 20}, "generation_gather_budget",
         "stage 3"),
        ({"stage": 2, "quantize_gradients": True}, "quantize_gradients", "'off', 'int8'"),
        ({"stage": 0, "quantize_gradients": "int8"}, "quantize_gradients", "stage >= 1"),
        ({"loss_scale": {"initial_scale": 1000.0}, "precision": "16-mixed"},
         "loss_scale.initial_scale", "power of two"),
        ({"loss_scale": {"initial_scale": -2.0}, "precision": "16-mixed"},
         "loss_scale.initial_scale", "power of two"),
        ({"loss_scale": {"hysteresis": 0}, "precision": "16-mixed"}, "loss_scale.hysteresis", ""),
        ({"loss_scale": {"static_scale": -1.0}, "precision": "16-mixed"},
         "loss_scale.static_scale", "(0, 2**64]"),
        ({"loss_scale": {"min_scale": 0}, "precision": "16-mixed"}, "loss_scale.min_scale",
         "(0, 2**64]"),
        ({"loss_scale": {"growth_interval": 10}}, "loss_scale", "16-mixed"),
    ],
)
def test_invalid_config_names_field(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as err:
        zs.ZeroConfig(**kwargs)
    assert field in str(err.value) and allowed in str(err.value)


def test_frozen_and_defaults() -> None:
    cfg = zs.ZeroConfig(stage=3)
    with pytest.raises(AttributeError):
        cfg.stage = 2  # type: ignore[misc]
    assert cfg.resolved("unit_numel") == STAGE3_DEFAULTS["unit_numel"]
    assert zs.ZeroConfig(stage=3, prefetch=False).resolved("prefetch") is False
    assert zs.ZeroConfig(stage=2).resolved("prefetch") is None
    assert cfg.replace(stage=1).stage == 1
    with pytest.raises(ValueError, match="stage"):
        cfg.replace(stage=7)


def test_from_dict_rejects_unknown_keys_naming_source() -> None:
    with pytest.raises(ValueError, match=r"plugin.yaml: unknown ZeroConfig key\(s\) \['stag'\]"):
        zs.ZeroConfig.from_dict({"stag": 3}, source="plugin.yaml")
    cfg = zs.ZeroConfig.from_dict({"stage": 2, "precision": "16-mixed",
                                   "loss_scale": {"initial_scale": 1024.0}})
    assert cfg.loss_scale.initial_scale == 1024.0
    assert zs.ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_engine_before_process_group_is_a_clear_error() -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        zs.ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zs.ZeroConfig())


def test_the_gather_order_check_is_on_off_or_blocking() -> None:
    assert zs.ZeroConfig(stage=3, check_gather_order="blocking").resolved(
        "check_gather_order") == "blocking"
    assert zs.ZeroConfig(stage=3).resolved("check_gather_order") is True
    with pytest.raises(ValueError, match=r"check_gather_order must be True, False, 'blocking' "
                                         r"or None, got 'deferred'"):
        zs.ZeroConfig(stage=3, check_gather_order="deferred")

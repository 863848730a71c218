"""Sharded init (meta device, materialised unit by unit) gives the weights of eager construction
under the same seed, and leaves the generator where eager construction leaves it.

Through the engine: tests/worlds/scenarios_init.py (one rank). Through Lightning's
``configure_model`` and Fabric's ``init_module(empty_init=True)`` against DDP:
tests/worlds/lightning_init_scenarios.py, inside the processes tests/worlds/lightning_run.py shares
with tests/quick/test_lightning.py. The cases that differ, as the README states them, are pinned
down here too.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.harness import check, run_world
from tests.support.init_models import Net
from tests.worlds.lightning_launch import check as check_launched
from tests.worlds.lightning_launch import suite_results
from zero_strategy.core.materialize import Materializer, meta_init

CPU = torch.device("cpu")
TOL = 1e-5  # fp32: only summation order differs from DDP after the first step


@pytest.fixture(scope="module")
def engine_runs() -> dict[str, list[Any]]:
    return run_world("tests/worlds/scenarios_init.py", 1)


@pytest.fixture(scope="module")
def suite() -> dict[str, list[Any]]:
    return suite_results()


def materialize(model: nn.Module, init_fn: Any = None, children_first: bool = True) -> None:
    """What the engine does, without a process group: stage-3 units come children first."""
    m = Materializer(model, CPU, init_fn)
    if children_first:
        for module in reversed(list(model.modules())):
            m.ensure(module.parameters(recurse=False))
    m.finish()


def unequal(a: nn.Module, b: nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


# ---------------------------------------------------------------------- through the engine
def test_engine_meta_init_equals_eager(engine_runs: dict) -> None:
    """Nested Linear / Embedding / LayerNorm, modules creating their own parameters before
    and after their children, a tied head: bit-equal, and the generator (the next draws)
    the same as after eager construction."""
    r = check(engine_runs["engine_meta_init"])[0]
    assert len(r["keys"]) == 16 and r["differ"] == []
    assert r["rng_equal"] and r["draws_equal"]
    assert r["units"] > 5, "a few big units: the materialisation order would not be tested"
    assert r["materialize_order"] != r["replay_order"], "materialised in construction order"
    assert sorted(r["materialize_order"]) == sorted(r["replay_order"])
    assert r["replay_order"].index("blocks.1.inner.1") < r["replay_order"].index("blocks.1")


def test_engine_meta_init_default_config_equals_eager(engine_runs: dict) -> None:
    r = check(engine_runs["engine_meta_init_default_config"])[0]
    assert r["differ"] == [] and r["rng_equal"] and r["draws_equal"]
    assert r["materialize_order"] != r["replay_order"]


def test_engine_plain_meta_torch_modules_equal_eager(engine_runs: dict) -> None:
    """Built under a bare ``torch.device("meta")``: replayed in ``modules()`` order, which is
    construction order for torch.nn modules nested in Sequential / ModuleList."""
    r = check(engine_runs["engine_plain_meta_torch_modules"])[0]
    assert len(r["keys"]) == 9 and r["differ"] == []
    assert r["rng_equal"] and r["draws_equal"]


def test_engine_plain_meta_custom_modules_differ_as_documented(engine_runs: dict) -> None:
    """Without meta_init the construction order is unknown: modules that create or initialise
    their own parameters after their children are replayed too early (README)."""
    r = check(engine_runs["engine_plain_meta_custom_modules"])[0]
    assert "blocks.0.gate" in r["differ"] and "blocks.1.scale" in r["differ"]
    assert "emb.weight" not in r["differ"], "modules before the first reordering still equal"
    assert r["rng_equal"], "the generator still advances by the whole model's draws"


# ---------------------------------------------------------------------- Lightning and Fabric
@pytest.mark.parametrize("name", ["init_lightning_zero3", "init_fabric_zero3"])
def test_sharded_init_starts_from_ddp_weights(suite: dict, name: str) -> None:
    """configure_model / init_module(empty_init=True) at stage 3 (built on meta, every module
    its own unit) against the same code under DDP (built eagerly): same initial weights, same
    generator state afterwards (the model's dropout makes every loss depend on it)."""
    for rank, r in enumerate(check_launched(suite[name])):
        assert r["on_meta"] and not r["ref_on_meta"], "the sharded run did not build on meta"
        assert r["differ"] == [], f"rank {rank}: initial weights differ: {r['differ']}"
        assert r["rng_equal"], f"rank {rank}: generator state differs after construction"
        assert r["loss"][0] == r["ref_loss"][0], f"rank {rank}: first loss differs"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=TOL)


def test_lightning_replays_in_construction_order_then_materialises(suite: dict) -> None:
    calls = check_launched(suite["init_lightning_zero3"])[0]["init_calls"]
    replay, real = calls[: len(calls) // 2], calls[len(calls) // 2:]
    assert replay[:3] == ["Embedding", "Linear", "Gated"]  # Gated's gate follows its child
    assert real != replay and sorted(real) == sorted(replay)


# ---------------------------------------------------------------------- in this process
def test_nested_context_records_once_and_hooks_are_removed() -> None:
    from torch.nn.modules import module as torch_module

    hooks = (len(torch_module._global_parameter_registration_hooks),
             len(torch_module._global_buffer_registration_hooks))
    torch.manual_seed(0)
    eager = Net()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_init():
        with meta_init():  # trainer.init_module() inside configure_model
            model = Net()
    assert hooks == (len(torch_module._global_parameter_registration_hooks),
                     len(torch_module._global_buffer_registration_hooks))
    assert torch.equal(torch.get_rng_state(), after)
    materialize(model)
    assert unequal(model, eager) == []
    assert torch.equal(torch.get_rng_state(), after)


def test_error_in_block_changes_nothing() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"), meta_init():
        Net()
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before)
    with meta_init():  # usable again
        assert Net().emb.weight.is_meta


class ResetsChildren(nn.Module):
    """Draws its children's weights again after they initialised (nn.Transformer does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        for p in self.parameters():
            nn.init.normal_(p)


def init_mha(module: nn.Module) -> None:
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()  # also zeroes out_proj.bias: another module's tensor
    else:
        module.reset_parameters()


@pytest.mark.parametrize("build, init_fn, match", [
    (ResetsChildren, None, "Linear were randomly initialised again"),
    (lambda: nn.MultiheadAttention(8, 2), init_mha, "MultiheadAttention writes to another"),
])
def test_constructions_that_cannot_be_replayed_warn(build: Any, init_fn: Any, match: str) -> None:
    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=match), meta_init(init_fn=init_fn):
        model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Parents first: a parent's write into its child's tensor is then overwritten by the
        # child's own init (children first, it lands only if both share a unit).
        materialize(model, init_fn, children_first=False)
    assert unequal(model, eager), "the warned-about case happens to be equal: fix the warning"


def test_modules_not_built_in_meta_init_warn() -> None:
    """nn.TransformerEncoder deep-copies its layer: the copies were never seen being built."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the MultiheadAttention warning of the test above
        with meta_init(init_fn=init_mha):
            layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=8)
            encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            model = nn.Sequential(nn.Linear(8, 8), encoder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Materializer(model, CPU, init_mha)
    assert any("not seen being built in meta_init" in str(w.message) for w in caught), caught


def test_transformers_init_weights_differs_as_documented() -> None:
    """A transformers model draws in its constructors (torch defaults), then again in
    post_init (``_init_weights``); on meta neither runs, and ``param_init_fn=_init_weights``
    replays only the second, so the random tensors differ from eager construction (same
    distribution); constant ones (biases, LayerNorm) are equal. Reproducible run to run."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                     bos_token_id=0, eos_token_id=0)

    def sharded() -> nn.Module:
        holder: dict[str, Any] = {}

        def init(module: nn.Module) -> None:
            holder["model"]._init_weights(module)

        torch.manual_seed(0)
        with meta_init(init_fn=init):
            holder["model"] = GPT2LMHeadModel(cfg)
        materialize(holder["model"], init)
        return holder["model"]

    torch.manual_seed(0)
    eager = GPT2LMHeadModel(cfg)
    first, second = sharded(), sharded()
    assert unequal(first, second) == []
    differ = unequal(first, eager)
    assert "transformer.wte.weight" in differ and "transformer.h.0.mlp.c_fc.weight" in differ
    assert "transformer.h.0.ln_1.weight" not in differ and "transformer.ln_f.bias" not in differ
    assert first.lm_head.weight is first.transformer.wte.weight

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
from zero_strategy.core.materialize import Materializer, default_init, meta_init

CPU = torch.device("cpu")
# fp32. The first loss is compared exactly: same weights, same generator, the same forward on
# each rank. After it only the order of gradient sums differs (DDP all-reduces buckets, stage 3
# reduce-scatters flat units): each sum rounds at 2**-24 ~ 6e-8 relative, a handful of sums per
# element at 2 ranks, and AdamW's step divides by sqrt(v) so it carries that relative error,
# not more, into lr-sized updates; over these 3-4 steps that stays far below 1e-5 of the loss.
TOL = 1e-5


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


@pytest.mark.parametrize("how", ["meta_init", "plain_meta"])
def test_engine_torch_attention_layers_equal_eager(engine_runs: dict, how: str) -> None:
    """MultiheadAttention (separate q/k/v projections, key/value biases), encoder and decoder
    layers without a param_init_fn: bit-equal, generator as after eager construction. Each
    ``out_proj`` is materialised (and sharded) before its attention, whose init zeroes
    ``out_proj.bias``: that write is applied when ``out_proj`` is materialised."""
    r = check(engine_runs[f"engine_{how}_torch_attention"])[0]
    assert len(r["keys"]) == 40 and r["differ"] == []
    assert r["rng_equal"] and r["draws_equal"]
    for attention in ("encoder.self_attn", "decoder.multihead_attn"):
        for order in (r["replay_order"], r["materialize_order"]):
            assert order.index(f"{attention}.out_proj") < order.index(attention)
    assert r["units"] > 10, "not every module its own unit"


def test_engine_plain_meta_custom_modules_differ_as_documented(engine_runs: dict) -> None:
    """Without meta_init the construction order is unknown: modules that create or initialise
    their own parameters after their children are replayed too early (README)."""
    r = check(engine_runs["engine_plain_meta_custom_modules"])[0]
    assert "blocks.0.gate" in r["differ"] and "blocks.1.scale" in r["differ"]
    assert "emb.weight" not in r["differ"], "modules before the first reordering still equal"
    assert r["rng_equal"], "the generator still advances by the whole model's draws"


# ---------------------------------------------------------------------- Lightning and Fabric
@pytest.mark.parametrize("name", ["init_lightning_zero3", "init_fabric_zero3",
                                  "init_lightning_attention_zero3"])
def test_sharded_init_starts_from_ddp_weights(suite: dict, name: str) -> None:
    """configure_model / init_module(empty_init=True) at stage 3 (built on meta, every module
    its own unit) against the same code under DDP (built eagerly): same initial weights, same
    generator state afterwards (the model's dropout makes every loss depend on it). The
    attention case is an nn.TransformerEncoderLayer with no param_init_fn."""
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


class WritesThroughView(nn.Module):
    """Its init writes into a child's weight through a slice: which elements it wrote is not
    kept, so the write cannot be replayed on the child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3))
        self.child = nn.Linear(3, 3)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale)
        with torch.no_grad():
            self.child.weight[0].uniform_(-0.01, 0.01)


@pytest.mark.parametrize("build, match", [
    (ResetsChildren, "Linear were randomly initialised again"),
    (WritesThroughView, "WritesThroughView writes in place to another module's tensor"),
])
def test_constructions_that_cannot_be_replayed_warn(build: Any, match: str) -> None:
    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=match), meta_init():
        model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        materialize(model)
    assert unequal(model, eager), "the warned-about case happens to be equal: fix the warning"


# torch's own layers that initialise through a private _reset_parameters (MultiheadAttention,
# and the layers built on it), also zeroing another module's tensor (out_proj.bias).
TORCH_LATE_INIT = {
    "attention": lambda: nn.MultiheadAttention(8, 2),
    "attention_kv_dims_bias_kv": lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True,
                                                               kdim=4, vdim=6),
    "attention_no_bias": lambda: nn.MultiheadAttention(8, 2, bias=False),
    "encoder_layer": lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
    "decoder_layer": lambda: nn.TransformerDecoderLayer(8, 2, dim_feedforward=16,
                                                        norm_first=True),
    "in_sequential": lambda: nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2),
                                           nn.TransformerEncoderLayer(8, 2, 16)),
}


@pytest.mark.parametrize("children_first", [True, False], ids=["children_first", "parents_first"])
@pytest.mark.parametrize("how", ["meta_init", "plain_meta"])
@pytest.mark.parametrize("name", sorted(TORCH_LATE_INIT))
def test_torch_late_init_layers_equal_eager(name: str, how: str, children_first: bool) -> None:
    """No param_init_fn: bit-equal to eager construction, generator where eager left it, no
    warning, in either materialisation order (MultiheadAttention's zeroing of out_proj.bias
    lands after out_proj's own init even when out_proj is materialised last)."""
    build = TORCH_LATE_INIT[name]
    torch.manual_seed(0)
    eager = build()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with meta_init() if how == "meta_init" else torch.device("meta"):
            model = build()
        materialize(model, children_first=children_first)
    assert not any(t.is_meta for t in model.state_dict().values())
    assert unequal(model, eager) == []
    assert torch.equal(torch.get_rng_state(), after)


def test_late_init_list_is_torchs() -> None:
    """Every torch.nn module initialising through ``_reset_parameters`` alone is LATE_INIT
    (a torch release adding one fails here rather than raising for users)."""
    import inspect

    from zero_strategy.core.materialize import LATE_INIT

    found = {cls for _, cls in inspect.getmembers(nn, inspect.isclass)
             if issubclass(cls, nn.Module) and "_reset_parameters" in vars(cls)
             and not callable(getattr(cls, "reset_parameters", None))}
    assert found == set(LATE_INIT)


def test_module_without_any_init_names_itself() -> None:
    class NoInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))

    with torch.device("meta"):
        model = nn.Sequential(NoInit())
    with pytest.raises(ValueError, match="NoInit has parameters on the meta device"):
        materialize(model)


def test_modules_not_built_in_meta_init_warn() -> None:
    """A module put on meta outside the block (here under a bare torch.device("meta")) was
    never seen being built: it cannot take its place in construction order."""
    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8))
    with torch.device("meta"):
        model.append(nn.Linear(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Materializer(model, CPU, None)
    assert any("not seen being built in meta_init" in str(w.message) for w in caught), caught


# Built from deep copies of one layer (nn.TransformerEncoder / Decoder), and nn.Transformer,
# whose init draws every >1-dim weight of those copies again: meta_init sees the copies being
# made and nn.Transformer's init run after its last child, so both are replayed exactly.
COPIED_LAYERS = {
    "encoder": lambda: nn.Sequential(nn.Linear(8, 8), nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16), 3, nn.LayerNorm(8), enable_nested_tensor=False)),
    "decoder": lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 2),
    "transformer": lambda: nn.Transformer(8, 2, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=16),
}


@pytest.mark.parametrize("children_first", [True, False], ids=["children_first", "parents_first"])
@pytest.mark.parametrize("name", sorted(COPIED_LAYERS))
def test_copied_layers_and_transformer_equal_eager_in_meta_init(name: str,
                                                                 children_first: bool) -> None:
    build = COPIED_LAYERS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor")  # torch's, not ours
        eager = build()
        after = torch.get_rng_state()
        torch.manual_seed(0)
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "enable_nested_tensor")
        with meta_init():
            model = build()
        assert torch.equal(torch.get_rng_state(), after), "replay left the generator elsewhere"
        materialize(model, children_first=children_first)
    assert unequal(model, eager) == []
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("name", sorted(COPIED_LAYERS))
def test_copied_layers_on_bare_meta_warn(name: str) -> None:
    """Under a bare torch.device("meta") the copies look like separately built layers, and
    nn.Transformer's init is not replayed: the weights differ, and a warning says so."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor")
        build = COPIED_LAYERS[name]
        eager = build()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build()
    match = "nn.Transformer's constructor" if name == "transformer" else "copies of one layer"
    with pytest.warns(UserWarning, match=match):
        materialize(model)
    assert unequal(model, eager)


def test_transformer_with_param_init_fn_warns() -> None:
    """A param_init_fn initialises modules with tensors; nn.Transformer has none, so its
    re-draw of its layers' weights is not replayed, and that is said."""
    def init(module: nn.Module) -> None:  # the default's effect, but the user's function
        default_init(module)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor")
        with meta_init(init_fn=init):
            model = COPIED_LAYERS["transformer"]()
    with pytest.warns(UserWarning, match="nn.Transformer's constructor"):
        materialize(model, init_fn=init)


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

"""Pretrained Hugging Face weights streamed straight into the shards (no rank holds the whole
model): ``zero_strategy.integrations.hf.pretrained.from_pretrained`` + ``ZeroEngine`` against
``Model.from_pretrained`` + ``ZeroEngine``, and ``engine.load_pretrained``.

Distributed parity, training, refusals and memory run in tests/worlds/scenarios_pretrained.py
and tests/worlds/pretrained_memory.py (one process group each, tests/support/harness.py); the
folder reader, the key mapping and the refusals of ``from_pretrained`` run here in-process.
Every comparison is bit for bit: both sides read the same bytes from the same file and cast
them with the same ops, so there is no tolerance to argue.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.support.harness import check, run_world
from tests.support.pretrained_files import CASES, broken_folders
from zero_strategy.checkpoint.errors import CheckpointError
from zero_strategy.checkpoint.pretrained import (
    KeyMap,
    PretrainedFolder,
    module_entries,
    resolve,
    spec_of,
)

transformers = pytest.importorskip("transformers")
from zero_strategy.integrations.hf.pretrained import (  # noqa: E402
    from_pretrained,
    key_map_for,
    loading_info,
)

WORLD = "tests/worlds/scenarios_pretrained.py"
PARITY = [f"gpt2_{case}_stage{stage}" for stage in range(4)
          for case in ("fp32", "fp32_as_bf16", "bf16_default", "bf16_explicit", "sharded")]
PARITY += ["gpt2_offload_cpu_stage3", "gpt2_offload_disk_stage3", "base_into_head",
           "head_into_base", "bert_missing_head_stage3",
           "bert_missing_head_stage1", "llama_stage3", "llama_bf16_stage2"]
# N=3: shard sizes that do not divide the parameters; the cases most sensitive to them.
WORLD3 = ["gpt2_fp32_stage1", "gpt2_fp32_stage3", "gpt2_sharded_stage3",
          "bert_missing_head_stage3", "training_stage3", "bad_folders",
          "peft_gpt2_bias_stage3", "peft_llama_embedding_stage1"]


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_world(WORLD, 2)


@pytest.fixture(scope="module")
def world3() -> dict:
    return run_world(WORLD, 3, env={"ZS_ONLY": ",".join(WORLD3)})


@pytest.fixture(scope="module")
def memory() -> dict:
    # A fixed mmap threshold makes glibc give freed tensors back at once, so each build's
    # high-water mark is its own (as tests/quick/test_engine_dist.py measures sharded init).
    return run_world("tests/worlds/pretrained_memory.py", 2,
                     env={"MALLOC_MMAP_THRESHOLD_": "65536", "ZS_PRETRAINED_LAYERS": "6"})


def _assert_parity(results: list[Any]) -> None:
    for rank, r in enumerate(check(results)):
        where = f"rank {rank}"
        assert r["on_meta"] and r["eval"] and r["loaded"], where
        assert r["keys_equal"] and r["differ"] == [], f"{where}: {r['differ']}"
        assert r["differ_plain"] == [] and r["buffers_differ"] == [], where
        assert r["missing"] == r["ref_missing"] and r["unexpected"] == r["ref_unexpected"]


@pytest.mark.parametrize("name", PARITY)
def test_equals_from_pretrained_world2(world2: dict, name: str) -> None:
    """Consolidated weights, buffers, missing and unexpected keys all equal transformers'."""
    _assert_parity(world2[name])


@pytest.mark.parametrize("name", [n for n in PARITY if n.startswith(tuple(WORLD3))])
def test_equals_from_pretrained_world3(world3: dict, name: str) -> None:
    _assert_parity(world3[name])


def test_the_cases_test_what_they_say(world2: dict) -> None:
    """Units really sharded, the sharded folder really has an index, the dtypes as asked."""
    r = {name: check(world2[name])[0] for name in PARITY}
    assert all(r[f"gpt2_fp32_stage{s}"]["sharded_units"] > 3 for s in (1, 2, 3))
    assert r["gpt2_fp32_stage0"]["sharded_units"] == 0
    assert r["gpt2_sharded_stage3"]["weight_files"] > 3 and r["gpt2_fp32_stage3"][
        "weight_files"] == 1
    assert r["gpt2_fp32_as_bf16_stage3"]["dtypes"] == ["torch.bfloat16"]  # bf16-true
    assert r["gpt2_bf16_default_stage3"]["dtypes"] == ["torch.float32"]  # fp32 masters
    assert r["llama_stage3"]["buffers"] == ["model.rotary_emb.inv_freq",
                                            "model.rotary_emb.original_inv_freq"]


def test_missing_head_is_reported_and_initialised_as_transformers_does(world2: dict) -> None:
    """BertModel's folder into BertForSequenceClassification: the classifier is missing, as
    transformers reports it, and (same seed) even its random init equals transformers'."""
    for name in ("bert_missing_head_stage3", "bert_missing_head_stage1"):
        for r in check(world2[name]):
            assert r["missing"] == ["classifier.bias", "classifier.weight"] == r["ref_missing"]
            assert r["differ"] == []
            assert r["buffers"] == ["bert.embeddings.position_ids",
                                    "bert.embeddings.token_type_ids"]


def test_non_persistent_buffers_get_the_eager_constructor_values(world2: dict) -> None:
    for r in check(world2["llama_buffers_as_eager"]):
        assert len(r["buffers"]) == 2 and r["differ"] == []


@pytest.mark.parametrize("name", ["training_stage2_bf16-mixed", "training_stage3_32-true"])
def test_training_equals_training_from_from_pretrained(world2: dict, name: str) -> None:
    for r in check(world2[name]):
        assert r["losses"] == r["ref_losses"] and r["differ"] == []


def test_training_equals_world3(world3: dict) -> None:
    for r in check(world3["training_stage3_32-true"]):
        assert r["losses"] == r["ref_losses"] and r["differ"] == []


PEFT = [f"peft_{case}_stage{stage}" for case in ("gpt2_bias", "gpt2_gaussian",
                                                  "llama_embedding") for stage in range(4)]


@pytest.mark.parametrize("name", PEFT)
def test_peft_on_a_streamed_model_loads_inits_and_trains_as_loaded_whole(world2: dict,
                                                                          name: str) -> None:
    _assert_peft(world2[name], gaussian="gaussian" in name)


@pytest.mark.parametrize("name", ["peft_gpt2_bias_stage3", "peft_llama_embedding_stage1"])
def test_peft_on_a_streamed_model_world3(world3: dict, name: str) -> None:
    """Shards that do not divide the adapters or the base weights."""
    _assert_peft(world3[name], gaussian=False)


def _assert_peft(result: list[Any], gaussian: bool) -> None:
    """get_peft_model on a streamed model: the base weights stream in under PEFT's names (bit
    for bit those of the model loaded whole and wrapped), every adapter gets PEFT's init rule
    (B and B's bias zero; A below nn.Linear's kaiming bound 1/sqrt(fan_in), or of std 1/r
    for "gaussian"; embeddings A zero, B standard normal), the same on every rank, and three
    AdamW steps equal the whole model's bit for bit once it takes our A (same bytes, same
    ops: no tolerance)."""
    for r in check(result):
        assert r["base_differ"] == [] and r["same_on_every_rank"]
        assert r["adapters"], "no adapter reached the engine"
        for key, (shape, top, std) in r["adapters"].items():
            fan_in = r["fan_in"][key]
            if "lora_B" in key or "lora_embedding_A" in key:
                assert top == 0.0, key
            # The draws are seeded (the same every run); the ranges are set from their
            # spread so that another rule (kaiming for a normal, a wrong std) falls outside.
            elif "lora_embedding_B" in key:  # N(0, 1), 4 x 64 draws: sample std's SE 0.044
                assert 0.8 < std < 1.2, (key, std)
            elif gaussian:  # N(0, 1/r = 0.25), 4 x 32 or more draws: SE under 0.016
                assert 0.2 < std < 0.3, (key, std)
            else:  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)); the
                # largest of 128 or more draws is below half the bound with chance 2^-128
                bound = fan_in ** -0.5
                assert 0.5 * bound < top <= bound, (key, top, bound, shape)
        assert r["losses"] == r["ref_losses"] and r["differ"] == []


def test_peft_on_a_streamed_model_refuses_what_needs_the_base_weights(world2: dict) -> None:
    for r in check(world2["peft_refusals"]):
        assert "use_dora=True" in r["dora"]
        assert "init_lora_weights='eva'" in r["eva"]  # PiSSA & co. fail in PEFT itself on meta
        assert "ModulesToSaveWrapper" in r["modules_to_save"]
        for message in r.values():
            assert "from_pretrained" in message and "init_lora_weights in [True, False, " \
                "'gaussian']" in message, message


def test_model_inside_a_strategy_meta_init(world2: dict) -> None:
    """Built in a nested meta_init (Lightning's configure_model, Fabric's init_module) and
    held by another module: loaded under its prefix; the other module's init as eager."""
    for r in check(world2["inside_a_wrapper_built_in_meta_init"]):
        assert r["differ"] == [] and r["head_as_eager"]


def test_engine_load_pretrained(world2: dict) -> None:
    for r in check(world2["load_pretrained_into_an_engine"]):
        assert r["result"] == [[], []] and r["differ"] == []
        assert "bert_base: nothing was loaded (strict=True)" in r["strict"]
        assert "41 model keys missing" in r["strict"] and r["unchanged"]
        assert r["relaxed"] == [["classifier.bias", "classifier.weight"], []]
        assert r["back_after_training"] == [[[], []], [], True]


@pytest.mark.parametrize("world", ["world2", "world3"])
def test_bad_folders_are_refused_on_every_rank_before_any_change(
        request: pytest.FixtureRequest, world: str) -> None:
    results = check(request.getfixturevalue(world)["bad_folders_change_nothing"])
    for rank, r in enumerate(results):
        assert r["unchanged"], f"rank {rank}"
        for case, fragments in CASES.items():
            message = r["messages"][case]
            assert all(f in message for f in fragments), f"rank {rank} {case}: {message}"
        # one rank's folder is broken: that rank names the file, the others name that rank
        one = r["messages"]["one_rank_truncated"]
        assert "truncated/model.safetensors" in one, f"rank {rank}: {one}"
        if rank < len(results) - 1:
            assert f"failed on rank {len(results) - 1}" in one


def test_peak_memory_is_a_shard_not_the_model(memory: dict) -> None:
    """Building a stage-3 engine at N=2 from an 89 MiB GPT-2 folder: RSS grows by this rank's
    shard, one unit and a constant, against the whole model and more for from_pretrained.
    The constant (16 MiB) covers what is not a tensor of the model: allocator slack, the
    optimizer's and engine's Python objects, pages of the safetensors headers."""
    for rank, r in enumerate(check(memory["peak_rss"])):
        where = f"rank {rank}: {r}"
        assert r["same_weights"], where
        assert r["whole_mib"] > 0.95 * r["model_mib"], f"the measurement cannot tell: {where}"
        assert r["streamed_mib"] <= r["shard_mib"] + r["largest_unit_mib"] + 16, where
        assert r["streamed_mib"] < 0.8 * r["model_mib"], where


# ---------------------------------------------------------------------------- in-process
@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    gpt2 = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    GPT2LMHeadModel(gpt2).to(torch.bfloat16).save_pretrained(root / "gpt2_bf16")
    GPT2LMHeadModel(gpt2).save_pretrained(root / "sharded", max_shard_size="20KB")
    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=48)).save_pretrained(
        root / "bert")
    (root / "broken").mkdir()
    broken_folders(root / "gpt2", root / "broken")
    return {p.name: p for p in root.iterdir()}


@pytest.mark.parametrize("case", list(CASES))
def test_from_pretrained_refuses_broken_folders(folders: dict, case: str) -> None:
    """Checked when the model is built, before an engine (or a rank) touches anything."""
    with pytest.raises(CheckpointError) as info:
        from_pretrained(transformers.GPT2LMHeadModel, folders["broken"] / case)
    assert all(f in str(info.value) for f in CASES[case]), str(info.value)


@pytest.mark.parametrize("kwargs, named", [
    ({"device_map": "auto"}, "device_map='auto'"),
    ({"quantization_config": {"load_in_8bit": True}}, "quantization_config"),
    ({"use_safetensors": False}, "use_safetensors=False"),
    ({"revision": "v2"}, "revision='v2'"),
    ({"dtype": {"": torch.float16}}, "dtype={''"),
    ({"dtype": "int8"}, "dtype='int8'"),
])
def test_from_pretrained_refuses_what_it_cannot_honour(folders: dict, kwargs: dict,
                                                       named: str) -> None:
    with pytest.raises(ValueError, match="from_pretrained") as info:
        from_pretrained(transformers.GPT2LMHeadModel, folders["gpt2"], **kwargs)
    assert named in str(info.value)


def test_dtype_and_config_options(folders: dict) -> None:
    """``dtype`` as transformers: the config's by default ("auto"), a name, a torch dtype;
    config fields and attn_implementation pass through."""
    cls = transformers.GPT2LMHeadModel
    assert next(from_pretrained(cls, folders["gpt2_bf16"]).parameters()).dtype == torch.bfloat16
    assert next(from_pretrained(cls, folders["gpt2"], dtype="bfloat16").parameters()).dtype \
        == torch.bfloat16
    model = from_pretrained(cls, folders["gpt2_bf16"], torch_dtype=torch.float32,
                            attn_implementation="eager", n_positions=32)
    assert next(model.parameters()).dtype == torch.float32 and model.config.dtype == torch.float32
    assert model.config._attn_implementation == "eager"
    config = transformers.GPT2Config.from_pretrained(folders["gpt2"])
    config.resid_pdrop = 0.25
    assert from_pretrained(cls, folders["gpt2"], config=config).config.resid_pdrop == 0.25
    assert all(p.is_meta for p in model.parameters())


def test_missing_keys_are_warned_about_and_reported(folders: dict) -> None:
    cls = transformers.BertForSequenceClassification
    missing = r"newly initialized: \['classifier.weight', 'classifier.bias'\]"
    with pytest.warns(UserWarning, match=missing):
        model, info = from_pretrained(cls, folders["bert"], output_loading_info=True)
    _, ref = cls.from_pretrained(folders["bert"], output_loading_info=True)
    assert info["missing_keys"] == ref["missing_keys"] == {"classifier.weight",
                                                          "classifier.bias"}
    assert info["unexpected_keys"] == ref["unexpected_keys"] == set()
    assert loading_info(model) is info
    with pytest.raises(ValueError, match="not built by"):
        loading_info(nn.Linear(1, 1))


def test_a_model_built_is_not_kept_alive_by_the_registries(folders: dict) -> None:
    model = from_pretrained(transformers.GPT2LMHeadModel, folders["gpt2"])
    assert spec_of(model) is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_folder_reads_any_range_of_any_shard(folders: dict) -> None:
    folder = PretrainedFolder(folders["sharded"])
    assert len(folder.files) > 3
    expected: dict[str, torch.Tensor] = {}
    for file in folders["sharded"].glob("*.safetensors"):
        expected.update(load_file(file))
    assert sorted(folder.keys()) == sorted(expected)
    for key, tensor in expected.items():
        flat, n = tensor.reshape(-1), tensor.numel()
        assert torch.equal(folder.read(key), tensor)
        assert torch.equal(folder.read(key, n // 3, n - 1), flat[n // 3 : n - 1])
    assert folder.float_dtype() == torch.float32


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.norm = nn.LayerNorm(4)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Base()
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.body.wte.weight  # tied


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> PretrainedFolder:
    path.mkdir()
    save_file({k: v.detach().clone() for k, v in tensors.items()},  # no shared storage
              str(path / "model.safetensors"))
    return PretrainedFolder(path)


def test_key_mapping_prefix_ties_renames_and_ignores(tmp_path: Path) -> None:
    """Base checkpoint into a head model (prefix added), head into base (prefix stripped), a
    tied weight absent from the folder is not missing, legacy names renamed, ignored keys."""
    base = {k: v.detach() for k, v in _Base().state_dict().items()}
    base["norm.gamma"] = base.pop("norm.weight")
    folder = _save(tmp_path / "base", {**base, "old.bias": torch.zeros(1)})
    key_map = KeyMap(prefix="body", rename=lambda k: k.replace(".gamma", ".weight"),
                     ignore_unexpected=(r"^old\.",))
    found = resolve(module_entries(_Head()), folder, key_map)
    assert found.missing == [] and found.unexpected == []
    assert found.covered == {"body.wte.weight", "body.norm.weight", "body.norm.bias",
                             "out.weight"}
    assert found.sources["body.norm.weight"] == "norm.gamma"
    head = {k: v.detach() for k, v in _Head().state_dict().items() if k != "out.weight"}
    into_base = resolve(module_entries(_Base()), _save(tmp_path / "head", head),
                        KeyMap(prefix="body"))
    assert into_base.missing == [] and into_base.unexpected == []
    lacking = resolve(module_entries(_Head()), folder, KeyMap(prefix="body"))
    assert lacking.missing == ["body.norm.weight"]
    assert lacking.unexpected == ["norm.gamma", "old.bias"]


def test_key_mapping_refuses_ambiguous_and_untied_folders(tmp_path: Path) -> None:
    head = {k: v.detach().clone() for k, v in _Head().state_dict().items()}
    twice = _save(tmp_path / "twice", {**head, "wte.weight": head["body.wte.weight"]})
    with pytest.raises(CheckpointError, match="both load model key 'body.wte.weight'"):
        resolve(module_entries(_Head()), twice, KeyMap(prefix="body"))
    head["out.weight"] = head["out.weight"] + 1
    untied = _save(tmp_path / "untied", head)
    with pytest.raises(CheckpointError, match="differ, but the model ties them"):
        resolve(module_entries(_Head()), untied, KeyMap())
    head["out.weight"] = head["body.wte.weight"].clone()  # saved twice, equal: fine
    equal = resolve(module_entries(_Head()), _save(tmp_path / "equal", head), KeyMap())
    assert equal.missing == [] and equal.unexpected == []


def test_transformers_key_map(folders: dict) -> None:
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(
            folders["gpt2"]))
    key_map = key_map_for(model)
    assert key_map.prefix == "transformer" and key_map.rename is not None
    assert key_map.rename("h.0.LayerNorm.gamma") == "h.0.LayerNorm.weight"
    assert r"attn.bias" in key_map.ignore_unexpected  # GPT-2's old mask buffers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing or unexpected: no warning
        from_pretrained(transformers.GPT2Model, folders["gpt2"])

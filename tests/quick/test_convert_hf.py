"""write_hf: a checkpoint of each recipe model, trained by the engine under a LightningModule-like
wrapper, exported as a save_pretrained directory and loaded back by from_pretrained, bit for
bit; sharding, dtype casts, tied weights, streaming, and refusals that leave nothing behind."""

from __future__ import annotations

import json
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

import zero_strategy as zs
from zero_strategy.checkpoint.errors import CheckpointError
from zero_strategy.checkpoint.hf import INDEX, WEIGHTS, write_hf
from zero_strategy.checkpoint.read import CheckpointReader
from zero_strategy.checkpoint.verify import resolve
from zero_strategy.comm.groups import (
    destroy_default_group,
    group_is_initialized,
    init_single_process_group,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, LABELS = 96, 16, 10
# recipes/models.py SIZES[...]["tiny"], with dropout 0 (recipes/models.py build_model).
TINY = {
    "gpt": {"n_layer": 2, "n_embd": 64, "n_head": 2},
    "bert": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
             "intermediate_size": 256},
    "resnet": {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16},
}
KINDS = list(TINY)


def build(kind: str) -> Any:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        ResNetConfig,
        ResNetForImageClassification,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=2, eos_token_id=3, **TINY[kind]))
    if kind == "bert":
        return BertForMaskedLM(BertConfig(
            vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=0,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **TINY[kind]))
    return ResNetForImageClassification(ResNetConfig(
        num_channels=1, num_labels=LABELS, layer_type="basic", **TINY[kind]))


def batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "resnet":
        return {"pixel_values": torch.randn(4, 1, 16, 16, generator=g),
                "labels": torch.randint(0, LABELS, (4,), generator=g)}
    ids = torch.randint(4, VOCAB, (4, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


class Wrapper(nn.Module):
    """As the recipes' LightningModule: the HF model under attribute ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, data: dict[str, torch.Tensor]) -> Any:
        return self.model(**data)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    if group_is_initialized():
        pytest.skip("a process group already exists in this process")
    init_single_process_group(torch.device("cpu"))
    yield
    destroy_default_group()


@pytest.fixture(scope="module", params=KINDS)
def trained(request: pytest.FixtureRequest, group: None,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model trained 2 AdamW steps by a stage-3 engine, its checkpoint, and what
    save_pretrained writes for it (the reference)."""
    kind = request.param
    model = build(kind)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    wrapper = Wrapper(model)
    engine = zs.ZeroEngine(wrapper, torch.optim.AdamW(wrapper.parameters(), lr=1e-2),
                           zs.ZeroConfig(stage=3))
    for step in range(2):
        engine.backward(engine(batch(kind, step)).loss)
        engine.step()
        engine.zero_grad()
    root = tmp_path_factory.mktemp(f"ckpt-{kind}")
    engine.save_checkpoint(root / "ckpt")
    model = engine.close().model.eval()  # the trained model, plain again
    state = model.state_dict()
    assert any(not torch.equal(state[k], initial[k]) for k in state)  # it did train
    model.save_pretrained(root / "reference")
    fixed = batch(kind, 99)
    with torch.no_grad():
        logits = model(**fixed).logits
    return {"kind": kind, "cls": type(model), "config": model.config, "state": state,
            "ckpt": root / "ckpt", "reference": root / "reference", "input": fixed,
            "logits": logits}


def reader(trained: dict[str, Any]) -> CheckpointReader:
    r = CheckpointReader(resolve(trained["ckpt"], None))
    r.verify_all()
    return r


def check_loads_exactly(trained: dict[str, Any], out: Path, **kwargs: Any) -> Any:
    loaded = trained["cls"].from_pretrained(out, **kwargs)
    state = loaded.state_dict()
    assert set(state) == set(trained["state"])
    for key, value in trained["state"].items():
        assert bitwise_equal(state[key], value), key
    with torch.no_grad():
        assert bitwise_equal(loaded(**trained["input"]).logits, trained["logits"])
    return loaded


@pytest.mark.parametrize("trained", KINDS, indirect=True)
def test_export_is_what_save_pretrained_writes_and_loads_exactly(
        trained: dict[str, Any], tmp_path: Path) -> None:
    out = write_hf(reader(trained), tmp_path / "hf", config=trained["config"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", WEIGHTS]
    ours, reference = file_tensors(out), file_tensors(trained["reference"])
    # Same keys as save_pretrained: "model." stripped, tied duplicates dropped.
    assert set(ours) == set(reference)
    assert all(bitwise_equal(ours[k], reference[k]) for k in ours)
    if trained["kind"] == "gpt":
        assert "lm_head.weight" not in ours and "transformer.wte.weight" in ours
    if trained["kind"] == "bert":
        assert not {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"} & set(ours)
    check_loads_exactly(trained, out)


@pytest.mark.parametrize("trained", ["gpt"], indirect=True)
def test_small_shards_are_indexed_and_load(trained: dict[str, Any], tmp_path: Path) -> None:
    limit = 100_000
    out = write_hf(reader(trained), tmp_path / "hf", config=trained["config"],
                   max_shard_bytes=limit)
    index = json.loads((out / INDEX).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and WEIGHTS not in shards
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    reference = file_tensors(trained["reference"])
    assert set(index["weight_map"]) == set(reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in reference.values())
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            keys = list(f.keys())
            sizes = [f.get_slice(k).get_shape() for k in keys]
        assert all(index["weight_map"][k] == shard for k in keys)
        nbytes = sum(4 * int(np.prod(s)) for s in sizes)
        assert nbytes <= limit or len(keys) == 1
    check_loads_exactly(trained, out)


@pytest.mark.parametrize("trained", ["resnet"], indirect=True)
def test_dtype_casts_floats_only_and_the_config_records_it(trained: dict[str, Any],
                                                           tmp_path: Path) -> None:
    out = write_hf(reader(trained), tmp_path / "hf", config=trained["config"],
                   dtype=torch.bfloat16)
    ours = file_tensors(out)
    for key, value in trained["state"].items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert bitwise_equal(ours[key], want), key  # num_batches_tracked stays int64
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert trained["config"].dtype != torch.bfloat16  # the caller's config is left alone
    loaded = trained["cls"].from_pretrained(out)
    assert loaded.dtype == torch.bfloat16


@pytest.mark.parametrize("trained", ["bert"], indirect=True)
def test_config_from_a_directory_is_copied(trained: dict[str, Any], tmp_path: Path) -> None:
    out = write_hf(reader(trained), tmp_path / "hf", config=trained["reference"])
    assert (out / "config.json").read_bytes() == \
        (trained["reference"] / "config.json").read_bytes()
    assert set(file_tensors(out)) == set(file_tensors(trained["reference"]))
    check_loads_exactly(trained, out)


@pytest.mark.parametrize("trained", ["gpt"], indirect=True)
def test_refusals_name_the_cause_and_write_nothing(trained: dict[str, Any],
                                                   tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="out_dir exists and is not empty"):
        write_hf(reader(trained), busy, config=trained["config"])
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    with pytest.raises(CheckpointError, match=r"prefix 'transformer\.': key 'model\.transformer"
                                              r"\.wte\.weight' does not start with it"):
        write_hf(reader(trained), tmp_path / "a", prefix="transformer.")
    with pytest.raises(CheckpointError, match="max_shard_bytes must be a positive int"):
        write_hf(reader(trained), tmp_path / "b", max_shard_bytes=0)
    with pytest.raises(CheckpointError, match="dtype must be None or one of"):
        write_hf(reader(trained), tmp_path / "c", dtype=torch.int32)
    with pytest.raises(CheckpointError, match="config must be a transformers PretrainedConfig"):
        write_hf(reader(trained), tmp_path / "d", config={"n_layer": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no temporary left
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is taken
    assert write_hf(reader(trained), empty, prefix="model.") == empty
    assert (empty / WEIGHTS).is_file() and not (empty / "config.json").exists()


# ------------------------------------------------------------------ readers without an engine
class FakeReader:
    """The entries() interface over tensors made on demand (numpy-backed, so tracemalloc
    sees their memory)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], float]],
                 fail_at: str | None = None) -> None:
        self.specs, self.fail_at, self.loads = specs, fail_at, []

    def make(self, key: str) -> torch.Tensor:
        shape, value = self.specs[key]
        return torch.from_numpy(np.full(shape, value, dtype=np.float32))

    def entries(self, dtype: torch.dtype | None = None) -> Iterator[Any]:
        for key, (shape, _) in self.specs.items():
            yield key, (lambda k=key: self.load(k)), shape, torch.float32

    def load(self, key: str) -> torch.Tensor:
        self.loads.append(key)
        if key == self.fail_at:
            raise OSError(f"cannot read {key}")
        return self.make(key)


def test_export_streams_one_tensor_at_a_time(tmp_path: Path) -> None:
    """16 tensors of 1 MiB: peak traced memory stays near one tensor, not the 16 MiB."""
    specs = {f"model.layer{i}.weight": ((512, 512), float(i)) for i in range(16)}
    fake = FakeReader(specs)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        write_hf(fake, tmp_path / "hf", max_shard_bytes=6 * 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert sorted(fake.loads) == sorted(specs) and len(fake.loads) == len(specs)
    ours = file_tensors(tmp_path / "hf")
    assert set(ours) == {k.removeprefix("model.") for k in specs}  # every key had it
    assert all(bitwise_equal(ours[k.removeprefix("model.")], fake.make(k)) for k in specs)


def test_a_failed_export_leaves_nothing(tmp_path: Path) -> None:
    fake = FakeReader({f"w{i}": ((4,), float(i)) for i in range(5)}, fail_at="w3")
    empty = tmp_path / "out"
    empty.mkdir()
    with pytest.raises(OSError, match="cannot read w3"):
        write_hf(fake, empty, max_shard_bytes=32)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any(empty.iterdir())


def test_mixed_keys_are_kept_and_unequal_ties_both_written(tmp_path: Path) -> None:
    config = transformers.GPT2Config(vocab_size=8, n_embd=4, n_layer=1, n_head=1,
                                     bos_token_id=0, eos_token_id=0)
    specs = {"transformer.wte.weight": ((8, 4), 1.0), "lm_head.weight": ((8, 4), 2.0),
             "model.extra": ((2,), 3.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_hf(FakeReader(specs), tmp_path / "hf", config=config)
    assert any("differ although the config ties them" in str(w.message) for w in caught)
    assert set(file_tensors(tmp_path / "hf")) == set(specs)  # not all had "model.": kept
    specs["lm_head.weight"] = ((8, 4), 1.0)  # equal now: dropped as save_pretrained does
    write_hf(FakeReader(specs), tmp_path / "tied", config=config)
    assert set(file_tensors(tmp_path / "tied")) == {"transformer.wte.weight", "model.extra"}


def test_mixed_dtypes_are_laid_out_aligned(tmp_path: Path) -> None:
    """Odd-sized tensors of four widths: each tensor's data starts at a multiple of its element
    size in the file (a zero-copy view for mmap loaders), and every value comes back."""
    values = {"a": torch.arange(3, dtype=torch.bfloat16), "b": torch.tensor([True, False, True]),
              "c": torch.arange(5, dtype=torch.float32), "d": torch.arange(3, dtype=torch.int64)}

    class DictReader:
        def entries(self, dtype: torch.dtype | None = None) -> Iterator[Any]:
            for key, v in values.items():
                yield key, (lambda v=v: v.clone()), tuple(v.shape), v.dtype

    file = write_hf(DictReader(), tmp_path / "hf") / WEIGHTS
    raw = file.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    assert list(header) == ["__metadata__", *values]  # the header in state-dict order
    for key, v in values.items():
        assert (8 + size + header[key]["data_offsets"][0]) % v.element_size() == 0, key
    assert all(bitwise_equal(file_tensors(file.parent)[k], v) for k, v in values.items())

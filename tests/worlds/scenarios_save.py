"""Saving streamed from the shards and weights out a bucket at a time, for
tests/quick/test_save_streamed.py and tests/quick/test_hub_weights.py (run by
tests/support/harness.py at N=1, 2 and 3).

Every scenario trains a tiny transformers model a step under the engine (so the masters are
no longer the initial weights), then saves or iterates, and compares bit for bit with
``engine.full_state_dict()`` (the consolidated masters) and with plain transformers'
``save_pretrained`` of a model holding those weights: both sides are the same fp32 values
copied, never recomputed, so there is no tolerance to argue.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero_strategy as zs
from tests.support.harness import register, scenario
from zero_strategy.checkpoint.errors import CheckpointError

STAGES = (0, 1, 2, 3)


def _config(stage: int) -> zs.ZeroConfig:
    if stage == 3:  # many small units: every parameter split over ranks and units
        return zs.ZeroConfig(stage=3, unit_numel=3000, param_persistence_threshold=0)
    return zs.ZeroConfig(stage=stage, bucket_numel=5000)


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _moe() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0))


def _trained(model: Any, stage: int) -> zs.ZeroEngine:
    engine = zs.ZeroEngine(model.train(), torch.optim.AdamW(model.parameters(), lr=1e-2),
                           _config(stage))
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def _shared_dir() -> Path:
    """A fresh directory, the same on every rank."""
    root = [tempfile.mkdtemp(prefix="zs-save-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    return Path(str(root[0]))


def _files(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in set(a) | set(b)
                  if k not in a or k not in b or a[k].dtype != b[k].dtype
                  or not torch.equal(a[k], b[k]))


def _reference(model_class: Any, engine: zs.ZeroEngine, folder: Path,
               max_shard_size: int | str) -> None:
    """Plain transformers' save_pretrained of a plain model holding the engine's weights
    (rank 0 writes)."""
    full = engine.full_state_dict()
    if dist.get_rank() == 0:
        plain = model_class(engine.module.config)
        plain.load_state_dict(full)
        plain.save_pretrained(folder, max_shard_size=max_shard_size)
    dist.barrier()


def save_parity(stage: int, kind: str, max_shard_size: int | str) -> dict[str, Any]:
    """engine.save_pretrained against plain save_pretrained of the same weights, and read
    back by transformers and by our streamed loader."""
    from zero_strategy.integrations.hf.pretrained import from_pretrained

    model = _gpt2() if kind == "gpt2" else _moe()
    model_class = type(model)
    engine = _trained(model, stage)
    root = _shared_dir()
    out = engine.save_pretrained(root / "ours", max_shard_size=max_shard_size)
    _reference(model_class, engine, root / "theirs", max_shard_size)
    full = engine.full_state_dict()
    loaded = model_class.from_pretrained(out)
    ours_back = from_pretrained(model_class, out)
    back = zs.ZeroEngine(ours_back, torch.optim.AdamW(ours_back.parameters()),
                         _config(stage)).full_state_dict()
    streamed = _differ(back, full)
    index = out / "model.safetensors.index.json"
    ref_index = root / "theirs" / "model.safetensors.index.json"
    result = {
        "files": sorted(p.name for p in out.iterdir()),
        "ref_files": sorted(p.name for p in (root / "theirs").iterdir()),
        "differ_files": _differ(_files(out), _files(root / "theirs")),
        "differ_transformers": _differ(dict(loaded.state_dict()), full),
        "differ_streamed": streamed,
        "config_dtype": json.loads((out / "config.json").read_text()).get("dtype"),
    }
    if index.exists() and ref_index.exists():
        ours, theirs = json.loads(index.read_text()), json.loads(ref_index.read_text())
        result["weight_map_equal"] = ours["weight_map"] == theirs["weight_map"]
        result["metadata"] = [ours["metadata"], theirs["metadata"]]
    return result


for _stage in STAGES:
    register(f"gpt2_stage{_stage}", save_parity, stage=_stage, kind="gpt2",
             max_shard_size="50GB")
    register(f"gpt2_indexed_stage{_stage}", save_parity, stage=_stage, kind="gpt2",
             max_shard_size=20_000)
register("moe_stage3", save_parity, stage=3, kind="moe", max_shard_size="50GB")
register("moe_indexed_stage1", save_parity, stage=1, kind="moe", max_shard_size=10_000)


def hub_weights(stage: int, kind: str, bucket_bytes: int, to: int | str) -> dict[str, Any]:
    """engine.hub_weight_buckets into a plain model with load_state_dict(strict=False):
    the receivers get the hub's tensors, each bucket within its size, the others nothing."""
    model = _gpt2() if kind == "gpt2" else _moe()
    engine = _trained(model, stage)
    full = engine.full_state_dict()
    sizes, got, over = [], {}, []
    for bucket in engine.hub_weight_buckets(bucket_bytes=bucket_bytes, to=to):
        nbytes = sum(t.nbytes for _, t in bucket)
        sizes.append(nbytes)
        if nbytes > bucket_bytes:
            over.append(sorted(k for k, _ in bucket))
        got.update({k: t.clone() for k, t in bucket})
    plain_names = set(_reference_names(type(model), engine))
    mine = to == "all" or dist.get_rank() == to
    result: dict[str, Any] = {"received": len(got), "mine": mine}
    if mine:
        # The values: what plain save_pretrained writes for a plain model holding the
        # consolidated masters (transformers' own tie removal and conversion, not ours).
        result["hub_differ"] = _differ(got, _reference_hub(type(model), engine, full))
        plain = type(model)(engine.module.config)
        if kind == "gpt2":  # the hub layout is the module's: load it straight back
            missing, unexpected = plain.load_state_dict(got, strict=False)
            result["loaded_differ"] = _differ(dict(plain.state_dict()), full)
            result["missing"] = sorted(missing)
            result["unexpected"] = sorted(unexpected)
        result["names_equal"] = set(got) == plain_names
        result["over"] = over
        result["buckets"] = len(sizes)
    return result


def _reference_names(model_class: Any, engine: Any) -> list[str]:
    """The keys plain save_pretrained writes for these weights (every rank computes them);
    ``engine`` is the engine, or the transformers model itself."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    config = engine.module.config if isinstance(engine, zs.ZeroEngine) else engine.config
    plain = model_class(config)
    state = remove_tied_weights_from_state_dict(plain.state_dict(), plain)
    return list(revert_weight_conversion(plain, state))


def _reference_hub(model_class: Any, engine: zs.ZeroEngine,
                   full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors plain save_pretrained writes for a plain model holding ``full``."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    plain = model_class(engine.module.config)
    plain.load_state_dict(full)
    state = remove_tied_weights_from_state_dict(plain.state_dict(), plain)
    return {k: v.detach().clone() for k, v in revert_weight_conversion(plain, state).items()}


register("iter_gpt2_stage3_rank0", hub_weights, stage=3, kind="gpt2", bucket_bytes=6000,
         to=0)
register("iter_gpt2_stage2_all", hub_weights, stage=2, kind="gpt2", bucket_bytes=6000,
         to="all")
register("iter_gpt2_stage0_rank0", hub_weights, stage=0, kind="gpt2", bucket_bytes=50_000,
         to=0)
register("iter_moe_stage3_all", hub_weights, stage=3, kind="moe", bucket_bytes=3000,
         to="all")


@scenario
def iter_to_last_rank() -> dict[str, Any]:
    """to=<the last rank>: it alone receives."""
    engine = _trained(_gpt2(), 3)
    last = dist.get_world_size() - 1
    count = sum(len(b) for b in engine.hub_weight_buckets(bucket_bytes=10_000, to=last))
    return {"count": count, "is_last": dist.get_rank() == last}


@scenario
def failure_leaves_nothing() -> dict[str, Any]:
    """The writer fails (an extra file it cannot write): every rank raises, no folder."""
    engine = _trained(_gpt2(), 3)
    root = _shared_dir()
    try:
        engine.save_pretrained(root / "out", extra_files={"no/such/dir.json": b"{}"})
        raised = ""
    except CheckpointError as e:
        raised = str(e)
    return {"raised": raised, "left": sorted(os.listdir(root))}


@scenario
def save_into_existing_folder() -> dict[str, Any]:
    """Into a folder holding other files and an earlier indexed save: the other files stay,
    the earlier weights files are replaced."""
    engine = _trained(_gpt2(), 2)
    root = _shared_dir()
    engine.save_pretrained(root, max_shard_size=20_000)
    if dist.get_rank() == 0:
        (root / "trainer_state.json").write_text("{}")
    dist.barrier()
    engine.save_pretrained(root)
    files, full = _files(root), engine.full_state_dict()
    return {"files": sorted(os.listdir(root)),
            "names_equal": set(files) == set(_reference_names(type(engine.module), engine)),
            "differ": sorted(k for k in files if not torch.equal(files[k], full[k]))}


@scenario
def accelerate_save_model() -> dict[str, Any]:
    """ZeroAccelerator.save_model: what Accelerate's save_model writes for the model's state
    dict (its own keys, the tied head once, split at max_shard_size), streamed."""
    from zero_strategy.integrations.accelerate import ZeroAccelerator, ZeroPlugin

    accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(
        stage=3, unit_numel=3000, param_persistence_threshold=0))
    model = _gpt2()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    root = _shared_dir()
    accelerator.save_model(model, root / "acc", max_shard_size=20_000)
    full = accelerator.get_state_dict(model)
    files = _files(root / "acc")
    index = json.loads((root / "acc" / "model.safetensors.index.json").read_text())
    return {"keys": sorted(files), "expected": sorted(k for k in full if k != "lm_head.weight"),
            "differ": sorted(k for k in files if not torch.equal(files[k], full[k])),
            "indexed": set(index["weight_map"]) == set(files)}


def _lora_gpt2() -> Any:
    from peft import LoraConfig, get_peft_model

    model = _gpt2()
    torch.manual_seed(3)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                            fan_in_fan_out=True, lora_dropout=0.0))


@scenario
def peft_adapter_and_merged() -> dict[str, Any]:
    """A LoRA GPT-2 at stage 3: engine.save_pretrained writes the adapter as
    PeftModel.save_pretrained does; hub_weights(merge_lora=True) gives the base model with the
    adapter merged as merge_and_unload() computes it (same ops on the same fp32 values)."""
    engine = _trained(_lora_gpt2(), 3)
    full = engine.full_state_dict()
    root = _shared_dir()
    engine.save_pretrained(root / "ours")
    merged = {k: t.clone() for b in engine.hub_weight_buckets(merge_lora=True, to="all",
                                                                bucket_bytes=8000)
              for k, t in b}
    reference = _lora_gpt2()
    reference.load_state_dict(full)
    if dist.get_rank() == 0:
        reference.save_pretrained(root / "theirs")
    dist.barrier()
    ours_config = json.loads((root / "ours" / "adapter_config.json").read_text())
    theirs_config = json.loads((root / "theirs" / "adapter_config.json").read_text())
    plain = reference.merge_and_unload()
    expected = {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    return {
        "files": sorted(p.name for p in (root / "ours").iterdir()),
        "adapter_differ": _differ(_files(root / "ours"), _files(root / "theirs")),
        "config_equal": ours_config == theirs_config,
        "merged_differ": _differ(merged, expected),
        "lora_trained": any(v.abs().sum() > 0 for k, v in full.items() if "lora_B" in k),
    }


@scenario
def wrapped_model_save() -> dict[str, Any]:
    """A module holding the transformers model as ``self.model`` (a LightningModule, the
    recipes' RecipeModule) beside weights of its own: the export is the transformers model's
    alone, under its own keys, loadable by from_pretrained."""
    from transformers import GPT2LMHeadModel

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()
            self.probe = torch.nn.Linear(4, 4)

        def forward(self, **batch: Any) -> Any:
            return self.model(**batch)

    engine = _trained(Wrapper(), 3)
    root = _shared_dir()
    engine.save_pretrained(root / "hf")
    full = engine.full_state_dict()
    loaded = GPT2LMHeadModel.from_pretrained(root / "hf").state_dict()
    return {"differ": sorted(k for k, v in loaded.items()
                             if not torch.equal(v, full[f"model.{k}"])),
            "keys_equal": set(_files(root / "hf")) == set(
                _reference_names(GPT2LMHeadModel, engine.module.model))}


@scenario
def save_as_bf16() -> dict[str, Any]:
    """dtype=torch.bfloat16: floating tensors cast (round to nearest even, as .to() does
    everywhere), the config records it, from_pretrained(dtype="auto") loads bf16."""
    from transformers import GPT2LMHeadModel

    engine = _trained(_gpt2(), 2)
    root = _shared_dir()
    engine.save_pretrained(root / "bf16", dtype=torch.bfloat16, max_shard_size="20KB")
    full = engine.full_state_dict()
    loaded = GPT2LMHeadModel.from_pretrained(root / "bf16", dtype="auto").state_dict()
    return {"config_dtype": json.loads((root / "bf16" / "config.json").read_text())["dtype"],
            "dtypes": sorted({str(v.dtype) for v in _files(root / "bf16").values()}),
            "differ": sorted(k for k, v in loaded.items()
                             if not torch.equal(v, full[k].to(torch.bfloat16)))}

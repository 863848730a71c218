"""Pretrained Hugging Face weights streamed into the shards against ``Model.from_pretrained``,
for tests/quick/test_pretrained.py (run by tests/support/harness.py at N=2 and N=3).

Each parity scenario builds the same folder twice, with transformers' ``from_pretrained`` and
with ``zero_strategy.integrations.hf.pretrained.from_pretrained``, wraps both in an engine of the
same config and compares everything: the consolidated state dict (bit for bit: both are the
same bytes read from the same file and cast by the same ops, so no tolerance), every buffer
(the non-persistent ones included, which no file holds), the missing and unexpected keys.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs
from tests.support.harness import register, scenario
from zero_strategy.checkpoint.errors import CheckpointError
from zero_strategy.core.materialize import meta_init

STAGES = (0, 1, 2, 3)
_FOLDERS: dict[str, str] = {}


def _config(stage: int, precision: str = "32-true", offload: str | None = None
            ) -> zs.ZeroConfig:
    tiers: dict[str, Any] = {}
    if offload is not None:  # both tiers there; a disk tier's directory is one engine's
        tiers = {"offload_optimizer": offload, "offload_params": offload}
        if offload == "disk":
            tiers["offload_dir"] = tempfile.mkdtemp(prefix="zs-pretrained-tier-")
    if stage == 3:  # many small units: every parameter split over ranks and units
        return zs.ZeroConfig(stage=3, precision=precision, unit_numel=3000,
                             param_persistence_threshold=0, **tiers)
    return zs.ZeroConfig(stage=stage, precision=precision, bucket_numel=5000, **tiers)


def _gpt2_config(width: int = 32) -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=96, n_positions=32, n_embd=width, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _save_all(root: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    tf.GPT2LMHeadModel(_gpt2_config()).save_pretrained(root / "gpt2")
    tf.GPT2LMHeadModel(_gpt2_config()).to(torch.bfloat16).save_pretrained(root / "gpt2_bf16")
    tf.GPT2LMHeadModel(_gpt2_config(64)).save_pretrained(root / "gpt2_sharded",
                                                         max_shard_size="50KB")
    tf.GPT2Model(_gpt2_config()).save_pretrained(root / "gpt2_base")
    bert = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=48,
                         max_position_embeddings=32, num_labels=3)
    tf.BertModel(bert).save_pretrained(root / "bert_base")
    llama = tf.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                           max_position_embeddings=64, rope_theta=500.0)
    tf.LlamaForCausalLM(llama).save_pretrained(root / "llama")


def folders() -> dict[str, str]:
    """Every test folder, written once by rank 0, its path agreed on by every rank."""
    if not _FOLDERS:
        root = [None]
        if dist.get_rank() == 0:
            root[0] = tempfile.mkdtemp(prefix="zs-pretrained-")
            _save_all(Path(root[0]))
        dist.broadcast_object_list(root, src=0)
        assert root[0] is not None
        _FOLDERS.update({p.name: str(p) for p in Path(root[0]).iterdir()})
    return _FOLDERS


def _engine(model: nn.Module, config: zs.ZeroConfig) -> zs.ZeroEngine:
    return zs.ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in dtype, shape or any bit (both dicts have the same keys)."""
    return sorted(k for k in b if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.named_buffers()}


def parity(folder: str, cls: str, stage: int, precision: str = "32-true",
           offload: str | None = None, **kwargs: Any) -> dict[str, Any]:
    import transformers as tf

    from zero_strategy.checkpoint.pretrained import spec_of
    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path, model_class = folders()[folder], getattr(tf, cls)
    torch.manual_seed(1)  # missing weights are drawn: the same generator state for both
    ref, ref_info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    torch.manual_seed(1)
    model, info = from_pretrained(model_class, path, output_loading_info=True, **kwargs)
    on_meta = all(p.is_meta for p in model.parameters())
    spec = spec_of(model)
    assert spec is not None
    plain = {k: v.detach().clone() for k, v in ref.state_dict().items()}  # before wrapping
    ref_engine = _engine(ref, _config(stage, precision, offload))
    engine = _engine(model, _config(stage, precision, offload))
    ours, theirs = engine.full_state_dict(), ref_engine.full_state_dict()
    missing = set(info["missing_keys"])
    return {
        "on_meta": on_meta, "keys_equal": sorted(ours) == sorted(theirs),
        "differ": _differ(ours, theirs),
        # against the model never wrapped: masters hold its values (upcast where mixed)
        "differ_plain": sorted(k for k in plain if k not in missing
                               and not torch.equal(ours[k], plain[k].to(ours[k].dtype))),
        "buffers": sorted(_buffers(model)),
        "buffers_differ": _differ(_buffers(model), _buffers(ref)),
        "missing": sorted(missing), "ref_missing": sorted(ref_info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "ref_unexpected": sorted(ref_info["unexpected_keys"]),
        "dtypes": sorted({str(v.dtype) for v in ours.values()}),
        "sharded_units": sum(u.layout.num_shards > 1 for u in engine.units),
        "eval": not model.training, "weight_files": len(spec.folder.files),
        "loaded": spec.loaded,
    }


for _stage in STAGES:
    register(f"gpt2_fp32_stage{_stage}", parity, folder="gpt2", cls="GPT2LMHeadModel",
             stage=_stage)
    register(f"gpt2_fp32_as_bf16_stage{_stage}", parity, folder="gpt2", cls="GPT2LMHeadModel",
             stage=_stage, precision="bf16-true", dtype=torch.bfloat16)
    register(f"gpt2_bf16_default_stage{_stage}", parity, folder="gpt2_bf16",
             cls="GPT2LMHeadModel", stage=_stage, precision="bf16-mixed")
    register(f"gpt2_bf16_explicit_stage{_stage}", parity, folder="gpt2_bf16",
             cls="GPT2LMHeadModel", stage=_stage, torch_dtype=torch.bfloat16)
    register(f"gpt2_sharded_stage{_stage}", parity, folder="gpt2_sharded",
             cls="GPT2LMHeadModel", stage=_stage)
register("gpt2_offload_cpu_stage3", parity, folder="gpt2", cls="GPT2LMHeadModel", stage=3,
         precision="bf16-mixed", offload="cpu")
register("gpt2_offload_disk_stage3", parity, folder="gpt2", cls="GPT2LMHeadModel", stage=3,
         offload="disk")
register("base_into_head", parity, folder="gpt2_base", cls="GPT2LMHeadModel", stage=3)
register("head_into_base", parity, folder="gpt2", cls="GPT2Model", stage=3)
register("bert_missing_head_stage3", parity, folder="bert_base",
         cls="BertForSequenceClassification", stage=3)
register("bert_missing_head_stage1", parity, folder="bert_base",
         cls="BertForSequenceClassification", stage=1)
register("llama_stage3", parity, folder="llama", cls="LlamaForCausalLM", stage=3)
register("llama_bf16_stage2", parity, folder="llama", cls="LlamaForCausalLM", stage=2,
         precision="bf16-mixed", dtype=torch.bfloat16)


@scenario
def llama_buffers_as_eager() -> dict[str, Any]:
    """Rotary ``inv_freq`` is in no file: it gets what the eager constructor computes."""
    import transformers as tf

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path = folders()["llama"]
    eager = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(path))
    model = from_pretrained(tf.LlamaForCausalLM, path)
    engine = _engine(model, _config(3))
    ours, theirs = _buffers(engine.module), _buffers(eager)
    return {"buffers": sorted(theirs), "differ": _differ(ours, theirs)}


def training(stage: int, precision: str) -> dict[str, Any]:
    """A few AdamW steps from the streamed model and from from_pretrained + engine."""
    from transformers import GPT2LMHeadModel

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path = folders()["gpt2"]
    gen = torch.Generator().manual_seed(2 + dist.get_rank())
    batches = [torch.randint(0, 96, (2, 16), generator=gen) for _ in range(3)]
    runs = []
    for build in (lambda: GPT2LMHeadModel.from_pretrained(path),
                  lambda: from_pretrained(GPT2LMHeadModel, path)):
        engine = _engine(build().train(), _config(stage, precision))
        losses = []
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs.append((losses, engine.full_state_dict()))
    return {"losses": runs[1][0], "ref_losses": runs[0][0],
            "differ": _differ(runs[1][1], runs[0][1])}


for _stage, _precision in ((2, "bf16-mixed"), (3, "32-true")):
    register(f"training_stage{_stage}_{_precision}", training, stage=_stage,
             precision=_precision)


LORA_CASES = {
    # (folder, model class, LoraConfig fields)
    "gpt2_bias": ("gpt2", "GPT2LMHeadModel", {"target_modules": ["c_attn", "c_proj"],
                                              "fan_in_fan_out": True, "lora_bias": True}),
    "gpt2_gaussian": ("gpt2", "GPT2LMHeadModel", {
        "target_modules": ["c_attn"], "fan_in_fan_out": True, "init_lora_weights": "gaussian"}),
    # an embedding target (lora_embedding_A/B) beside linear ones, untied
    "llama_embedding": ("llama", "LlamaForCausalLM", {
        "target_modules": ["embed_tokens", "q_proj", "v_proj"]}),
}


def peft_lora(case: str, stage: int) -> dict[str, Any]:
    """A streamed model wrapped by PEFT's get_peft_model (issue 58): the base weights stream
    in under PEFT's names, the adapters get PEFT's init rule (B zero: the model starts at the
    base model), and training equals the same model loaded whole and wrapped, given the same
    A (A is drawn afresh when the engine is built, so the reference takes ours)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    folder, cls, fields = LORA_CASES[case]
    path, model_class = folders()[folder], getattr(tf, cls)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **fields)
    torch.manual_seed(11)
    streamed = _engine(get_peft_model(from_pretrained(model_class, path), config).train(),
                       _config(stage))
    start = streamed.full_state_dict()
    whole = get_peft_model(model_class.from_pretrained(path), copy.deepcopy(config)).train()
    with torch.no_grad():  # the reference takes our adapters' first values
        for name, p in whole.named_parameters():
            if "lora_" in name:
                p.copy_(start[name])
    reference = _engine(whole, _config(stage))
    ref_start = reference.full_state_dict()
    adapters = {k: v for k, v in start.items() if "lora_" in k}
    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    vocab = 96 if folder == "gpt2" else 64
    batches = [torch.randint(0, vocab, (2, 16), generator=gen) for _ in range(3)]
    losses: dict[str, list[float]] = {"streamed": [], "whole": []}
    for engine, out in ((streamed, losses["streamed"]), (reference, losses["whole"])):
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
    fingerprint = torch.stack([v.double().sum() for v in adapters.values()])
    everyone = [torch.zeros_like(fingerprint) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, fingerprint)
    return {
        "base_differ": _differ({k: v for k, v in start.items() if "lora_" not in k},
                               {k: v for k, v in ref_start.items() if "lora_" not in k}),
        "adapters": {k: [list(v.shape), v.abs().max().item(), v.float().std().item()]
                     for k, v in adapters.items()},
        "fan_in": {k: v.shape[-1] for k, v in adapters.items()},
        "same_on_every_rank": all(torch.equal(e, everyone[0]) for e in everyone),
        "losses": losses["streamed"], "ref_losses": losses["whole"],
        "differ": _differ(streamed.full_state_dict(), reference.full_state_dict()),
    }


for _case in LORA_CASES:
    for _stage in STAGES:
        register(f"peft_{_case}_stage{_stage}", peft_lora, case=_case, stage=_stage)


@scenario
def peft_refusals() -> dict[str, Any]:
    """What PEFT cannot initialise on meta is refused by name when the engine is built."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path = folders()["gpt2"]
    base = {"r": 4, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    messages = {}
    for name, fields in {"dora": {"use_dora": True}, "eva": {"init_lora_weights": "eva"},
                         "modules_to_save": {"modules_to_save": ["lm_head"]}}.items():
        model = get_peft_model(from_pretrained(tf.GPT2LMHeadModel, path),
                               LoraConfig(**base, **fields))
        try:
            _engine(model, _config(3))
            messages[name] = "no error"
        except ValueError as e:
            messages[name] = str(e)
    return messages


@scenario
def inside_a_wrapper_built_in_meta_init() -> dict[str, Any]:
    """What Lightning's ``configure_model`` and Fabric's ``init_module`` do at stage 3: the
    model built inside the strategy's ``meta_init`` (nested), held by another module."""
    from transformers import GPT2LMHeadModel

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    path = folders()["gpt2"]

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = from_pretrained(GPT2LMHeadModel, path)
            self.head = nn.Linear(32, 2)

    torch.manual_seed(3)
    with meta_init("cpu"):
        wrapper = Wrapper()
    engine = _engine(wrapper, _config(3))
    ours = engine.full_state_dict()
    theirs = GPT2LMHeadModel.from_pretrained(path).state_dict()
    torch.manual_seed(3)
    eager_head = nn.Linear(32, 2)
    return {
        "differ": sorted(k for k in theirs if not torch.equal(ours[f"model.{k}"], theirs[k])),
        "head_as_eager": torch.equal(ours["head.weight"], eager_head.weight.detach()),
    }


@scenario
def load_pretrained_into_an_engine() -> dict[str, Any]:
    """``engine.load_pretrained`` on an engine built eagerly (random weights): the folder's
    weights, the keys it reports, strict refusing a missing head and changing nothing."""
    import transformers as tf

    paths = folders()
    torch.manual_seed(4)
    engine = _engine(tf.GPT2LMHeadModel(_gpt2_config()), _config(3))
    result = engine.load_pretrained(paths["gpt2"])
    theirs = tf.GPT2LMHeadModel.from_pretrained(paths["gpt2"]).state_dict()
    ours = engine.full_state_dict()
    bert = _engine(tf.BertForSequenceClassification(tf.BertConfig.from_pretrained(
        paths["bert_base"], num_labels=3)), _config(2))
    before = bert.full_state_dict()
    try:
        bert.load_pretrained(paths["bert_base"], strict=True)
        strict = "no error"
    except CheckpointError as e:
        strict = str(e)
    unchanged = not _differ(bert.full_state_dict(), before)
    key_map = _key_map(bert.module)
    relaxed = bert.load_pretrained(paths["bert_base"], strict=False, key_map=key_map)
    return {"result": [list(result.missing_keys), list(result.unexpected_keys)],
            "differ": sorted(k for k in theirs if not torch.equal(ours[k], theirs[k])),
            "strict": strict, "unchanged": unchanged,
            "relaxed": [sorted(relaxed.missing_keys), sorted(relaxed.unexpected_keys)],
            "back_after_training": _back_after_training(paths["gpt2_base"])}


def _back_after_training(path: str) -> list[Any]:
    """A base checkpoint into a head model from from_pretrained: trained a step, then loaded
    again without a key map (the one it was built with: the prefix is added)."""
    from transformers import GPT2LMHeadModel

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    engine = _engine(from_pretrained(GPT2LMHeadModel, path).train(), _config(3))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    trained = engine.full_state_dict()
    result = engine.load_pretrained(path)
    loaded = engine.full_state_dict()
    base = GPT2LMHeadModel.from_pretrained(path).state_dict()
    return [list(result), _differ(loaded, base), _differ(trained, base) != []]


def _key_map(model: nn.Module) -> Any:
    from zero_strategy.integrations.hf.pretrained import key_map_for

    return key_map_for(model)


@scenario
def bad_folders_change_nothing() -> dict[str, Any]:
    """Each broken folder refused with a CheckpointError naming the file and key, on every
    rank, before the engine changes; also when only one rank's folder is broken."""
    from tests.support.pretrained_files import CASES, broken_folders

    paths = folders()
    engine = _engine(_gpt2(), _config(3))
    before = engine.full_state_dict()
    root = [None]
    if dist.get_rank() == 0:
        root[0] = tempfile.mkdtemp(prefix="zs-pretrained-bad-")
        broken_folders(Path(paths["gpt2"]), Path(root[0]))
    dist.broadcast_object_list(root, src=0)
    messages = {}
    for case in [*CASES, "one_rank_truncated"]:
        path = Path(root[0], case)
        if case == "one_rank_truncated":  # only the last rank sees a broken folder
            last = dist.get_rank() == dist.get_world_size() - 1
            path = Path(root[0], "truncated") if last else Path(paths["gpt2"])
        try:
            engine.load_pretrained(path, key_map=_key_map(engine.module))
            messages[case] = "no error"
        except CheckpointError as e:
            messages[case] = str(e)
    return {"messages": messages, "unchanged": not _differ(engine.full_state_dict(), before)}


def _gpt2() -> nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(5)
    return GPT2LMHeadModel(_gpt2_config())

"""Folders transformers converts when it loads them (experts saved one by one and fused in the
model, fused projections split, weights transposed, rotary rows permuted), streamed into the
shards: each rank reads only the source slices its ranges are made of.

- ``checkpoint/conversions.py``'s range reads against the whole target computed by torch's
  own ops (``materialize``), over generated shapes and op chains, arbitrary ranges, both read
  modes (runs into place, spans gathered from) and tiny mapping chunks;
- ``integrations/hf/conversions.py``'s replay of each transformers operation against that
  operation's own ``convert`` on real tensors (naming included);
- tiny Qwen3-MoE, Mixtral and HRM-text (a dense family whose fused projections are chunked)
  folders, single-file and indexed, through ``from_pretrained`` + ``ZeroEngine`` at stages 0-3
  and N = 1, 2, 3 against ``Model.from_pretrained`` + the same engine
  (tests/worlds/pretrained_conversions.py, one process group per N), and
  ``engine.load_pretrained``;
- the refusals, by operation, tensor and file.

Every comparison is bit for bit: both sides read the same bytes and only rearrange and cast
them (the same elementwise cast), so there is no tolerance to argue.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.support.harness import check, run_world
from zero_strategy.checkpoint import conversions as cv
from zero_strategy.checkpoint.errors import CheckpointError
from zero_strategy.checkpoint.pretrained import PretrainedFolder

WORLD = "tests/worlds/pretrained_conversions.py"
WORLDS = {  # every stage at N=2; the stage most sensitive to shard bounds at N=1 and N=3
    1: ["mixtral_stage3"],
    2: ["qwen3moe_stage0", "mixtral_stage1", "hrm_stage2", "qwen3moe_indexed_stage3",
        "qwen3moe_indexed_bf16_stage3", "qwen3moe_base_from_head",
        "load_pretrained_into_engine"],
    3: ["qwen3moe_indexed_stage3", "hrm_stage1"],
}


# ---------------------------------------------------------------------------- range reads
def _random_node(rng: random.Random, depth: int, counter: list[int]) -> cv.Node:
    """A random chain over fresh sources: every op kind, shapes small enough to check whole."""
    if depth == 0 or rng.random() < 0.2:
        counter[0] += 1
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        return cv.source(f"s{counter[0]}", shape, torch.float32)
    child = _random_node(rng, depth - 1, counter)
    kind = rng.choice(["cat", "stack", "narrow", "chunk", "transpose", "interleave", "rope",
                       "reshape"])
    dim = rng.randrange(len(child.shape))
    if kind in ("cat", "stack"):
        parts = [child]
        for _ in range(rng.randint(1, 3)):
            counter[0] += 1
            shape = list(child.shape)
            if kind == "cat":
                shape[dim] = rng.randint(1, 4)
            parts.append(cv.source(f"s{counter[0]}", tuple(shape), torch.float32))
        return cv.cat(parts, dim) if kind == "cat" else cv.stack(parts, dim)
    if kind == "narrow":
        n = child.shape[dim]
        start = rng.randrange(n)
        return cv.narrow(child, dim, start, rng.randint(1, n - start))
    if kind == "chunk":
        pieces = cv.chunk(child, rng.randint(1, 3), dim)
        return rng.choice(pieces)
    if kind == "transpose" and len(child.shape) > 1:
        return cv.transpose(child, dim, rng.randrange(len(child.shape)))
    if kind == "interleave":
        return cv.interleave(cv.cat([child, child], dim), dim, rng.random() < 0.5)
    if kind == "rope" and len(child.shape) <= 2:
        heads = rng.randint(1, 2)
        rows = cv.reshape(child, (child.numel,)) if len(child.shape) == 1 else child
        if rows.shape[0] % (2 * heads) == 0:
            return cv.permute_rows_for_rope(rows, heads, rng.random() < 0.5)
    return cv.reshape(child, (child.numel,))


def _tensors_for(node: cv.Node, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {leaf.key: torch.randn(leaf.shape, generator=gen) for leaf in node.leaves()}


def _reader(tensors: dict[str, torch.Tensor], log: list[tuple[str, int]] | None = None):
    def read(key: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if log is not None:
            log.append((key, end - start))
        values = tensors[key].reshape(-1)[start:end]
        return out.copy_(values) if out is not None else values.clone()
    return read


def test_range_reads_equal_the_whole_target_sliced() -> None:
    """80 generated chains (a source may appear twice in one: both reads are checked), three
    ranges each, every read mode; float64 output checks the cast path as well."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    kinds = set()
    for case in range(80):
        node = _random_node(rng, 4, [0])
        kinds.update(type(n).__name__ for n in _walk(node))
        tensors = _tensors_for(node, gen)
        whole = cv.materialize(node, tensors).reshape(-1)
        assert tuple(cv.materialize(node, tensors).shape) == node.shape
        for _ in range(3):
            a = rng.randrange(node.numel)
            b = rng.randint(a, node.numel)
            for step, min_run, dtype in ((3, 1, torch.float32), (7, 10**9, torch.float32),
                                          (cv.CHUNK, cv.MIN_RUN, torch.float64)):
                out = torch.full((b - a,), float("nan"), dtype=dtype)
                cv.read_target(node, a, b, _reader(tensors), out, step=step, min_run=min_run)
                assert torch.equal(out, whole[a:b].to(dtype)), (case, node.shape, a, b, step)
    assert kinds >= {"Source", "Cat", "Narrow", "Transpose", "Reshape"}


def _walk(node: cv.Node):
    yield node
    for child in node.children():
        yield from _walk(child)


def test_a_rank_reads_only_its_experts_and_at_most_one_source_at_once() -> None:
    """A fused ``gate_up_proj`` [E, 2I, H] of 8 experts: the range of experts 3-5 reads only
    their gate and up tensors, each element once (runs into place), or (short runs) one
    span per source, never more than that source."""
    experts, inter, hidden = 8, 64, 1024
    gates = [cv.source(f"g{e}", (inter, hidden), torch.float32) for e in range(experts)]
    ups = [cv.source(f"u{e}", (inter, hidden), torch.float32) for e in range(experts)]
    node = cv.cat([cv.stack(gates, 0), cv.stack(ups, 0)], 1)
    tensors = _tensors_for(node, torch.Generator().manual_seed(1))
    assert cv.block(node) == inter * hidden  # mapped one expert's tensor at a time
    assert cv.block(cv.interleave(node, 1, False)) == hidden  # a row at a time
    assert cv.block(cv.transpose(node, 1, 2)) == 1
    per = 2 * inter * hidden
    a, b = 3 * per, 6 * per
    for min_run, expect_reads in ((inter * hidden, 6), (10**9, 6)):
        log: list[tuple[str, int]] = []
        out = torch.empty(b - a)
        cv.read_target(node, a, b, _reader(tensors, log), out, min_run=min_run)
        assert torch.equal(out, cv.materialize(node, tensors).reshape(-1)[a:b])
        assert sorted({k for k, _ in log}) == ["g3", "g4", "g5", "u3", "u4", "u5"]
        assert sum(n for _, n in log) == b - a  # each element read once
        assert max(n for _, n in log) <= inter * hidden  # one source at most
        assert min_run > inter * hidden or len(log) == expect_reads  # whole tensors in place
    transposed = cv.transpose(node, 1, 2)  # runs of one element: spans, gathered from
    log = []
    out = torch.empty(per)
    cv.read_target(transposed, 2 * per, 3 * per, _reader(tensors, log), out)
    assert torch.equal(out, cv.materialize(transposed, tensors).reshape(-1)[2 * per:3 * per])
    assert sorted(log) == [("g2", inter * hidden), ("u2", inter * hidden)]


# ---------------------------------------------------------------------------- transformers ops
core = pytest.importorskip("transformers.core_model_loading")
hf_conv = pytest.importorskip("zero_strategy.integrations.hf.conversions")
needs_streaming = pytest.mark.skipif(  # the range reads above need no transformers
    hf_conv._release() < hf_conv.STREAMED_FROM,
    reason="converted keys stream from transformers 5.23 on (older ones refuse them by name)")
CASES = ["merge_concat", "merge", "chunk", "interleave", "interleave_chunk", "transpose",
         "transpose_check_same", "transpose_check_differs", "chunk_rope", "rope", "split",
         "concatenate", "split_modulelist", "conv3d"]


class _Config:
    num_attention_heads = 2

    def get_text_config(self) -> _Config:
        return self


class _Model:
    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], device="meta")


def _cases() -> list[tuple[str, Any, dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]]:
    """(name, converter, folder tensors' shapes, model shapes) for each operation and chain
    transformers 5.x mappings use."""
    experts = {f"layers.0.mlp.experts.{e}.{p}.weight": (6, 4)
               for e in range(12) for p in ("gate_proj", "up_proj", "down_proj")}
    op = core
    cases = [
        ("merge_concat", core.WeightConverter(
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            "mlp.experts.gate_up_proj", [op.MergeModulelist(dim=0), op.Concatenate(dim=1)]),
         experts, {}),
        ("merge", core.WeightConverter("mlp.experts.*.down_proj.weight",
                                       "mlp.experts.down_proj", [op.MergeModulelist(dim=0)]),
         experts, {}),
        ("chunk", core.WeightConverter("attn.qkv.weight", ["attn.q.weight", "attn.k.weight",
                                                           "attn.v.weight"], [op.Chunk(dim=0)]),
         {"h.1.attn.qkv.weight": (12, 5), "h.1.attn.qkv.bias": (12,)}, {}),
        ("interleave", core.WeightConverter("mlp.experts.w13_weight",
                                            "mlp.experts.gate_up_proj", [op.Interleave(dim=1)]),
         {"layers.3.mlp.experts.w13_weight": (3, 8, 5)}, {}),
        ("interleave_chunk", core.WeightConverter(
            "mlp.w13.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            [op.Interleave(dim=0), op.Chunk(dim=0)]), {"l.0.mlp.w13.weight": (8, 3)}, {}),
        ("transpose", core.WeightConverter("experts.gate_and_up", "experts.gate_up_proj",
                                           [op.Transpose(1, 2)]),
         {"m.experts.gate_and_up": (3, 4, 6)}, {}),
        ("transpose_check_same", core.WeightConverter(
            "experts.down", "experts.down_proj", [op.Transpose(1, 2, check_dims=True)]),
         {"m.experts.down": (3, 4, 6)}, {"m.experts.down_proj": (3, 4, 6)}),
        ("transpose_check_differs", core.WeightConverter(
            "experts.down", "experts.down_proj", [op.Transpose(1, 2, check_dims=True)]),
         {"m.experts.down": (3, 4, 6)}, {"m.experts.down_proj": (3, 6, 4)}),
        ("chunk_rope", core.WeightConverter(
            r"self_attn\.in_proj\.weight",
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            [op.Chunk(dim=0), op.PermuteForRope(permute_layer_names=["q_proj", "k_proj"])]),
         {"l.2.self_attn.in_proj.weight": (24, 3)}, {}),
        ("rope", core.WeightConverter(r"attention\.wq\.", "attention.q_proj.",
                                      [op.PermuteForRope()]),
         {"v.attention.wq.weight": (8, 3), "v.attention.wq.bias": (8,)}, {}),
        ("split", core.WeightConverter("attn.att_proj", ["attn.q_proj", "attn.k_proj",
                                                         "attn.v_proj"], [op.Split(dim=0)]),
         {"b.attn.att_proj.weight": (16, 4)},
         {"b.attn.q_proj.weight": (8, 4), "b.attn.k_proj.weight": (4, 4),
          "b.attn.v_proj.weight": (4, 4)}),
        ("concatenate", core.WeightConverter(
            ["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
             "self_attn.v_conv1d.weight"], "self_attn.conv1d.weight", [op.Concatenate(dim=0)]),
         {f"l.0.self_attn.{p}_conv1d.weight": (n, 1, 3) for p, n in
          (("q", 4), ("k", 2), ("v", 2))}, {}),
        ("split_modulelist", core.WeightConverter(
            "mlp.experts.down_proj", "mlp.experts.*.down_proj.weight",
            [op.SplitModulelist(dim=0)]), {"l.0.mlp.experts.down_proj": (4, 3, 2)}, {}),
    ]
    if hasattr(op, "Conv3dToLinear"):
        cases.append(("conv3d", core.WeightConverter(
            "patch_embed.proj.weight", "patch_embed.linear.weight",
            [op.Conv3dToLinear(in_channels=2, kernel_size=(1, 2, 2))]),
            {"v.patch_embed.proj.weight": (5, 2, 1, 2, 2)}, {}))
    return cases


def _folder(tmp: Path, tensors: dict[str, torch.Tensor]) -> PretrainedFolder:
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    return PretrainedFolder(tmp)


def _transformers_convert(converter: Any, tensors: dict[str, torch.Tensor],
                          model: _Model) -> dict[str, torch.Tensor]:
    """What ``convert_and_load_state_dict_in_model`` does with these keys: rename, group by
    renamed key (natural key order), run the converter's own ``convert``."""
    groups: dict[str, Any] = {}
    for key in sorted(tensors, key=core.dot_natural_key):
        renamed, pattern = core.rename_source_key(key, [], [converter])
        if pattern is None:
            continue
        group = groups.setdefault(renamed, copy.deepcopy(converter))
        group.add_tensor(renamed, key, pattern, lambda t=tensors[key]: t)
    out = {}
    for name, group in groups.items():
        out.update({k: v[0] if isinstance(v, list) else v for k, v in
                    group.convert(name, model=model, config=_Config()).items()})
    return out


@needs_streaming
@pytest.mark.parametrize("case", CASES)
def test_each_operation_replays_transformers_own(tmp_path: Path, case: str) -> None:
    found = [c for c in _cases() if c[0] == case]
    if not found:
        pytest.skip(f"this transformers has no {case}")
    name, converter, shapes, model_shapes = found[0]
    gen = torch.Generator().manual_seed(3)
    tensors = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    theirs = _transformers_convert(converter, tensors, _Model(model_shapes))
    folder = _folder(tmp_path / name, tensors)
    plan = hf_conv._Planner([], [converter], _Config(), "Model", core.dot_natural_key)(
        folder, lambda k: model_shapes.get(k, ()))
    assert sorted(plan.targets) == sorted(theirs)
    for key, node in plan.targets.items():
        ours = cv.materialize(node, tensors)
        assert ours.shape == theirs[key].shape and torch.equal(ours, theirs[key]), key
        out = torch.empty(node.numel)
        cv.read_target(node, 0, node.numel, folder.read, out, step=5)
        assert torch.equal(out, theirs[key].reshape(-1)), key
    assert set(plan.consumed) == {k for k in tensors if core.rename_source_key(
        k, [], [converter])[1] is not None}


# ---------------------------------------------------------------------------- refusals
class _Opaque(core.ConversionOps):
    def convert(self, input_dict: dict, source_patterns: list, target_patterns: list,
                **kwargs: Any) -> dict:
        return input_dict


@needs_streaming
def test_an_operation_without_a_streamed_form_is_refused_by_name(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"l.0.mix.weight": torch.zeros(4, 2)})
    converter = core.WeightConverter("mix.weight", "mixed.weight", [_Opaque()])
    with pytest.raises(CheckpointError) as e:
        hf_conv._Planner([], [converter], _Config(), "TinyModel", core.dot_natural_key)(
            folder, lambda k: ())
    text = str(e.value)
    assert "_Opaque" in text and "'l.0.mix.weight'" in text and str(folder.path) in text
    assert "TinyModel.from_pretrained(path)" in text and "no streamed form" in text


@needs_streaming
def test_shapes_an_operation_cannot_take_are_refused_before_reading(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"e.mlp.experts.w13_weight": torch.zeros(2, 5, 3)})
    converter = core.WeightConverter("mlp.experts.w13_weight", "mlp.experts.gate_up_proj",
                                     [core.Interleave(dim=1)])
    with pytest.raises(CheckpointError, match=r"Interleave .*odd"):
        hf_conv._Planner([], [converter], _Config(), "M", core.dot_natural_key)(
            folder, lambda k: ())


@needs_streaming
def test_a_converted_tensor_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    import transformers as tf

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    config = tf.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                               moe_intermediate_size=8, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                               num_experts=3, num_experts_per_tok=1)
    tf.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight' \(with 2 more, "
                                              r"converted\) make shape \[3, 16, 8\], model key "
                                              r"'model\.layers\.0\.mlp\.experts\.down_proj' "
                                              r"needs \[3, 16, 12\]"):
        from_pretrained(tf.Qwen3MoeForCausalLM, tmp_path, moe_intermediate_size=12)
    config.quantization_config = {"quant_method": "fp8"}
    config.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"quantization_config.*'fp8'.*cannot be "
                                              "streamed"):
        from_pretrained(tf.Qwen3MoeForCausalLM, tmp_path)


# ---------------------------------------------------------------------------- models
@pytest.fixture(scope="module", params=sorted(WORLDS))
def world(request: pytest.FixtureRequest) -> tuple[int, dict]:
    n = request.param
    return n, run_world(WORLD, n, env={"ZS_ONLY": ",".join(WORLDS[n])})


@needs_streaming
def test_equals_transformers_from_pretrained(world: tuple[int, dict]) -> None:
    n, results = world
    for name in WORLDS[n]:
        for rank, r in enumerate(check(results[name])):
            where = f"N={n} {name} rank {rank}: {r}"
            if name == "load_pretrained_into_engine":
                assert r["differ"] == [] and r["missing"] == r["unexpected"] == [], where
                assert r["changed"] > 0, where
                continue
            assert r["loaded"] and r["converted"] >= 4, where  # the fused tensors streamed
            assert r["keys_equal"] and r["differ"] == [] and r["differ_plain"] == [], where
            assert r["missing"] == r["ref_missing"], where
            assert r["unexpected"] == r["ref_unexpected"], where
            assert ("indexed" in name or "mixtral" in name) == (r["files"] > 1), where


@needs_streaming
def test_converted_keys_the_model_lacks_are_reported_as_transformers_reports_them(
        tmp_path: Path) -> None:
    """A two-layer MoE folder loaded as one layer: layer 1's experts are unexpected, named
    by the targets they would have made, exactly as transformers names them."""
    import transformers as tf

    from zero_strategy.integrations.hf.pretrained import from_pretrained

    config = tf.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, num_local_experts=3,
                              num_experts_per_tok=1)
    tf.MixtralForCausalLM(config).save_pretrained(tmp_path)
    _, theirs = tf.MixtralForCausalLM.from_pretrained(tmp_path, num_hidden_layers=1,
                                                      output_loading_info=True)
    with pytest.warns(UserWarning, match="were not used"):
        _, ours = from_pretrained(tf.MixtralForCausalLM, tmp_path, num_hidden_layers=1,
                                  output_loading_info=True)
    assert ours["unexpected_keys"] == theirs["unexpected_keys"]
    assert "model.layers.1.mlp.experts.gate_up_proj" in ours["unexpected_keys"]
    assert ours["missing_keys"] == theirs["missing_keys"] == set()


@needs_streaming
def test_every_operation_in_transformers_mappings_streams_or_is_named() -> None:
    """Every operation transformers' own conversion mappings use has a streamed form, but the
    Ernie-VL experts' fuse-and-split (a vision-language model, refused by name as any other)."""
    mapping = pytest.importorskip("transformers.conversion_mapping")
    build = getattr(mapping, "_build_checkpoint_conversion_mapping", None)
    if build is None:
        pytest.skip("this transformers builds its mappings another way")
    used = {type(op).__name__ for transforms in build().values() for t in transforms
            if isinstance(t, core.WeightConverter) for op in t.operations}
    assert used - set(hf_conv._HANDLERS) <= {"ErnieFuseAndSplitTextVisionExperts"}, used
    assert {"MergeModulelist", "Concatenate", "Chunk", "Interleave", "Transpose",
            "PermuteForRope", "Split"} <= used

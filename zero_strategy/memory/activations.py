"""Activation memory of the shipped model families, from their shapes: what autograd holds
for backward at the end of the forward, with or without activation checkpointing.

"Activation bytes" are the bytes of the distinct storages that autograd packs for backward
(what ``torch.autograd.graph.saved_tensors_hooks`` sees), each storage once, parameters and
buffers left out. Each figure below is read off what the op saves, argued where it is
counted, not fitted; ``tests/quick/test_activation_formula.py`` measures them.

Notation: b batch, s sequence length, h width, a heads, I the MLP width, V the vocabulary,
e the bytes of the compute dtype (4 under ``32-true``, 2 under the others: the engine runs
the forward on low-precision copies of the weights, not under autocast, so every activation
is in the compute dtype unless an op says otherwise).

With checkpointing, each block (GPT-2's ``transformer.h[i]``, BERT's
``bert.encoder.layer[i]``, each ResNet residual block) runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only the
block's input, and backward recomputes one block at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

PRECISION_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2}
DEVICES = ("cpu", "cuda")
FAMILIES = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
            "resnet": "ResNetForImageClassification"}
# The classes a checkpoint may wrap, and the granularity each means. True picks what the
# engine's ZeroConfig(activation_checkpointing=True) picks: transformers' checkpointable
# layers (GPT2Block, BertLayer), else the outermost list of two or more modules of one class,
# which in ResNet is the list of stages.
BLOCK_CLASSES = {"gpt2": {"GPT2Block": "block"}, "bert": {"BertLayer": "block"},
                 "resnet": {"ResNetBasicLayer": "block", "ResNetBottleNeckLayer": "block",
                            "ResNetStage": "stage"}}
# Distinct storages an MLP activation saves per element of its input, its output included
# (that is the next Linear's saved input). gelu_new is Python arithmetic:
# 0.5*x * (1 + tanh(c*(x + 0.044715*x**3))): pow saves x, tanh its result, and the last
# product both factors (0.5*x and 1+tanh) -- four, plus the output. F.gelu (exact or tanh)
# and SiLU save their input, ReLU only its output.
ACTIVATION_SAVES = {"gelu_new": 5, "gelu": 2, "gelu_pytorch_tanh": 2, "silu": 2, "swish": 2,
                    "relu": 1}
INDEX_BYTES = 8  # int64 token ids, targets, max-pool indices


@dataclass(frozen=True)
class BlockActivations:
    name: str
    """The checkpointed module, e.g. ``transformer.h.3``."""
    input_bytes: int
    """Its input: all that a checkpoint keeps of the block until backward."""
    saved_bytes: int
    """What the block saves when it is not checkpointed (its input included), which is also
    what recomputing it under checkpointing holds again during its backward."""
    transient_bytes: int
    """Gradients alive while its backward runs (see ``_transient``)."""


@dataclass(frozen=True)
class ActivationEstimate:
    family: str
    batch_size: int
    seq_len: int
    """Tokens per sample; for ResNet the image side (``image_size``)."""
    precision: str
    checkpointing: bool
    device: str
    attention: str
    """``flash`` (fused SDPA, saves q, k, v, output and the log-sum-exp), ``math`` (SDPA's
    decomposed path: the s x s probabilities), ``none`` (ResNet)."""
    saved_bytes: int
    """Held by autograd at the end of the forward."""
    peak_bytes: int
    """``saved_bytes`` plus the largest transient of backward: the loss's gradients over
    the logits, or one block's gradients; with checkpointing, plus one block recomputed."""
    outside_bytes: int
    """Saved outside the blocks: embeddings, final norm, head, loss."""
    blocks: tuple[BlockActivations, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _granularity(checkpointing: bool | Sequence[str], family: str, config: Any) -> str | None:
    """None (no checkpointing), "block" or "stage" (ResNet's stages, each of its blocks
    recomputed together), from True/False or the engine's list of class names."""
    if isinstance(checkpointing, bool):
        if not checkpointing:
            return None
        if family == "resnet" and len(config.hidden_sizes) < 2:
            return "block"  # one stage: the outermost repeated list is its blocks
        return "stage" if family == "resnet" else "block"
    if isinstance(checkpointing, str) or not isinstance(checkpointing, Sequence):
        raise ValueError(f"checkpointing must be a bool or a list of class names, got "
                         f"{checkpointing!r}")
    known = BLOCK_CLASSES[family]
    chosen = {known[n] for n in checkpointing if n in known}
    if len(chosen) != 1 or set(checkpointing) - set(known):
        raise ValueError(f"checkpointing={list(checkpointing)}: the {family} estimate covers "
                         f"one of {sorted(known)} (or True / False)")
    # An outer checkpointed stage holds its blocks unwrapped (the engine does not nest).
    return "stage" if "stage" in chosen else chosen.pop()


def _config_of(model_or_config: Any) -> tuple[Any, str]:
    config = getattr(model_or_config, "config", model_or_config)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"model_or_config: model_type {family!r} is not estimated; supported: "
                         f"{', '.join(f'{k} ({v})' for k, v in FAMILIES.items())}")
    if config is not model_or_config and type(model_or_config).__name__ != FAMILIES[family]:
        raise ValueError(f"model_or_config: a {type(model_or_config).__name__}; the {family} "
                         f"estimate is for {FAMILIES[family]} (the recipes' model)")
    return config, family


def estimate_activations(
    model_or_config: Any, *, batch_size: int, seq_len: int | None = None,
    image_size: int | None = None, precision: str = "32-true",
    checkpointing: bool | Sequence[str] = False, device: str = "cpu",
) -> ActivationEstimate:
    """Predicted activation bytes of one training forward (per rank: ``batch_size`` is the
    micro-batch one rank runs) of a GPT2LMHeadModel, BertForMaskedLM or
    ResNetForImageClassification, or of the one its transformers config builds, in training
    mode with the loss computed from labels.

    ``seq_len`` for GPT-2 and BERT, ``image_size`` (square images) for ResNet.
    ``checkpointing``: True (what ``ZeroConfig(activation_checkpointing=True)`` wraps: each
    GPT2Block / BertLayer, each ResNetStage), or the engine's list of class names, one of
    GPT2Block, BertLayer, ResNetBasicLayer / ResNetBottleNeckLayer (each residual block) or
    ResNetStage. ``device``: ops save differently on ``cpu`` and ``cuda`` (dropout masks, SDPA's
    kernel); the ``cuda`` figures are argued from the kernels, the ``cpu`` ones measured."""
    config, family = _config_of(model_or_config)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len),
                        ("image_size", image_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if precision.endswith("-autocast"):
        raise ValueError(
            f"precision={precision!r}: the activation formula covers forwards on weights of "
            f"one dtype ({sorted(PRECISION_BYTES)}); under autocast each op picks its own "
            "dtype and keeps the low-precision casts of the weights it used for backward, "
            "which the formula does not model")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    unit = _granularity(checkpointing, family, config)
    sizes = _Sizes(e=PRECISION_BYTES[precision], cuda=device == "cuda")
    if family == "resnet":
        if image_size is None:
            raise ValueError("image_size is required for resnet (the side of a square image)")
        length, parts = image_size, _resnet(config, batch_size, image_size, sizes,
                                            by_stage=unit == "stage")
    else:
        if seq_len is None:
            raise ValueError(f"seq_len is required for {family}")
        if family == "gpt2":
            # Checkpointing turns the KV cache off while training (transformers' switch, which
            # the engine uses): a recomputed layer would fill it twice.
            parts = _gpt2(config, batch_size, seq_len, sizes,
                          cache=bool(config.use_cache) and unit is None)
        else:
            parts = _bert(config, batch_size, seq_len, sizes)
        length = seq_len
    return _assemble(parts, unit is not None, family=family, batch_size=batch_size, seq_len=length,
                     precision=precision, device=device)


@dataclass(frozen=True)
class _Sizes:
    """Bytes per element of what the ops save, by kind."""

    e: int
    cuda: bool

    @property
    def stats(self) -> int:
        """LayerNorm's mean/rstd and BatchNorm's saved mean/invstd: in the input's dtype on
        the CPU (measured: bf16 under bf16), fp32 in the CUDA kernels."""
        return 4 if self.cuda else self.e

    @property
    def mask(self) -> int:
        """A dropout mask: on CUDA ``native_dropout`` saves a bool mask; on the CPU dropout is
        ``input * noise`` with the noise (already divided by 1-p) in the input's dtype,
        which the multiplication saves."""
        return 1 if self.cuda else self.e

    @property
    def math_attention(self) -> int:
        """SDPA's math path on the CPU upcasts bf16/fp16 q, k, v to fp32 and saves its
        intermediates (scaled q, k, the copied v, the probabilities) in fp32."""
        return 4 if not self.cuda else self.e


@dataclass(frozen=True)
class _Parts:
    attention: str
    outside: int
    """Saved whether or not the blocks are checkpointed (embeddings, head, loss)."""
    blocks: list[tuple[str, int, int, int]]
    """(name, input bytes, saved bytes with the input, largest tensor in the block)."""
    after_blocks: int
    """The last block's output, when the head saves it and the block does not."""
    head_transient: int
    chained: bool = False
    """Each block saves its own output, which is the next block's input (ResNet): without
    checkpointing, a block's input is counted in the block before it."""


def _assemble(parts: _Parts, ckpt: bool, **describe: Any) -> ActivationEstimate:
    blocks = tuple(BlockActivations(name, inp, saved, _transient(largest, inp))
                   for name, inp, saved, largest in parts.blocks)
    if ckpt:
        saved = parts.outside + parts.after_blocks + sum(b.input_bytes for b in blocks)
        block_peak = max((b.saved_bytes + b.transient_bytes for b in blocks), default=0)
    else:
        saved = parts.outside + parts.after_blocks + sum(b.saved_bytes for b in blocks)
        if parts.chained:
            saved -= sum(b.input_bytes for b in blocks[1:])
        block_peak = max((b.transient_bytes for b in blocks), default=0)
    return ActivationEstimate(
        **describe, checkpointing=ckpt, attention=parts.attention, saved_bytes=saved,
        peak_bytes=saved + max(parts.head_transient, block_peak),
        outside_bytes=parts.outside + parts.after_blocks, blocks=blocks)


def _transient(largest: int, boundary: int) -> int:
    """Gradients alive in one block's backward: the gradient of the residual stream (the
    block's input size), and at the op with the largest output, the gradient arriving at it
    and the one it produces."""
    return boundary + 2 * largest


def _attention_kind(config: Any, attention_dropout: float, cuda: bool) -> str:
    impl = getattr(config, "_attn_implementation", None) or "sdpa"  # a built model's default
    if impl != "sdpa":
        raise ValueError(f"attention implementation {impl!r} is not estimated; supported: "
                         "'sdpa' (transformers' default for a model built from a config)")
    # On the CPU, SDPA picks its fused flash kernel only without dropout (measured: with
    # attention dropout it decomposes into the math path); CUDA's fused kernels take dropout.
    return "flash" if cuda or attention_dropout == 0 else "math"


def _attention(kind: str, b: int, s: int, h: int, a: int, z: _Sizes, p_attn: float) -> int:
    """Bytes SDPA saves beyond its q/k/v inputs' producer, and the merged heads the output
    projection saves."""
    bsh = b * s * h
    if kind == "flash":
        # The fused kernel saves q, k, v, its output and the log-sum-exp (b*a*s, fp32); its
        # output is laid out (b, s, a, d), so merging heads for the projection is a view.
        return z.e * bsh + 4 * b * a * s
    x = z.math_attention
    # Math path: q and k scaled by sqrt(scale) (new tensors), v reshaped to (b*a, s, d)
    # (a copy: heads are a strided view), the softmax output; with dropout also the noise
    # and the dropped probabilities the second bmm saves. The output bmm's result is
    # transposed back and copied when heads are merged for the projection (e bytes).
    probs = b * a * s * s * (3 if p_attn > 0 else 1)
    return x * 3 * bsh + x * probs + z.e * bsh


def _mlp_saves(act: str, field: str) -> int:
    if act not in ACTIVATION_SAVES:
        raise ValueError(f"{field}={act!r} is not estimated; supported: "
                         f"{', '.join(sorted(ACTIVATION_SAVES))}")
    return ACTIVATION_SAVES[act]


def _loss(b_s: int, vocab: int, logit_bytes: int) -> int:
    """Cross-entropy: log_softmax saves its output (rows x vocab), nll_loss the int64
    targets and a scalar total weight (in the logits' dtype)."""
    return logit_bytes * b_s * vocab + INDEX_BYTES * b_s + logit_bytes


def _gpt2(config: Any, b: int, s: int, z: _Sizes, cache: bool) -> _Parts:
    h, a, vocab, layers = config.n_embd, config.n_head, config.vocab_size, config.n_layer
    inner = config.n_inner or 4 * h
    bsh, bsi, e = b * s * h, b * s * inner, z.e
    kind = _attention_kind(config, config.attn_pdrop, z.cuda)
    layer_norm = 2 * z.stats * b * s + e * bsh  # mean, rstd and the output the Linear saves
    resid_masks = (2 * z.mask * bsh) if config.resid_pdrop > 0 else 0
    attention = _attention(kind, b, s, h, a, z, config.attn_pdrop)
    if kind == "flash":
        # q, k, v are views of c_attn's (b, s, 3h) output, which the kernel keeps whole; with
        # use_cache (on by default) k and v are first concatenated into the DynamicCache, so
        # the kernel saves those copies instead of views.
        attention += e * 3 * bsh + (e * 2 * bsh if cache else 0)
    block = (e * bsh + layer_norm + attention + resid_masks + e * bsh + layer_norm
             + e * bsi * _mlp_saves(config.activation_function, "activation_function"))
    largest = e * max(bsi, bsh * 3)
    # Token ids (b, s) and position ids (1, s) for the embeddings' backward; with embedding
    # dropout its noise (the sum it multiplies is not saved).
    embeddings = INDEX_BYTES * (b * s + s) + (z.mask * bsh if config.embd_pdrop > 0 else 0)
    # ln_f saves the last block's output (after_blocks), its stats and output (the LM head's
    # input); the loss upcasts logits to fp32 first (transformers' ForCausalLMLoss), so
    # log_softmax saves fp32 over b*s rows (labels are shifted, logits not sliced).
    head = 2 * z.stats * b * s + e * bsh + _loss(b * s, vocab, 4)
    # The targets are the labels padded by one and sliced: ``.contiguous()`` copies them,
    # except for a single row, where the slice is contiguous and keeps the padded storage.
    head += INDEX_BYTES if b == 1 else 0
    cast = e * b * s * vocab if e != 4 else 0  # the gradient cast back to the logits' dtype
    return _Parts(kind, embeddings + head,
                  [(f"transformer.h.{i}", e * bsh, block, largest) for i in range(layers)],
                  after_blocks=e * bsh, head_transient=2 * 4 * b * s * vocab + cast)


def _bert(config: Any, b: int, s: int, z: _Sizes) -> _Parts:
    h, a, vocab = config.hidden_size, config.num_attention_heads, config.vocab_size
    inner, layers, e = config.intermediate_size, config.num_hidden_layers, z.e
    bsh, bsi = b * s * h, b * s * inner
    kind = _attention_kind(config, config.attention_probs_dropout_prob, z.cuda)
    masks = (2 * z.mask * bsh) if config.hidden_dropout_prob > 0 else 0
    stats = 2 * z.stats * b * s
    attention = _attention(kind, b, s, h, a, z, config.attention_probs_dropout_prob)
    if kind == "flash":
        attention += e * 3 * bsh  # query, key, value: three Linears' own outputs
    # Post-norm: input (the q/k/v Linears' input), attention, the residual sums LayerNorm
    # saves (twice) with their stats, the first norm's output (the intermediate Linear's
    # input), the MLP activation; the second norm's output is the next block's input.
    block = (e * bsh + attention + masks + e * bsh + stats + e * bsh
             + e * bsi * _mlp_saves(config.hidden_act, "hidden_act") + e * bsh + stats)
    largest = e * max(bsi, bsh)
    # Token ids (b, s), token-type ids (expanded from (1, s)); the embedding sum LayerNorm
    # saves, its stats, and the dropout noise behind it.
    embeddings = (INDEX_BYTES * (b * s + s) + e * bsh + stats
                  + (z.mask * bsh if config.hidden_dropout_prob > 0 else 0))
    # MLM head: dense (saves the last block's output, after_blocks), activation, LayerNorm
    # (stats, output for the decoder); CrossEntropyLoss on the logits as they are (no upcast).
    head = (e * bsh * _mlp_saves(config.hidden_act, "hidden_act") + stats + e * bsh
            + _loss(b * s, vocab, e))
    return _Parts(kind, embeddings + head,
                  [(f"bert.encoder.layer.{i}", e * bsh, block, largest) for i in range(layers)],
                  after_blocks=e * bsh, head_transient=2 * e * b * s * vocab)


def _conv_side(side: int, stride: int) -> int:
    # 3x3 (padding 1), 7x7 (padding 3) and 1x1 (padding 0) convolutions and the 3x3 max-pool
    # (padding 1) all give floor((side - 1) / stride) + 1.
    return (side - 1) // stride + 1


def _resnet_block(c_in: int, c_out: int, stride: int, side: int, config: Any, b: int,
                  z: _Sizes) -> tuple[int, int, int]:
    """(saved bytes without the input, largest feature map, output side) of one residual
    block: each conv's output (BatchNorm's input) with BatchNorm's two per-channel stats,
    each ReLU's output (also the next conv's input), the block's final ReLU output."""
    out = _conv_side(side, stride)
    if config.layer_type == "bottleneck":
        mid = c_out // 4  # transformers' ResNetBottleNeckLayer(reduction=4)
        first = out if config.downsample_in_bottleneck else side
        # 1x1 reduce (+ReLU), 3x3 (+ReLU), 1x1 expand (no activation)
        maps = [(mid, first, 2), (mid, out, 2), (c_out, out, 1)]
    else:
        maps = [(c_out, out, 2), (c_out, out, 1)]  # 3x3 (+ReLU), 3x3 (no activation)
    if c_in != c_out or stride != 1:
        maps.append((c_out, out, 1))  # the 1x1 shortcut conv's output, BatchNorm'd
    maps.append((c_out, out, 1))  # the final activation's output (the block's output)
    saved = sum(z.e * b * c * n * n * k for c, n, k in maps)
    stat_sets = len(maps) - 1
    stats = sum(2 * z.stats * c for c, _, _ in maps[:stat_sets])
    largest = max(z.e * b * c * n * n for c, n, _ in maps)
    return saved + stats, largest, out


def _resnet(config: Any, b: int, side: int, z: _Sizes, by_stage: bool) -> _Parts:
    e, emb = z.e, config.embedding_size
    conv = _conv_side(side, 2)
    pooled = _conv_side(conv, 2)
    # The 7x7 conv saves the image, BatchNorm its output and stats, ReLU its output (the
    # max-pool's input), the pool its int64 indices; the pool's output is block 0's input.
    stem = (e * b * config.num_channels * side * side + 2 * e * b * emb * conv * conv
            + 2 * z.stats * emb + INDEX_BYTES * b * emb * pooled * pooled)
    blocks, channels, n = [], emb, pooled
    for j, (width, depth) in enumerate(zip(config.hidden_sizes, config.depths)):
        stage = []
        for k in range(depth):
            stride = (2 if j > 0 or config.downsample_in_first_stage else 1) if k == 0 else 1
            inp = e * b * channels * n * n
            saved, largest, n = _resnet_block(channels, width, stride, n, config, b, z)
            stage.append((f"resnet.encoder.stages.{j}.layers.{k}", inp, inp + saved, largest))
            channels = width
        if by_stage and stage:
            # A recomputed stage holds all its blocks at once; each block's input is the
            # output the block before it saved, counted there.
            stage = [(f"resnet.encoder.stages.{j}", stage[0][1],
                      sum(s for _, _, s, _ in stage) - sum(i for _, i, _, _ in stage[1:]),
                      max(big for *_, big in stage))]
        blocks += stage
    # The adaptive average pool saves nothing (its backward needs only the input's shape),
    # so under checkpointing the last block's output is not kept.
    # The classifier Linear saves the pooled (b, C) features; cross-entropy in the logits'
    # dtype (ForSequenceClassificationLoss does not upcast).
    head = e * b * channels + _loss(b, config.num_labels, e)
    return _Parts("none", stem + head, blocks, after_blocks=0, chained=True,
                  head_transient=2 * e * b * config.num_labels)

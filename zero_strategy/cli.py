"""The ``zero-strategy`` console command: consolidate checkpoints, print the memory formula
(model states, and with a model's config the activations of a micro-batch), and predict a
step's bytes and time across the links between nodes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from .checkpoint.errors import CheckpointError
from .checkpoint.read import write_consolidated
from .config import PRECISIONS
from .memory import FAMILIES, estimate_activations, estimate_memory

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parse_count(text: str) -> int:
    """'124M', '1.5B', '7e9' or a plain integer."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}.get(text[-1:].lower())
    try:
        value = float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r} (e.g. 124M, 7B)") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"parameter count must be a whole number >= 0: {text!r}")
    return int(value)


def _consolidate(args: argparse.Namespace) -> int:
    dtype = _DTYPES[args.dtype] if args.dtype else None
    if str(args.out).endswith(".ckpt"):  # a Lightning checkpoint, for load_from_checkpoint
        from .integrations import require

        require("lightning", "writing a Lightning .ckpt")
        from .integrations.lightning import consolidate_checkpoint

        try:
            consolidate_checkpoint(args.checkpoint, args.out, tag=args.tag, dtype=dtype)
        except ValueError as e:  # not a ZeroStrategy checkpoint: the message says what to run
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
        return 0
    out = write_consolidated(args.checkpoint, args.out, tag=args.tag, dtype=dtype)
    print(f"wrote {out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .checkpoint.convert import convert

    dtype = _DTYPES[args.dtype] if args.dtype else None
    out = convert(args.source, args.target, args.to, tag=args.tag,
                  trust_pickles=True if args.trust_pickles else None, config=args.config,
                  prefix=args.prefix, dtype=dtype)
    print(f"wrote {out} ({args.to})")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _load_model_config(path: str) -> tuple[Any, int]:
    """A transformers config (a config.json or a directory holding one) and the parameter
    count of the model it builds, counted on the meta device (nothing allocated)."""
    from . import integrations

    integrations.require("transformers", "--model-config")
    from .integrations.hf.model_config import count_parameters, load_config

    config = load_config(path)
    name = FAMILIES.get(getattr(config, "model_type", ""))
    if name is None:
        raise ValueError(f"--model-config: model_type {config.model_type!r}; the activation "
                         f"formula covers {', '.join(sorted(FAMILIES))}")
    return config, count_parameters(config, name)


def _print_activations(args: argparse.Namespace, config: Any) -> None:
    shape = ({"image_size": args.image_size} if config.model_type == "resnet"
             else {"seq_len": args.seq})
    plain, ckpt = (estimate_activations(config, batch_size=args.batch, precision=args.precision,
                                        checkpointing=c, device=args.device, **shape)
                   for c in (False, True))
    size = (f"images {args.image_size}x{args.image_size}" if "image_size" in shape
            else f"sequence {args.seq}")
    print(f"\nactivations per rank, micro-batch {args.batch}, {size}, {args.precision}, "
          f"{args.device} (activation formula)")
    print(f"{'checkpointing':<15}{'saved':>12}{'peak':>12}")
    for name, est in (("none", plain), ("each block", ckpt)):
        print(f"{name:<15}{_human(est.saved_bytes):>12}{_human(est.peak_bytes):>12}")


def _estimate(args: argparse.Namespace) -> int:
    config = None
    try:
        if args.model_config:
            config, counted = _load_model_config(args.model_config)
            args.params = args.params if args.params is not None else counted
        if args.params is None:
            raise ValueError("--params is required without --model-config")
        if config is not None and args.batch is not None:
            _check_activation_args(args, config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    status = _print_model_states(args)
    if status == 0 and config is not None and args.batch is not None:
        _print_activations(args, config)
    return status


def _check_activation_args(args: argparse.Namespace, config: Any) -> None:
    needed = "--image-size" if config.model_type == "resnet" else "--seq"
    if getattr(args, needed[2:].replace("-", "_")) is None:
        raise ValueError(f"{needed} is required for a {config.model_type} activation estimate")


def _print_model_states(args: argparse.Namespace) -> int:
    offload_params = args.offload == "all"
    offload_optimizer = args.offload in ("optimizer", "all")
    rows = []
    for stage in range(4):
        try:
            est = estimate_memory(
                args.params, stage=stage, world_size=args.world_size, precision=args.precision,
                optimizer_states=args.optimizer_states, reduce_dtype=args.reduce_dtype,
                offload_optimizer=offload_optimizer and stage >= 1,
                offload_params=offload_params and stage == 3,
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rows.append((f"zero{stage}", est))
    print(f"{args.params:,} parameters, {args.world_size} ranks, {args.precision}, "
          f"offload={args.offload}: model-state bytes per rank (ZeRO formula)")
    head = f"{'stage':<7}{'params':>12}{'grads':>12}{'optimizer':>12}{'device':>12}" \
           f"{'host':>12}{'total':>12}"
    print(head)
    for name, est in rows:
        if args.stage is not None and name == f"zero{args.stage}":
            name += " *"
        print(f"{name:<7}{_human(est.params_bytes):>12}{_human(est.grads_bytes):>12}"
              f"{_human(est.optimizer_bytes):>12}{_human(est.device_bytes):>12}"
              f"{_human(est.host_bytes):>12}{_human(est.total_bytes):>12}")
    return 0


def _link(args: argparse.Namespace) -> int:
    from .perf.steptime import Rates
    from .perf.variants import predict_variants

    try:
        model, params = None, args.params
        if args.model_config:
            config, _ = _load_model_config(args.model_config)
            model, params = _meta_model(config), None
        elif params is None:
            raise ValueError("--params is required without --model-config")
        compute = _compute_seconds(args, params if model is None else
                                   sum(p.numel() for p in model.parameters()))
        rates = Rates(args.link_gbps * 1e9 / 8 * args.link_efficiency, compute,
                      args.optimizer_s, args.codec_s)
        rows = predict_variants(args.nodes, args.per_node, rates, params=params, model=model,
                                precision=args.precision, backend=args.backend)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.nodes} nodes x {args.per_node} processes, {args.backend}, {args.precision}; "
          f"link {args.link_gbps:g} Gbit/s each way ({rates.link_bytes_per_s / 1e6:.0f} MB/s "
          f"of payload), forward+backward {compute:.3f} s, optimizer {args.optimizer_s:.3f} s "
          "on the whole model")
    print(f"{'':<62}{'MB/step':>9}{'link s':>9}{'step s':>9}{'floor s':>9}{'x floor':>9}")
    for variant, p in rows:
        print(f"{variant.label:<62}{p.link_bytes / 1e6:>9.1f}{p.link_s:>9.3f}"
              f"{p.step_s:>9.3f}{p.floor_s:>9.3f}{p.step_s / p.floor_s:>9.2f}")
    print("MB/step: bytes leaving a node per step (the same arrive); floor: optimizer + "
          "max(link, forward+backward), everything overlapped (docs/multi-node.md)")
    return 0


def _meta_model(config: Any) -> Any:
    from .integrations.hf.model_config import build_meta_model

    return build_meta_model(config, FAMILIES[config.model_type])


def _compute_seconds(args: argparse.Namespace, params: int) -> float:
    """--compute-s as given, or 6 x parameters x tokens / --tflops (8 x with
    --recompute): the forward and backward of one micro-batch on one process."""
    if args.compute_s is not None:
        return args.compute_s
    if args.tflops is None or args.tokens is None:
        raise ValueError("give --compute-s (measured), or --tflops and --tokens")
    return (8 if args.recompute else 6) * params * args.tokens / (args.tflops * 1e12)


def _add_consolidate(sub: Any) -> None:
    """``zero-strategy consolidate``: a checkpoint as one plain state_dict file."""
    c = sub.add_parser("consolidate", help="write a checkpoint as one plain state_dict file")
    c.add_argument("checkpoint", help="checkpoint directory (its 'latest' tag) or a tag directory")
    c.add_argument("out", help="output file: .safetensors (a plain state_dict), or .ckpt for "
                   "LightningModule.load_from_checkpoint (needs a ZeroStrategy checkpoint)")
    c.add_argument("--tag", help="tag to read instead of 'latest'")
    c.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating tensors")
    c.set_defaults(func=_consolidate)


def _add_convert(sub: Any) -> None:
    """``zero-strategy convert``: a checkpoint rewritten as dcp, hf or zero."""
    v = sub.add_parser(
        "convert", help="rewrite a checkpoint (ours, DeepSpeed ZeRO or DCP) as dcp, hf or zero",
        description="Rewrite a checkpoint, ours or DeepSpeed's (ZeRO 1-3) or a "
        "torch.distributed.checkpoint directory (FSDP2, torchtitan, Lightning's sharded FSDP), "
        "as: dcp (for FSDP2's dcp.load + set_state_dict, with the optimizer), hf (a "
        "save_pretrained directory for from_pretrained) or zero (ours). Streamed: memory "
        "stays near the largest tensor.")
    v.add_argument("source", help="checkpoint directory (its 'latest' tag) or a tag directory")
    v.add_argument("target", help="output directory (must not exist, or be empty)")
    v.add_argument("--to", required=True, choices=["dcp", "hf", "zero"])
    v.add_argument("--tag", help="tag to read instead of 'latest'")
    v.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating weights (dcp, hf)")
    v.add_argument("--config", help="hf: a config.json, or a directory holding one")
    v.add_argument("--prefix", help="hf: strip this from every key (default: 'model.' when "
                   "every key has it, as a LightningModule's wrapped model)")
    v.add_argument("--trust-pickles", action="store_true",
                   help="unpickle the source's files with full pickle (runs code they name): "
                   "only for checkpoints you trust as code")
    v.set_defaults(func=_convert)


def _add_estimate(sub: Any) -> None:
    """``zero-strategy estimate``: per-rank memory by the ZeRO formula."""
    e = sub.add_parser("estimate", help="per-rank memory of every stage, by the ZeRO formula")
    e.add_argument("--params", type=_parse_count,
                   help="e.g. 124M, 7B (default: counted from --model-config)")
    e.add_argument("--world-size", type=int, required=True)
    e.add_argument("--stage", type=int, choices=[0, 1, 2, 3],
                   help="the stage you plan to run: marked with * (all stages are printed)")
    e.add_argument("--precision", default="32-true", choices=PRECISIONS)
    e.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "compute"])
    e.add_argument("--optimizer-states", type=int, default=2, help="2 for Adam, 1 for SGD+momentum")
    e.add_argument("--offload", default="none", choices=["none", "optimizer", "all"])
    e.add_argument("--model-config", help="a transformers config.json (or its directory) of "
                   f"one of {', '.join(sorted(FAMILIES.values()))}: counts the parameters, "
                   "and with --batch prints the activations with and without checkpointing")
    e.add_argument("--batch", type=int, help="micro-batch per rank (activations)")
    e.add_argument("--seq", type=int, help="sequence length (GPT-2, BERT)")
    e.add_argument("--image-size", type=int, help="image side (ResNet)")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where training runs: dropout masks and attention save differently "
                   "(the cpu figures are measured, the cuda ones argued from the kernels)")
    e.set_defaults(func=_estimate)


def _add_link(sub: Any) -> None:
    """``zero-strategy link``: a step's bytes and time across the node links."""
    k = sub.add_parser(
        "link", help="bytes and time of a step across the links between nodes, per stage "
        "and option", description="Predict, per ZeRO stage and option (int8 weights and "
        "gradients, shard_group_size), the bytes that cross each node's link per step and "
        "the step's time from the link's rate and a measured or given compute rate "
        "(zero_strategy.perf; what it leaves out: docs/multi-node.md).")
    k.add_argument("--params", type=_parse_count, help="e.g. 124M, 7B")
    k.add_argument("--model-config", help="a transformers config.json (or its directory): "
                   "the engine's units of that model, counted on the meta device")
    k.add_argument("--nodes", type=int, required=True)
    k.add_argument("--per-node", type=int, required=True, help="processes (GPUs) per node")
    k.add_argument("--link-gbps", type=float, required=True,
                   help="each node's link, Gbit/s each way")
    k.add_argument("--link-efficiency", type=float, default=0.94,
                   help="payload share of the line rate (TCP over 1500-byte Ethernet: 0.94)")
    k.add_argument("--compute-s", type=float,
                   help="forward+backward of one micro-batch on one process, measured")
    k.add_argument("--tflops", type=float, help="or: what one process sustains, TFLOP/s")
    k.add_argument("--tokens", type=int, help="with --tflops: tokens per micro-batch")
    k.add_argument("--recompute", action="store_true",
                   help="with --tflops: activation checkpointing (8 instead of 6 FLOPs per "
                   "parameter and token)")
    k.add_argument("--optimizer-s", type=float, default=0.0,
                   help="the optimizer step over the whole model on one process")
    k.add_argument("--codec-s", type=float, default=0.0,
                   help="one int8 encode or decode over the model's element count")
    k.add_argument("--precision", default="32-true", choices=PRECISIONS)
    k.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    k.set_defaults(func=_link)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-strategy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_consolidate, _add_convert, _add_estimate, _add_link):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

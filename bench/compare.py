"""The project's comparison benchmark: DDP, torch's ZeRO-1, FSDP2, DeepSpeed and zero_strategy
training the same GPT-2 on the same data, on CPU processes joined by gloo.

One training run (under torchrun; rank 0 writes the run's record)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/compare.py \\
        --system zs_zero3 --regime memory --precision fp32 --out x.json

A matrix of systems x regimes, one torchrun after another, each under a timeout, combined
into the file a docs page is generated from (``docs/hooks/bench_pages.py``)::

    python bench/compare.py --matrix --systems ddp,zs_zero3 --regimes throughput,memory \\
        --out docs/performance/runs/<date>.json --note "<what was special about the machine>"

Records written separately (``bench/zs_bench.py``, ``bench/muon_bench.py``, a two-node run)
combined into such a file::

    python bench/compare.py --combine a.json b.json --out page.json --command "<how they ran>"

bench/README.md says what every figure means.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
CLIP = 1.0
SEED = 1234
WARMUP = 2


@dataclass(frozen=True)
class Regime:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int  # micro-batch per rank
    steps: int  # timed steps


REGIMES = {
    # 16.9M parameters: a step with real activations, where compute matters.
    "throughput": Regime(layers=4, width=512, heads=8, vocab=8192, seq=128, batch=4, steps=8),
    # 168M parameters and 32 tokens per rank: model states dominate memory. Sharded systems
    # take several seconds a step here, hence fewer steps.
    "memory": Regime(layers=12, width=1024, heads=16, vocab=16384, seq=32, batch=1, steps=4),
}

# Every system, in the order pages list them (the others first, ours last), with the ZeRO
# stage whose model-state formula it is compared with.
SYSTEMS = {
    "ddp": 0, "torch_zero1": 1, "fsdp2_zero2": 2, "fsdp2_zero3": 3, "fsdp2_hsdp": 3,
    "ds_zero1": 1, "ds_zero2": 2, "ds_zero3": 3,
    "ds_zero3_hpz": 3, "ds_zero3_qwz": 3, "ds_zero3_qgz": 3,
    "zs_zero0": 0, "zs_zero1": 1, "zs_zero2": 2, "zs_zero3": 3,
    "zs_zero2_offload": 2, "zs_zero3_offload": 3,
    "zs_zero3_int8": 3, "zs_zero3_hpz": 3, "zs_zero3_hpz_int8": 3, "zs_zero3_unchecked": 3,
}
# Systems across nodes (bench/cluster_bench.py): hybrid ones shard within a node of
# LOCAL_WORLD_SIZE processes and replicate across nodes (FSDP2's HSDP, DeepSpeed's and our
# hierarchical partitioning); the others are ZeRO++'s int8 weights (qwz) and gradients (qgz),
# and ours without the gather-order check (what the check costs across a link).
HYBRID = ("fsdp2_hsdp", "ds_zero3_hpz", "zs_zero3_hpz", "zs_zero3_hpz_int8")
DS_OPTIONS = {"ds_zero3_hpz": {"zero_hpz_partition_size": "local"},
              "ds_zero3_qwz": {"zero_quantized_weights": True},
              "ds_zero3_qgz": {"zero_quantized_gradients": True}}
ZS_OPTIONS = {"zs_zero3_int8": {"quantize_weights": "int8", "quantize_gradients": "int8"},
              "zs_zero3_unchecked": {"check_gather_order": False},
              "zs_zero3_hpz": {"shard_group_size": "local"},
              "zs_zero3_hpz_int8": {"shard_group_size": "local", "quantize_weights": "int8",
                                    "quantize_gradients": "int8"}}
# What --matrix runs unless told: the systems of the README's table.
MATRIX = ["ddp", "torch_zero1", "fsdp2_zero2", "fsdp2_zero3", "ds_zero1", "ds_zero2", "ds_zero3",
          "zs_zero1", "zs_zero2", "zs_zero3"]
PRECISIONS = ("fp32",)
MIB = 2**20


@dataclass
class Variant:
    """What bench/zs_bench.py and bench/muon_bench.py change in a run; the default changes
    nothing."""

    name: str | None = None
    """Record the run under this system name (its stage is the ``--system``'s)."""
    zero_fields: dict[str, Any] = field(default_factory=dict)
    """Added to the ``ZeroConfig`` of a ``zs_*`` system."""
    optimizer: Callable[[Any], Any] | None = None
    """model -> optimizer over its parameters, instead of AdamW (ddp, fsdp2_*, zs_* only:
    torch's ZeRO-1 and DeepSpeed build their optimizer themselves)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Stored in the record as they are."""


# -- the work ---------------------------------------------------------------------------------

def gpt_config(regime: Regime) -> Any:
    """The regime's GPT2Config (also what bench/readme_table.py predicts activations for)."""
    from transformers import GPT2Config

    config = GPT2Config(
        n_layer=regime.layers, n_embd=regime.width, n_head=regime.heads,
        vocab_size=regime.vocab, n_positions=regime.seq, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True,
        # GPT-2's default token ids lie outside a smaller vocabulary
        bos_token_id=regime.vocab - 1, eos_token_id=regime.vocab - 1)
    config._attn_implementation = "sdpa"
    return config


def build_model(regime: Regime) -> Any:
    import torch
    from transformers import GPT2LMHeadModel

    config = gpt_config(regime)
    torch.manual_seed(SEED)  # the same initial weights in every process and every system
    return GPT2LMHeadModel(config).train()


def make_batches(regime: Regime, rank: int, steps: int) -> Any:
    """Token ids (labels = inputs): one stream per rank, the same for every system."""
    import torch

    generator = torch.Generator().manual_seed(SEED * 1000 + rank)
    return torch.randint(0, regime.vocab, (steps, regime.batch, regime.seq), generator=generator)


def adamw(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), **ADAMW)


# -- the systems: zero_grad(), forward_backward(x) -> loss, step(), state_bytes() -------------

def _local(t: Any) -> Any:
    """A DTensor's shard on this rank; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(kinds: dict[str, Iterable[Any]]) -> dict[str, int]:
    """Storage bytes per kind, each storage counted once, at its allocated size (a bucket that
    holds many gradients counts whole), by the first kind that names it."""
    import torch

    seen: set[int] = set()
    out: dict[str, int] = {}
    with torch.no_grad():
        for kind, tensors in kinds.items():
            out[kind] = 0
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    continue
                storage = _local(t).untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                out[kind] += storage.nbytes()
    return out


def _state_tensors(optimizer: Any) -> list[Any]:
    return [v for state in optimizer.state.values() for v in state.values()]


class TorchSystem:
    """DDP, torch's ZeroRedundancyOptimizer and FSDP2: torch's own training calls."""

    def __init__(self, wrapped: Any, model: Any, optimizer: Any, local_optimizer: Any) -> None:
        self.wrapped, self.model = wrapped, model
        self.optimizer, self.local_optimizer = optimizer, local_optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, x: Any) -> float:
        loss = self.wrapped(input_ids=x, labels=x).loss
        loss.backward()
        return loss.item()

    def step(self) -> None:
        import torch

        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return tensor_bytes({"params": params, "grads": [p.grad for p in params],
                             "optim": _state_tensors(self.local_optimizer)})


class EngineSystem:
    """A system driven through an engine object: ``engine(...)``, ``engine.backward(loss)``,
    and a step that clears the gradients (DeepSpeed's and ours)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def zero_grad(self) -> None:
        pass  # engine.step() has cleared them

    def forward_backward(self, x: Any) -> float:
        loss = self.engine(input_ids=x, labels=x).loss
        self.engine.backward(loss)
        return loss.item()


class DeepSpeedSystem(EngineSystem):
    def __init__(self, engine: Any, optimizer: Any) -> None:
        super().__init__(engine)
        self.optimizer = optimizer

    def step(self) -> None:
        self.engine.step()  # clips at "gradient_clipping"

    def state_bytes(self) -> dict[str, int]:
        # Its parameters are partitions at stage 3 (ds_tensor); its fp32 master partitions
        # are the parameters of the torch AdamW inside, and count as optimizer state.
        zero = self.optimizer
        params = [getattr(p, "ds_tensor", p) for p in self.engine.module.parameters()]
        grads = [getattr(zero, "grad_partitions_flat_buffer", None)]
        grads += [g for group in getattr(zero, "averaged_gradients", {}).values()
                  for g in (group or [])]
        inner = getattr(zero, "optimizer", zero)
        masters = [p for group in inner.param_groups for p in group["params"]]
        grads += [p.grad for p in masters]
        return tensor_bytes({"params": params, "grads": grads,
                             "optim": masters + _state_tensors(inner)})


class ZeroStrategySystem(EngineSystem):
    def step(self) -> None:
        self.engine.clip_grad_norm_(CLIP)
        self.engine.step()

    def state_bytes(self) -> dict[str, int]:
        report = self.engine.memory_report()  # its flat buffers, which only it can classify
        return {"params": int(report["params_bytes"]), "grads": int(report["grads_bytes"]),
                "optim": int(report["optimizer_bytes"])}


def _ddp(model: Any, zero1: bool, variant: Variant) -> TorchSystem:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    # gradient_as_bucket_view: gradients live in DDP's buckets, not in a second full copy
    wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if not zero1:
        optimizer = (variant.optimizer or adamw)(model)
        return TorchSystem(wrapped, model, optimizer, optimizer)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                        **ADAMW)
    return TorchSystem(wrapped, model, optimizer, optimizer.optim)


def _local_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE): a hybrid system's shard group."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _resolved(options: dict[str, Any]) -> dict[str, Any]:
    return {k: _local_size() if v == "local" else v for k, v in options.items()}


def _fsdp2(model: Any, reshard: bool, variant: Variant, hybrid: bool = False) -> TorchSystem:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None
    if hybrid:  # HSDP: replicate across nodes (dim 0), shard within one (dim 1)
        local = _local_size()
        mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local),
                                mesh_dim_names=("replicate", "shard"))
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard, mesh=mesh)
    fully_shard(model, reshard_after_forward=reshard, mesh=mesh)
    optimizer = (variant.optimizer or adamw)(model)  # over the sharded parameters
    return TorchSystem(model, model, optimizer, optimizer)


def _deepspeed(model: Any, stage: int, regime: Regime,
               options: dict[str, Any] | None = None) -> DeepSpeedSystem:
    import deepspeed

    optimizer = {"type": "AdamW", "params": {
        "lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
        "weight_decay": ADAMW["weight_decay"],
        "torch_adam": True}}  # torch's AdamW, as everywhere else, not DeepSpeed's CPU op
    config = {"train_micro_batch_size_per_gpu": regime.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "optimizer": optimizer,
              "zero_optimization": {"stage": stage, **_resolved(options or {})},
              "steps_per_print": 10**9}
    engine, zero, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=config)
    return DeepSpeedSystem(engine, zero)


def _zero_strategy(model: Any, name: str, variant: Variant) -> ZeroStrategySystem:
    import zero_strategy as zs

    fields: dict[str, Any] = {"stage": SYSTEMS[name]}
    if name.endswith("_offload"):
        fields["offload_optimizer"] = True
        fields["offload_params"] = fields["stage"] == 3
    fields.update(_resolved(ZS_OPTIONS.get(name, {})))
    optimizer = (variant.optimizer or adamw)(model)
    config = zs.ZeroConfig(**{**fields, **variant.zero_fields})
    return ZeroStrategySystem(zs.ZeroEngine(model, optimizer, config))


def check_variant(name: str, variant: Variant) -> None:
    if variant.optimizer is not None and name.startswith(("torch_zero1", "ds_")):
        raise SystemExit(f"{name} builds its own optimizer: another one is for ddp, fsdp2_*, zs_*")
    if variant.zero_fields and not name.startswith("zs_"):
        raise SystemExit(f"ZeroConfig fields are for the zs_* systems, not {name}")


def build_system(name: str, model: Any, regime: Regime, variant: Variant) -> Any:
    if name in ("ddp", "torch_zero1"):
        return _ddp(model, zero1=name == "torch_zero1", variant=variant)
    if name.startswith("fsdp2_"):
        return _fsdp2(model, reshard=SYSTEMS[name] == 3, variant=variant,
                      hybrid=name in HYBRID)
    if name.startswith("ds_"):
        return _deepspeed(model, SYSTEMS[name], regime, DS_OPTIONS.get(name))
    return _zero_strategy(model, name, variant)


# -- one run ----------------------------------------------------------------------------------

def _import_system(name: str) -> None:
    """The system's library, imported before the memory baseline: its code is not training
    data. DeepSpeed also needs to be told there is no GPU."""
    if name.startswith("ds_"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
    elif name.startswith("fsdp2_"):
        import torch.distributed.fsdp  # noqa: F401
    elif name.startswith("zs_"):
        import zero_strategy  # noqa: F401


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def train(system: Any, batches: Any, census_step: int, warmup: int) -> dict[str, Any]:
    """Every step on this rank: loss, seconds (the whole step, and its forward+backward),
    the model-state bytes after the backward of ``census_step`` (all three kinds exist
    then; that count is not timed), and on a node of bench/cluster.py the bytes its link
    carried over the steps after ``warmup``.

    Steps run back to back, as in a training loop: a step is the time from the end of the
    one before (a barrier before the first, and one before the first timed step, counted in
    the step before it), and the last also holds the barrier after it.
    So the steps add up to the loop's time, and what a step leaves in flight (ours at
    stages 1-2 gathers the updated parameters after ``step()`` returns) is counted where
    it is waited for, overlapped with the next step's work as it would be in training. Until
    2026-11-29 every step began after a barrier of its own, untimed, and that barrier waited
    for the gather: a step of zs_zero1 across a 1 Gbit/s link came out shorter than its own
    bytes at the link's rate."""
    import torch.distributed as dist
    from cluster import link_counters

    losses, seconds, fwd_bwd, state, link = [], [], [], {}, None
    dist.barrier()  # every rank starts the loop together
    mark = time.perf_counter()
    for i, x in enumerate(batches):
        if i == warmup:
            # The counted window starts with nothing in flight: the last warm-up step's
            # gather is waited here, in that step's time, not counted with the timed steps'
            # bytes (it made stages 1-2's bytes a step 6% high, 2026-11-29).
            dist.barrier()
            now = time.perf_counter()
            if seconds:
                seconds[-1] += now - mark
            mark = now
            link = link_counters()
        begun = time.perf_counter()
        system.zero_grad()
        losses.append(system.forward_backward(x))
        counted = time.perf_counter()
        fwd_bwd.append(counted - begun)
        if i == census_step:
            state = system.state_bytes()
        untimed = time.perf_counter() - counted
        system.step()
        if i == len(batches) - 1:
            dist.barrier()  # what the last step left in flight, and the slowest rank
        now = time.perf_counter()
        seconds.append(now - mark - untimed)
        mark = now
    end = link_counters()
    out = {"losses": losses, "step_s": seconds, "fwd_bwd_s": fwd_bwd, "state_bytes": state}
    if link is not None and end is not None:
        out["link"] = {"node": int(os.environ.get("ZS_CLUSTER_NODE", "0")),
                       **{k: end[k] - link[k] for k in end}}
    return out


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "zero_strategy"):
        if name in sys.modules:
            found[name] = getattr(sys.modules[name], "__version__", "?")
    return found


def make_record(args: argparse.Namespace, variant: Variant, ranks: list[dict[str, Any]],
                n_params: int) -> dict[str, Any]:
    regime, world = REGIMES[args.regime], len(ranks)
    # A step lasts as long as its slowest rank.
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    timed = step_s[args.warmup:]
    median = statistics.median(timed)
    states = [sum(r["state_bytes"].values()) for r in ranks]
    # The ZeRO paper's model-state bytes per rank for the system's stage (fp32 Adam: 4, 4 and
    # 8 bytes per parameter), as the package computes it for its own reports.
    from zero_strategy import estimate_memory

    # a hybrid system shards over a node's processes, and its states are that group's
    group = _local_size() if args.system in HYBRID else world
    formula = estimate_memory(n_params, stage=SYSTEMS[args.system], world_size=group).total_bytes
    record = {
        "ok": True, "system": variant.name or args.system, "regime": args.regime,
        "precision": args.precision, "world_size": world, "n_params": n_params,
        "warmup_steps": args.warmup, "timed_steps": len(timed),
        "median_step_s": median, "min_step_s": min(timed),
        "tokens_per_s": world * regime.batch * regime.seq / median,
        "peak_rss_delta_mib_max": max(r["rss_delta_mib"] for r in ranks),
        "model_state_mib_max": max(states) / MIB,
        "model_state_mib_rank0": {k: v / MIB for k, v in ranks[0]["state_bytes"].items()},
        "formula_mib": formula / MIB,
        "step_s": step_s,
        "fwd_bwd_s": [max(r["fwd_bwd_s"][i] for r in ranks) for i in range(len(step_s))],
        "losses": [statistics.fmean(r["losses"][i] for r in ranks)
                   for i in range(len(ranks[0]["losses"]))],
        "peak_rss_delta_mib": [r["rss_delta_mib"] for r in ranks],
        "versions": _versions(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    links = {r["link"]["node"]: r["link"] for r in ranks if "link" in r}
    if links:  # per node and timed step; each direction's busiest node sets the link's time
        steps = len(timed) or 1
        record["link_bytes_per_step"] = {
            "sent": max(v["sent"] for v in links.values()) / steps,
            "received": max(v["received"] for v in links.values()) / steps,
            "per_node": [links[k] for k in sorted(links)]}
    if variant.name:
        record["base_system"] = args.system
    return record | variant.extra


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def failure(system: str, regime: str, precision: str, error: str) -> dict[str, Any]:
    return {"ok": False, "system": system, "regime": regime, "precision": precision,
            "error": error[:300]}


def run(args: argparse.Namespace, variant: Variant) -> None:
    check_variant(args.system, variant)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import transformers
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (import cost: the baseline's)

    try:
        _import_system(args.system)
    except ImportError as e:  # recorded, so a page shows what was not measured and why
        if os.environ.get("RANK", "0") == "0":
            write_json(args.out, failure(variant.name or args.system, args.regime,
                                         args.precision, f"cannot import: {e}"))
        return
    dist.init_process_group("gloo")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    rank, regime = dist.get_rank(), REGIMES[args.regime]
    baseline = _maxrss_mib()

    model = build_model(regime)
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.warmup + args.steps
    system = build_system(args.system, model, regime, variant)
    mine = train(system, make_batches(regime, rank, steps), census_step=steps - 1,
                 warmup=args.warmup)
    mine["rss_delta_mib"] = _maxrss_mib() - baseline
    for i, loss in enumerate(mine["losses"]):
        if not math.isfinite(loss):
            raise RuntimeError(f"rank {rank}: loss {loss} at step {i}")

    # gloo's teardown has been seen to hang once in a while after the work is done: bound it
    # (all stacks to stderr, exit), the driver keeps a run whose record exists.
    faulthandler.dump_traceback_later(60, exit=True)
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        record = make_record(args, variant, ranks, n_params)
        write_json(args.out, record)
        print(f"{record['system']} {args.regime}: {record['median_step_s']:.3f} s/step, "
              f"peak RSS +{record['peak_rss_delta_mib_max']:.0f} MiB, first loss "
              f"{record['losses'][0]:.6f} -> {args.out}", flush=True)
    if hasattr(getattr(system, "engine", None), "close"):
        system.engine.close()
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


# -- a matrix of runs, and the page file ------------------------------------------------------

def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a timed-out torchrun and its workers: the session it leads, which we started."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def _last_line(log: Path) -> str:
    lines = [s.strip() for s in log.read_text(errors="replace").splitlines() if s.strip()]
    errors = [s for s in lines if "Error" in s or "error:" in s]
    return (errors or lines or ["(no output)"])[-1]


def run_cell(system: str, regime: str, precision: str, args: argparse.Namespace,
             logs: Path) -> dict[str, Any]:
    """One training run in its own torchrun, under ``args.timeout``."""
    stem = f"{system}-{regime}-{precision}"
    out, log = logs / f"{stem}.json", logs / f"{stem}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc}", __file__, "--system", system,
               "--regime", regime, "--precision", precision, "--out", str(out),
               "--warmup", str(args.warmup)]
    if args.steps is not None:
        command += ["--steps", str(args.steps)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                        "TRANSFORMERS_VERBOSITY": "error"}
    start = time.perf_counter()
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            code: int | None = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            code = None
    took = time.perf_counter() - start
    if out.exists():  # done, even if its teardown then failed
        record = json.loads(out.read_text())
        print(f"{stem}: {record.get('median_step_s', 0):.3f} s/step ({took:.0f} s)"
              if record["ok"] else f"{stem}: {record['error']}", flush=True)
        return record
    # after a timeout the log ends with our own SIGTERM, which explains nothing
    why = f"timed out after {args.timeout:.0f} s" if code is None else \
        f"exit code {code}: {_last_line(log)}"
    print(f"{stem}: {why}, see {log}", flush=True)
    return failure(system, regime, precision, why)


def _order(record: dict[str, Any]) -> tuple[Any, ...]:
    regimes = list(REGIMES)
    name = record["system"]
    # a variant (zs_zero3_q8) right after the system it varies
    base = max((s for s in SYSTEMS if name.startswith(s)), key=len, default=None)
    place = list(SYSTEMS).index(base) + (0.5 if base != name else 0) if base else len(SYSTEMS)
    regime = regimes.index(record["regime"]) if record["regime"] in regimes else len(regimes)
    return regime, record["precision"], place, name


def _commit() -> str | None:
    try:
        found = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found.stdout.strip() or None


def make_page(records: list[dict[str, Any]], command: str, notes: list[str]) -> dict[str, Any]:
    """The file docs/hooks/bench_pages.py renders: each record with its first and last loss
    and, beside DDP's run on the same regime, the largest loss difference to it."""
    ddp = {(r["regime"], r["precision"]): r["losses"] for r in records
           if r.get("ok") and r["system"] == "ddp"}
    for record in records:
        if not record.get("ok"):
            continue
        record["first_loss"], record["last_loss"] = record["losses"][0], record["losses"][-1]
        reference = ddp.get((record["regime"], record["precision"]))
        if reference is not None and record["system"] != "ddp":
            record["max_loss_diff_vs_ddp"] = max(
                abs(a - b) for a, b in zip(record["losses"], reference))
    return {"created": time.strftime("%Y-%m-%d %H:%M"), "command": command,
            "commit": _commit(), "notes": notes, "runs": sorted(records, key=_order)}


def _names(text: str, known: Iterable[str], what: str) -> list[str]:
    names = [s for s in text.replace(",", " ").split() if s]
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise SystemExit(f"unknown {what}: {' '.join(unknown) or '(none)'}; "
                         f"known: {' '.join(known)}")
    return names


def run_matrix(args: argparse.Namespace, command: str) -> None:
    systems = _names(args.systems, SYSTEMS, "system")
    regimes = _names(args.regimes, REGIMES, "regime")
    precisions = _names(args.precisions, PRECISIONS, "precision")
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="zs-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"runs and logs in {logs}", flush=True)
    records = [run_cell(system, regime, precision, args, logs)
               for regime in regimes for precision in precisions for system in systems]
    write_json(args.out, make_page(records, command, args.note))
    print(f"{len(records)} runs -> {args.out}")


def combine(args: argparse.Namespace, command: str) -> None:
    records = [json.loads(Path(p).read_text()) for p in args.combine]
    write_json(args.out, make_page(records, args.command or command, args.note))
    print(f"{len(records)} runs -> {args.out}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=list(SYSTEMS), help="one run: the system trained")
    p.add_argument("--regime", choices=list(REGIMES), default="throughput")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: the regime's)")
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed first steps")
    p.add_argument("--out", required=True, help="the run's record, or the combined file")
    p.add_argument("--matrix", action="store_true", help="run --systems x --regimes")
    p.add_argument("--systems", default=",".join(MATRIX), help="comma-separated")
    p.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated")
    p.add_argument("--precisions", default="fp32")
    p.add_argument("--nproc", type=int, default=2, help="processes per run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--logs", default=None, help="where each run's record and log go")
    p.add_argument("--combine", nargs="+", metavar="RUN_JSON", help="combine run records")
    p.add_argument("--command", default=None, help="with --combine: how the runs were made")
    p.add_argument("--note", action="append", default=[], help="a paragraph for the page")
    args = p.parse_args(argv)
    if not (args.matrix or args.combine or args.system):
        p.error("give --system (one run), --matrix or --combine")
    if (args.steps is not None and args.steps < 1) or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv: list[str] | None = None, variant: Variant | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv)
    if args.matrix:
        run_matrix(args, command)
    elif args.combine:
        combine(args, command)
    else:
        if args.steps is None:
            args.steps = REGIMES[args.regime].steps
        run(args, variant or Variant())


if __name__ == "__main__":
    main()

"""The disk tier against its two bounds: the same step with "cpu" offload, and the bytes it
moves over the disk's measured bandwidth.

    OMP_NUM_THREADS=1 python bench/disk_bench.py --offload-dir /var/tmp/zs-offload

runs the shared bench's memory-regime GPT-2 (168 M parameters, AdamW, clipping at 1.0) at N=1,
stage 3, once with ``offload_optimizer=offload_params="cpu"`` and once with both on "disk",
in two fresh processes, then measures the sequential write and read bandwidth of
``--offload-dir`` with direct I/O (what ``dd oflag=direct`` / ``iflag=direct`` report) and
prints the "cpu" step time, the disk step time, the disk step's bytes (from
``/proc/self/io``: what the process read from and wrote to storage; the tier's own counts of
its direct reads and writes beside them) over the bandwidth, and the floor "the plain way":
16 bytes per parameter (fp32 master, Adam's two moments, the gradient) read once at the
measured read bandwidth plus 16 written once at the write bandwidth, with the disk step as a
multiple of it. ``--tier disk --json out.json`` runs one side only (what the memory-cap test runs
inside a cgroup); ``--precision 16-mixed`` trains under fp16 with its dynamic loss scale.
Every process builds the model on the meta device and the engine initialises it one unit at a
time (transformers' ``_init_weights``), so no process ever holds a full copy of it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REGIME = dict(n_layer=12, n_embd=1024, n_head=16, vocab=16384, seq=32)
STATE_BYTES_PER_PARAM = 16
"""fp32 master (the parameter shard), Adam's two moments, the gradient: each must be read
once and written once per step, whatever the tier keeps in memory."""


def _resident() -> int:
    """Bytes of this process in anonymous memory: what training adds to the resident set.
    The disk tier's resident state is anonymous too (what its direct reads bring in); the
    pages of its files mapped elsewhere are the kernel's page cache, reclaimable, and shared
    libraries come and go under a cgroup. Read from /proc/self/status, which costs no walk
    of the mappings (sampling /proc/self/smaps every 20 ms slowed the disk step by a
    third: it contends with the tier's remapping)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The largest ``_resident()`` seen by a sampling thread while running."""

    def __init__(self) -> None:
        import threading

        self.peak, self.running = 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, _resident())
            time.sleep(0.02)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return self.peak


def _io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _model(tier: str, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The GPT-2 on the meta device (initialised unit by unit by transformers' own init when
    the engine builds it), its AdamW and the side's ZeroConfig."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_strategy as zs

    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=REGIME["n_head"],
                        vocab_size=REGIME["vocab"], n_positions=args.seq, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    torch.manual_seed(1234)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, eps=1e-8)
    disk = tier == "disk" or args.offload_activations == "disk"
    zero = zs.ZeroConfig(stage=3, offload_optimizer=tier, offload_params=tier,
                         offload_dir=args.offload_dir if disk else None,
                         activation_checkpointing=args.checkpointing,
                         offload_activations=args.offload_activations or False,
                         precision=args.precision)
    return config, model, optimizer, zero


def train(tier: str, args: argparse.Namespace) -> dict:
    """One side's run: ``args`` as main() parses them (steps, layers, width, seq, offload
    dir, activation checkpointing and where the checkpointed inputs rest)."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    config, model, optimizer, zero = _model(tier, args)
    predicted = zs.estimate_activations(config, batch_size=1, seq_len=args.seq,
                                        checkpointing=args.checkpointing).as_dict()
    baseline = _resident()  # torch, transformers and the empty (meta) model
    built = time.perf_counter()
    engine = zs.ZeroEngine(model, optimizer, zero, param_init_fn=model._init_weights)
    build_s = time.perf_counter() - built
    g = torch.Generator().manual_seed(7)
    batches = torch.randint(0, REGIME["vocab"], (args.steps, 1, args.seq), generator=g)
    losses, times, reads, writes, tier_io = [], [], [], [], []
    sampler = _Peak()
    for batch in batches:
        r0, w0 = _io()
        t0 = _tier_io(engine)
        start = time.perf_counter()
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        if engine.tier is not None:  # the step's write-back is part of its cost; what the
            engine.tier.drain(keep_resident=True)  # tier keeps for forward stays kept
        times.append(time.perf_counter() - start)
        r1, w1 = _io()
        reads.append(r1 - r0)
        writes.append(w1 - w0)
        tier_io.append([b - a for a, b in zip(t0, _tier_io(engine))])
        losses.append(loss.item())
    peak = sampler.stop()
    report = engine.memory_report()
    engine.close()
    dist.destroy_process_group()
    return {"tier": tier, "params": sum(p.numel() for p in model.parameters()),
            "losses": losses, "step_s": times, "read_bytes": reads, "write_bytes": writes,
            "tier_read_written_reused": tier_io,
            "build_s": build_s, "baseline_resident": baseline, "peak_resident": peak,
            "memory_report": report, "predicted_activations": predicted}


def _tier_io(engine: object) -> tuple[int, int, int]:
    tier = getattr(engine, "tier", None)
    if tier is None:
        return 0, 0, 0
    return tier.read_bytes, tier.written_bytes, tier.reused_bytes


def bandwidth(directory: str, nbytes: int = 1 << 30, chunk: int = 16 << 20) -> dict:
    """Sequential write then read of ``nbytes`` with O_DIRECT (no page cache), in bytes/s."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as direct I/O needs
    buf.write(os.urandom(chunk))
    fd, path = tempfile.mkstemp(dir=directory, prefix="bandwidth-")
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwritev(fd, [buf], offset)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.preadv(fd, [buf], offset)
        read = nbytes / (time.perf_counter() - start)
        os.close(fd)
    finally:
        os.unlink(path)
    return {"write_Bps": write, "read_Bps": read}


def _child(tier: str, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp()) / f"{tier}.json"
    cmd = [sys.executable, __file__, "--tier", tier, "--steps", str(args.steps),
           "--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
           "--precision", args.precision, "--json", str(out)]
    if args.offload_dir:
        cmd += ["--offload-dir", args.offload_dir]
    if args.checkpointing:
        cmd += ["--checkpointing"]
    if args.offload_activations:
        cmd += ["--offload-activations", args.offload_activations]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def summary(cpu: dict, disk: dict, bw: dict, warmup: int) -> dict:
    timed = slice(warmup, None)
    read = statistics.median(disk["read_bytes"][timed])
    write = statistics.median(disk["write_bytes"][timed])
    io_s = read / bw["read_Bps"] + write / bw["write_Bps"]
    cpu_s = statistics.median(cpu["step_s"][timed])
    disk_s = statistics.median(disk["step_s"][timed])
    state = STATE_BYTES_PER_PARAM * disk["params"]
    floor_s = state / bw["read_Bps"] + state / bw["write_Bps"]
    tier = disk.get("tier_read_written_reused", [])[timed]
    return {"cpu_step_s": cpu_s, "disk_step_s": disk_s, "io_bound_s": io_s,
            "floor_s": floor_s, "ratio_to_floor": disk_s / floor_s, "state_bytes": state,
            "read_bytes_per_step": read, "write_bytes_per_step": write,
            "tier_read_bytes_per_step": statistics.median(t[0] for t in tier) if tier else 0,
            "tier_write_bytes_per_step": statistics.median(t[1] for t in tier) if tier else 0,
            "tier_reused_bytes_per_step": statistics.median(t[2] for t in tier) if tier else 0,
            "read_GBps": bw["read_Bps"] / 1e9, "write_GBps": bw["write_Bps"] / 1e9,
            "ratio_to_bound": disk_s / max(cpu_s, io_s),
            "losses_equal": cpu["losses"] == disk["losses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offload-dir", default=None,
                        help="where the disk tier's files go (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument("--layers", type=int, default=REGIME["n_layer"])
    parser.add_argument("--width", type=int, default=REGIME["n_embd"], help="n_embd")
    parser.add_argument("--tier", choices=["cpu", "disk"], default=None,
                        help="run one side only, in this process")
    parser.add_argument("--seq", type=int, default=REGIME["seq"], help="tokens per sequence")
    parser.add_argument("--checkpointing", action="store_true",
                        help="ZeroConfig(activation_checkpointing=True): each layer recomputed")
    parser.add_argument("--offload-activations", choices=["cpu", "disk"], default=None,
                        help="where the checkpointed layers' inputs rest (with --checkpointing)")
    parser.add_argument("--precision", default="32-true",
                        help="ZeroConfig.precision (16-mixed: the fp16 loss scale's unscale "
                             "and non-finite check ride on the step's single read)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    if args.tier is not None:
        result = train(args.tier, args)
    else:
        cpu, disk = _child("cpu", args), _child("disk", args)
        bw = bandwidth(args.offload_dir or tempfile.gettempdir())
        result = {"cpu": cpu, "disk": disk, "bandwidth": bw,
                  "summary": summary(cpu, disk, bw, args.warmup)}
        s = result["summary"]
        print(f"GPT-2 {disk['params'] / 1e6:.1f} M params, N=1, stage 3, {args.precision}, "
              f"{args.steps} steps ({args.warmup} untimed)")
        print(f"  'cpu' offload step:           {s['cpu_step_s']:.2f} s")
        print(f"  bytes / bandwidth:            {s['io_bound_s']:.2f} s  (read "
              f"{s['read_bytes_per_step'] / 2**30:.2f} GiB at {s['read_GBps']:.2f} GB/s, write "
              f"{s['write_bytes_per_step'] / 2**30:.2f} GiB at {s['write_GBps']:.2f} GB/s)")
        print(f"  tier's own count:             read {s['tier_read_bytes_per_step'] / 2**30:.2f} "
              f"GiB, wrote {s['tier_write_bytes_per_step'] / 2**30:.2f} GiB, found "
              f"{s['tier_reused_bytes_per_step'] / 2**30:.2f} GiB kept in memory")
        print(f"  floor (16 B/param each way):  {s['floor_s']:.2f} s  ("
              f"{s['state_bytes'] / 2**30:.2f} GiB read, then written)")
        print(f"  'disk' step:                  {s['disk_step_s']:.2f} s  "
              f"({s['ratio_to_floor']:.2f}x the floor, {s['ratio_to_bound']:.2f}x the larger "
              "bound)")
        print(f"  losses equal: {s['losses_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    elif args.tier is not None:
        print(json.dumps({k: v for k, v in result.items() if k != "memory_report"}))


if __name__ == "__main__":
    main()

"""One run of the shared anchor benchmark (``../shared/bench/anchors.py``) for a zero_strategy
system with extra ``ZeroConfig`` fields, recorded under a name of its own, so variants the
benchmark does not list (int8 collectives, hierarchical sharding) are measured on exactly its
work and tabulated beside the anchors::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 recipes/zs_bench.py \\
        --anchors ../shared/bench/anchors.py --name zs_zero3_q8 \\
        --zero quantize_weights=int8 --zero quantize_gradients=int8 -- \\
        --system zs_zero3 --regime memory --precision fp32 --out q8.json
    python ../shared/bench/anchors.py --report q8.json RUN_DIR_OF_THE_ANCHORS

Everything else (model, data, optimizer, timing, memory census) is the benchmark's own: the
``--system`` given after ``--`` is built as usual, with the extra fields added to the
``ZeroConfig`` it constructs, and the result file names the run ``--name``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import sys
from typing import Any

import yaml

import zero_strategy as zs


def parse_fields(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (values read as YAML: ints, booleans, strings), checked against
    ZeroConfig's field names."""
    fields: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--zero expects key=value, got {pair!r}")
        fields[key] = yaml.safe_load(value)
    zs.ZeroConfig.from_dict({"stage": 3, **fields}, source="--zero")  # names checked early
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchors", required=True, help="path of shared/bench/anchors.py")
    parser.add_argument("--name", required=True, help="the system name the run is stored under")
    parser.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZeroConfig field added to the benchmark's (repeatable)")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    fields = parse_fields(args.zero)
    plain = zs.ZeroConfig

    @functools.wraps(plain)
    def with_fields(**kw: Any) -> zs.ZeroConfig:
        return plain(**{**kw, **fields})

    zs.ZeroConfig = with_fields  # type: ignore[misc,assignment]  # what anchors.py builds
    # Its definitions, not its main; run_path returns a copy of the module's namespace, the
    # one its functions read is theirs.
    bench = runpy.run_path(args.anchors, run_name="anchors")["main"].__globals__
    write = bench["write_run_json"]

    def write_renamed(run_args: Any, *more: Any) -> None:
        write(run_args, *more)  # under --system's name: its stage and formula are looked up
        result = json.loads(open(run_args.out).read())
        result["system"], result["zero_fields"] = args.name, fields
        tmp = run_args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, run_args.out)

    bench["write_run_json"] = write_renamed
    sys.argv = [args.anchors, *rest]
    bench["main"]()


if __name__ == "__main__":
    main()

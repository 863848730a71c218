"""One run of ``bench/compare.py`` for a zero_strategy system with extra ``ZeroConfig`` fields,
recorded under a name of its own, so variants the benchmark does not list (int8 collectives,
hierarchical sharding) are measured on exactly its work and tabulated beside the others::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/zs_bench.py \\
        --name zs_zero3_q8 --zero quantize_weights=int8 --zero quantize_gradients=int8 -- \\
        --system zs_zero3 --regime memory --precision fp32 --out q8.json
    python bench/compare.py --combine q8.json RUN_DIR/*.json --out page.json --command "..."

Everything else (model, data, optimizer, timing, memory figures) is compare.py's own: the
``--system`` given after ``--`` is built as usual, with the extra fields added to the
``ZeroConfig`` it constructs; the record names the run ``--name`` (its ZeRO formula is the
``--system``'s, kept as ``base_system``) and lists the fields under ``zero_fields``.
"""

from __future__ import annotations

import argparse
from typing import Any

import compare
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
    parser.add_argument("--name", required=True, help="the system name the run is stored under")
    parser.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZeroConfig field added to the benchmark's (repeatable)")
    args, rest = parser.parse_known_args()
    fields = parse_fields(args.zero)
    compare.main([a for a in rest if a != "--"],
                 compare.Variant(name=args.name, zero_fields=fields, extra={"zero_fields": fields}))


if __name__ == "__main__":
    main()

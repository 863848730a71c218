"""One rank of a probe of the cluster in a box (tests/integration/test_cluster_box.py), run by
torchrun on every node of ``bench/cluster.py``.

Each rank writes where it runs (``rank<R>.json``: its node, its link's interface and
addresses, its pid). Then, with 2 processes per node, the two ranks of node 0 exchange
``--local-mib`` MiB each way (their node's loopback) and rank 0 and the first rank of
node 1 exchange ``--cross-mib`` MiB each way (the link). ``--sleep S`` instead waits S
seconds after writing, for the test to stop the cluster meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist


def exchange(peer: int, mib: float) -> None:
    data = torch.ones(int(mib * 2**20) // 4)
    got = torch.empty_like(data)
    works = [dist.isend(data, peer), dist.irecv(got, peer)]
    for work in works:
        work.wait()
    assert bool((got == 1).all())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--local-mib", type=float, default=0.0)
    p.add_argument("--cross-mib", type=float, default=0.0)
    p.add_argument("--sleep", type=float, default=0.0)
    opts = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    record = {"rank": rank, "node": int(os.environ["GROUP_RANK"]), "iface": iface,
              "pid": os.getpid(), "hostname": socket.gethostname()}
    (opts.out / f"rank{rank}.json").write_text(json.dumps(record))
    if opts.sleep:
        time.sleep(opts.sleep)
    dist.barrier()
    if opts.local_mib and per_node > 1 and rank in (0, 1):
        exchange(1 - rank, opts.local_mib)
    dist.barrier()
    if opts.cross_mib and rank in (0, per_node):
        exchange(per_node - rank, opts.cross_mib)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

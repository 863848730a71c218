"""The cluster in a box (``bench/cluster.py``): K nodes x P processes in network namespaces
joined through a bridge by links shaped each way. Needs root and network namespaces; every
test skips with the reason otherwise.

- Each link carries its rate, measured both ways at once (a raw TCP transfer), and the
  interface counters see what crosses it and nothing a node keeps on its loopback.
- Only loopback-range addresses exist in the namespaces, and the kernel routes 127/8
  between them (``route_localnet``); no private-range address appears.
- The command tears everything down on exit, on SIGTERM and on Ctrl-C: no namespace, no
  process of the job is left.

About 1.5 minutes (three clusters, each starting torch in 4 processes).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cluster as box  # noqa: E402

WHY = box.missing_requirements()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the cluster in a box {WHY}")
PREFIX = os.environ.get("ZS_CLUSTER_PREFIX", "zsbox") + "-c"
RATE_BYTES = 200e6 / 8
MIB = 2**20


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                              text=True).stdout.split())


def _addresses(ns: str) -> list[str]:
    found = json.loads(subprocess.run(["ip", "-n", ns, "-j", "-4", "addr"],
                                      capture_output=True, text=True).stdout)
    return [a["local"] for link in found for a in link.get("addr_info", [])]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("probe")
    cluster = box.Cluster(2, 2, "200mbit", prefix=f"{PREFIX}0", net=80)
    with cluster:
        rate = cluster.measure_rate(2.0)
        addresses = {ns: _addresses(ns) for ns in cluster.namespaces()}
        sysctl = box._in(cluster.ns(1), "sysctl", "-n",
                         f"net.ipv4.conf.{cluster.iface(1)}.route_localnet").stdout.strip()
        result = cluster.run(["tests/worlds/cluster_probe.py", str(out), "--local-mib", "64",
                              "--cross-mib", "8"], out / "logs", timeout=300)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {"rate": rate, "addresses": addresses, "route_localnet": sysctl,
            "result": result, "ranks": ranks, "left": _namespaces() & set(cluster.namespaces())}


def test_each_link_carries_its_rate_both_ways(probe: dict) -> None:
    # The shaping is the promise: never more than the line rate (the counters count a
    # little more than TCP's payload, 0.94 of the line over 1500-byte frames, never more
    # than the line; divided by the seconds the receiver saw bytes arrive, not by the
    # sender's clock, after which its socket buffer still drains: that read 1.03x once).
    # The bucket lets 256 KB pass at once: 0.5% of 2 s at this rate. Below it, a quiet
    # host reaches 0.92 (115 of 125 MB/s at 1 Gbit/s);
    # senders starved of CPU on a loaded host (CI beside other jobs measured under 0.85)
    # send less, which says nothing about the link, so the floor only catches a link
    # shaped far below its rate (a wrong unit or bucket: 10x and more).
    assert 0.5 * RATE_BYTES <= probe["rate"]["bytes_per_s"] <= 1.0 * RATE_BYTES, probe["rate"]


def test_the_counters_see_what_crosses_a_link_and_nothing_else(probe: dict) -> None:
    result = probe["result"]
    assert result["returncodes"] == [0, 0], result
    # 8 MiB each way between the nodes; 64 MiB each way inside node 0 must not appear.
    # Beyond the 8 MiB: the rendezvous, gloo's connections and three barriers, well under
    # one MiB.
    for link in result["links"]:
        for way in ("to_node", "from_node"):
            assert 8 * MIB <= link[way] <= 9 * MIB, result["links"]
    ranks = probe["ranks"]
    assert [r["node"] for r in ranks] == [0, 0, 1, 1]
    assert {r["iface"] for r in ranks} == {f"{PREFIX}0-v0", f"{PREFIX}0-v1"}


def test_only_loopback_range_addresses_exist_and_route(probe: dict) -> None:
    for ns, addresses in probe["addresses"].items():
        for address in addresses:
            ip = ipaddress.ip_address(address)
            assert ip.is_loopback, (ns, address)
            assert not any(ip in ipaddress.ip_network(n) for n in (
                "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")), (ns, address)
    assert probe["route_localnet"] == "1"
    assert not probe["left"], probe["left"]


def test_a_node_receives_at_its_links_rate_from_two_senders() -> None:
    """The link is shaped toward the node too (the switch's end): two nodes sending to a
    third at once share its rate, as they would share a real node's port."""
    with box.Cluster(3, 1, "200mbit", prefix=f"{PREFIX}3", net=82) as cluster:
        before = cluster.counters()
        cluster.transfer([(1, 0), (2, 0)], 3.0)
        after = cluster.counters()
    received = after[0]["to_node"] - before[0]["to_node"]
    sent = [after[k]["from_node"] - before[k]["from_node"] for k in (1, 2)]
    # both senders got through (each at least a quarter of the rate for the 3 s), the node no
    # faster than its rate: 3 s of it, 10% for the senders' starts a moment apart, and a
    # bucket's burst (256 kB) per shaper; unshaped toward it, it would receive twice that
    assert all(s >= RATE_BYTES * 3.0 / 4 for s in sent), sent
    assert received <= RATE_BYTES * 3.0 * 1.1 + 2 * MIB, received


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_command_tears_everything_down_on_a_signal(tmp_path: Path, sig: int) -> None:
    prefix = f"{PREFIX}{1 if sig == signal.SIGTERM else 2}"
    command = [sys.executable, str(ROOT / "bench" / "cluster.py"), "--nodes", "2", "--nproc",
               "1", "--rate", "200mbit", "--prefix", prefix, "--net", "81",
               "--logs", str(tmp_path / "logs"), "--",
               "tests/worlds/cluster_probe.py", str(tmp_path), "--sleep", "300"]
    # Started with SIGINT ignored, as a script's `cmd &` or a CI runner starts it: Ctrl-C
    # (a scheduler's SIGINT) must stop it still.
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        pids = [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]
        proc.send_signal(sig)  # the command alone, as a terminal's Ctrl-C or a scheduler would
        assert proc.wait(timeout=60) != 0, f"signal {sig} did not stop the command in 60 s"
    finally:  # a failure here must not leave the cluster up for the next test
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    assert not {n for n in _namespaces() if n.startswith(prefix + "-")}
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived the cluster"


def test_link_timeline_accounts_for_the_steps_bytes(tmp_path: Path) -> None:
    """bench/link_timeline.py on 2 nodes x 1 process at 200 Mbit/s: each step's sampled bytes
    are the bytes ``zero_strategy.perf`` predicts for stage 3 on that model (the counters'
    TCP/IP headers, 0.2% over the payload at 1500-byte frames, and the small collectives it
    leaves out fit in 3%), its busy time and idle stretches fit inside the step, and the
    stretches name a scope the engine or the script opened."""
    import compare
    import torch

    import zero_strategy as zs
    from zero_strategy.perf import Layout, Options, model_units, node_bytes, step_collectives

    out = tmp_path / "timeline.json"
    cluster = box.Cluster(2, 1, "200mbit", prefix=f"{PREFIX}3", net=83)
    with cluster:
        result = cluster.run(["bench/link_timeline.py", "--system", "zs_zero3", "--steps", "2",
                              "--out", str(out)], tmp_path / "logs", timeout=600)
    assert result["returncodes"] == [0, 0], result
    ranks = json.loads(out.read_text())["ranks"]
    layout = Layout(nodes=2, per_node=1)
    config = zs.ZeroConfig(stage=3)
    with torch.device("meta"):
        model = compare.build_model(compare.REGIMES["throughput"])
    predicted = node_bytes(step_collectives(model_units(model, config, layout),
                                            Options.from_config(config), layout), layout)
    for r in ranks:
        assert len(r["steps"]) == 2, r
        for s in r["steps"]:
            assert s["bytes"]["sent"] == pytest.approx(predicted, rel=0.03), (s, predicted)
            assert 0 < s["busy_s"] <= s["step_s"], s
            idle = sum(b for _, b, _ in s["idle"]) / 1e3
            assert s["busy_s"] + idle <= s["step_s"] * 1.01, s
            assert all(where.startswith(("zero::", "timeline::")) or where == "between steps"
                       for _, _, where in s["idle"]), s["idle"]

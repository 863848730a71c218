"""A cluster in a box: K "nodes" of P processes each on this machine, joined by links of a
given rate, for measuring what crosses between nodes where the link, not memory copies, is
the bottleneck.

Each node is a network namespace with one end of a veth pair; the other ends meet on a
bridge in a namespace of their own (the switch), so nothing touches the machine's own
network. Each link is shaped to the rate in both directions (``tc tbf`` on both ends of the
veth: the node's egress, and the switch's egress toward the node); traffic between the
processes of one node stays on that node's loopback, unshaped and uncounted. Addresses are
loopback-range (``127.<net>.0.<k+1>``, ``route_localnet``), so no packet can leave the
machine and no private-range address appears.

Every node runs the same command under ``torch.distributed.run`` (c10d rendezvous hosted by
node 0, ``GLOO_SOCKET_IFNAME`` set to the node's link), and the bytes that crossed each link
are read from the switch's interface counters and written to a JSON file::

    sudo python bench/cluster.py --nodes 2 --nproc 2 --rate 1gbit --out links.json -- \\
        bench/compare.py --system zs_zero3 --regime throughput --out run.json

Everything is torn down on exit, on Ctrl-C and on SIGTERM: the nodes' processes are stopped
(SIGTERM, then SIGKILL), every process left in a namespace is killed, the namespaces go.
Needs root (namespaces, tc); ``python bench/cluster.py --check`` says whether this machine
can. bench/README.md ("A cluster in a box") says what every figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PORT = 29400
"""The c10d rendezvous port on node 0 (each cluster has its own network stack)."""
TRANSFER_PORT = 29399
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9 (tc's decimal units)."""
    match = _RATE.match(rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: give a number and one of bit, kbit, mbit, gbit "
                         "(e.g. 1gbit, 500mbit)")
    return float(match.group(1)) * _RATE_SCALE[match.group(2)]


def missing_requirements() -> str | None:
    """Why a cluster cannot be built here (not root, no ``ip``/``tc``, no namespaces), or
    None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc shaping)"
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"needs the {tool!r} command (iproute2)"
    probe = f"zsprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _in(ns: str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", "netns", "exec", ns, *command], capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"in {ns}: {' '.join(command)}: {done.stderr.strip()}")
    return done


@dataclass
class Cluster:
    """K nodes x P processes behind shaped links (see the module's docstring). A context
    manager: ``with Cluster(2, 1, "1gbit") as c: c.run([...])``; ``down()`` is safe to call
    twice and after a partial ``up()``."""

    nodes: int
    nproc: int
    rate: str
    prefix: str = "zsbox"
    """Names of the namespaces (``<prefix>-n<k>``, ``<prefix>-sw``) and interfaces
    (``<prefix>-v<k>`` in node k, ``<prefix>-p<k>`` on the switch): unique per cluster."""
    net: int = 77
    """Second octet of the nodes' addresses, 127.<net>.0.<k+1>/24."""
    mtu: int = 1500
    burst: str = "256kb"
    """tbf's bucket: at least rate / HZ (1 Gbit/s at HZ=250: 500 kbit); larger lets short
    transfers pass faster than the rate."""
    latency_ms: int = 50
    """How long a packet may wait in tbf's queue before it is dropped (TCP then slows)."""
    _up: bool = field(default=False, repr=False)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.nproc < 1:
            raise ValueError(f"a cluster needs nodes >= 2 and nproc >= 1, got {self.nodes} "
                             f"x {self.nproc}")
        if not 1 <= self.net <= 254:
            raise ValueError(f"net must be 1..254 (127.<net>.0.x), got {self.net}")
        rate_bits(self.rate)
        if len(self.iface(self.nodes - 1)) > 15:
            raise ValueError(f"prefix {self.prefix!r} is too long: interface names "
                             f"({self.iface(self.nodes - 1)!r}) have at most 15 characters")

    # -- names ---------------------------------------------------------------------------
    def ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def iface(self, node: int) -> str:
        return f"{self.prefix}-v{node}"

    def port(self, node: int) -> str:
        return f"{self.prefix}-p{node}"

    def addr(self, node: int) -> str:
        return f"127.{self.net}.0.{node + 1}"

    def namespaces(self) -> list[str]:
        return [self.switch, *(self.ns(k) for k in range(self.nodes))]

    # -- life ----------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        with _signals_held():  # a second Ctrl-C must not cut the teardown short
            self.down()

    def up(self) -> None:
        existing = set(_ip("netns", "list").stdout.split())
        taken = [n for n in self.namespaces() if n in existing]
        if taken:
            raise RuntimeError(
                f"namespace {taken[0]} exists: another cluster runs with prefix "
                f"{self.prefix!r}, or one was killed before its teardown (remove it with "
                f"`python bench/cluster.py --down --prefix {self.prefix} --nodes "
                f"{self.nodes}`)")
        self._up = True  # from here on down() removes whatever was made
        _ip("netns", "add", self.switch)
        sw = self.switch
        _ip("-n", sw, "link", "add", f"{self.prefix}-br", "type", "bridge")
        _ip("-n", sw, "link", "set", f"{self.prefix}-br", "up")
        for k in range(self.nodes):
            self._add_node(k)

    def _add_node(self, k: int) -> None:
        ns, sw, v, p = self.ns(k), self.switch, self.iface(k), self.port(k)
        _ip("netns", "add", ns)
        _ip("link", "add", "name", v, "netns", ns, "mtu", str(self.mtu), "type", "veth",
            "peer", "name", p, "netns", sw, "mtu", str(self.mtu))
        _ip("-n", sw, "link", "set", p, "master", f"{self.prefix}-br", "up")
        # 127/8 is the loopback's whole range by default: keep only 127.0.0.1 there, so
        # the other nodes' 127.<net>.0.x are reached over the link, and let the link carry
        # loopback-range addresses at all (route_localnet).
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
        _in(ns, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
            f"net.ipv4.conf.{v}.route_localnet=1")
        _ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", v)
        _ip("-n", ns, "link", "set", v, "up")
        shape = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency",
                 f"{self.latency_ms}ms"]
        _in(ns, "tc", "qdisc", "add", "dev", v, *shape)   # leaving the node
        _in(sw, "tc", "qdisc", "add", "dev", p, *shape)   # arriving at it

    def down(self) -> None:
        """Stop every process of the cluster and remove its namespaces. Only what this
        cluster made is touched: its launchers' sessions, then any process still inside
        one of its namespaces."""
        self.stop()
        if not self._up:
            return
        existing = set(_ip("netns", "list", check=False).stdout.split())
        for ns in self.namespaces():
            if ns not in existing:
                continue
            for _ in range(50):  # processes that left our sessions (setsid) still live here
                pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    _signal(pid, signal.SIGKILL, group=False)
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        self._up = False

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM each node's launcher session (torchrun passes it to its workers), then
        SIGKILL what is left after ``grace`` seconds."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal(proc.pid, signal.SIGKILL)  # the session's stragglers too
            proc.wait()

    # -- counters and the link's rate ----------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Per node, the bytes its link carried so far, from the switch's side:
        ``to_node`` (what the node received) and ``from_node`` (what it sent)."""
        stats = json.loads(_ip("-j", "-s", "-n", self.switch, "link", "show").stdout)
        by_name = {s["ifname"]: s["stats64"] for s in stats}
        out = []
        for k in range(self.nodes):
            s = by_name[self.port(k)]
            out.append({"node": k, "to_node": int(s["tx"]["bytes"]),
                        "from_node": int(s["rx"]["bytes"])})
        return out

    def measure_rate(self, seconds: float = 3.0) -> dict[str, Any]:
        """A raw TCP transfer in both directions at once between nodes 0 and 1 (as a step's
        collectives load a link both ways): bytes per second per direction, from the
        interface counters (the same bytes ``counters`` reports for a run)."""
        before = self.counters()
        start = time.perf_counter()
        received = self.transfer([(0, 1), (1, 0)], seconds)
        after = self.counters()
        sent = [after[k]["from_node"] - before[k]["from_node"] for k in (0, 1)]
        took = time.perf_counter() - start - 1.0
        # Per the time the wire carried each direction (first to last byte received), not
        # the sender's clock: its socket buffer (megabytes) still drains after it stops,
        # which over 2 s overstated a 25 MB/s link by 3%.
        wire = [r["seconds"] for r in received]
        return {"bytes_per_s": min(b / max(w, 1e-9) for b, w in zip(sent, wire)),
                "seconds": seconds, "wire_seconds": wire, "sent_bytes": sent,
                "payload_bytes": [r["bytes"] for r in received], "wall_s": took,
                "rate": self.rate, "nominal_bytes_per_s": rate_bits(self.rate) / 8}

    def transfer(self, pairs: Sequence[tuple[int, int]], seconds: float
                 ) -> list[dict[str, float]]:
        """Raw TCP transfers, all at once for ``seconds``: from node a to node b for each
        ``(a, b)`` of ``pairs`` (each to its own port). Each receiver's report, in order:
        the payload bytes and the seconds from its first to its last byte."""
        ports = [TRANSFER_PORT - i for i in range(len(pairs))]
        receivers = [self._spawn(b, [sys.executable, __file__, "--receive", self.addr(b),
                                     str(port)], report=True)
                     for (_, b), port in zip(pairs, ports)]
        time.sleep(1.0)  # listening
        senders = [self._spawn(a, [sys.executable, __file__, "--send", self.addr(b), str(port),
                                   str(seconds)]) for (a, b), port in zip(pairs, ports)]
        for proc in senders + receivers:
            if proc.wait(timeout=seconds + 60):
                raise RuntimeError(f"the transfer failed: {proc.args}")
        return [json.loads(proc.stdout.read()) for proc in receivers if proc.stdout]

    def _spawn(self, node: int, command: list[str], report: bool = False
               ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["ip", "netns", "exec", self.ns(node), *command],
                                stdout=subprocess.PIPE if report else subprocess.DEVNULL,
                                stderr=subprocess.PIPE)

    # -- running a job -------------------------------------------------------------------
    def torchrun(self, node: int, command: Sequence[str], run_id: str) -> list[str]:
        """The command line that starts ``command`` (a script and its arguments, or ``-m
        module ...``) on ``node`` under torchrun."""
        return ["ip", "netns", "exec", self.ns(node), sys.executable, "-m",
                "torch.distributed.run", "--nnodes", str(self.nodes), "--node-rank", str(node),
                "--nproc-per-node", str(self.nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.addr(0)}:{PORT}", "--rdzv-id", run_id,
                # node 0 hosts the store: its address is not the machine's host name, by
                # which torch would otherwise decide
                "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", self.addr(node),
                "--max-restarts", "0", *command]

    def node_env(self, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")
               and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update({"GLOO_SOCKET_IFNAME": self.iface(node), "TP_SOCKET_IFNAME": self.iface(node),
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
                    "ZS_CLUSTER_NODE": str(node), "ZS_CLUSTER_IFACE": self.iface(node),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                env.get("PYTHONPATH")]))})
        env.update(extra or {})
        return env

    def start(self, command: Sequence[str], logs: Path, env: dict[str, str] | None = None,
              run_id: str | None = None) -> list[subprocess.Popen[bytes]]:
        """Start ``command`` on every node (each launcher in a session of its own, its
        output in ``logs/node<k>.log``); ``wait`` or ``stop`` them."""
        logs.mkdir(parents=True, exist_ok=True)
        run_id = run_id or f"box{os.getpid()}-{time.monotonic_ns()}"
        for k in range(self.nodes):
            with open(logs / f"node{k}.log", "wb") as log:
                self._procs.append(subprocess.Popen(
                    self.torchrun(k, command, run_id), cwd=ROOT, env=self.node_env(k, env),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return list(self._procs)

    def wait(self, timeout: float, grace: float = 30.0) -> list[int | None]:
        """Each node's exit status once all have exited; once one has failed the others get
        ``grace`` seconds (their peers' collectives break, or they wait for a node that
        never comes), then every node still running is stopped and reported as None, as
        at ``timeout``."""
        procs = self._procs
        wait_for(procs, time.monotonic() + timeout, grace)
        codes = [p.poll() for p in procs]
        self.stop()
        return codes

    def run(self, command: Sequence[str], logs: Path, timeout: float = 3600.0,
            env: dict[str, str] | None = None) -> dict[str, Any]:
        """``command`` on every node; what each link carried, each node's exit status."""
        before, start = self.counters(), time.perf_counter()
        self.start(command, logs, env)
        codes = self.wait(timeout)
        after = self.counters()
        return {"returncodes": codes, "seconds": time.perf_counter() - start,
                "links": [{"node": a["node"], "to_node": a["to_node"] - b["to_node"],
                           "from_node": a["from_node"] - b["from_node"]}
                          for a, b in zip(after, before)],
                "logs": str(logs)}

    def describe(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "nproc": self.nproc, "rate": self.rate, "mtu": self.mtu,
                "burst": self.burst, "latency_ms": self.latency_ms,
                "addresses": [self.addr(k) for k in range(self.nodes)],
                "namespaces": self.namespaces()}


def wait_for(procs: Sequence[subprocess.Popen[bytes]], deadline: float, grace: float) -> None:
    """Until every process has exited, or ``deadline`` (``time.monotonic()``) passed, or
    ``grace`` seconds went by after the first one failed (a node that fails makes the
    others fail or wait: its peers' collectives break, or an agent waits at the
    rendezvous for a node that never comes)."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            return
        time.sleep(0.2)


def _signal(pid: int, sig: int, group: bool = True) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def link_counters(iface: str | None = None) -> dict[str, int] | None:
    """This node's link counters, read inside the node (a worker's view): ``sent`` and
    ``received`` bytes of ``iface`` (default: ``$ZS_CLUSTER_IFACE``); None outside a
    cluster."""
    iface = iface or os.environ.get("ZS_CLUSTER_IFACE")
    if not iface:
        return None
    base = Path("/sys/class/net") / iface / "statistics"
    return {"sent": int((base / "tx_bytes").read_text()),
            "received": int((base / "rx_bytes").read_text())}


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM ignored inside the block (main thread only: elsewhere they cannot
    be changed and nothing is done)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``SystemExit`` here as SIGINT raises ``KeyboardInterrupt``,
    so a ``finally`` (the cluster's teardown) runs on each. SIGINT is taken explicitly: a
    process started in the background by a non-interactive shell (``cmd &`` in a script, a
    CI runner) inherits it ignored, and Python then leaves it so."""
    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# -- the raw transfer (run inside a node by measure_rate) ----------------------------------

def _receive(addr: str, port: int) -> None:
    """Prints the payload bytes received and the seconds from the first to the last."""
    total, first, last = 0, 0.0, 0.0
    with socket.create_server((addr, port)) as server:
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                last = time.perf_counter()
                first = first or last
                total += len(chunk)
    print(json.dumps({"bytes": total, "seconds": last - first}), flush=True)


def _send(addr: str, port: int, seconds: float) -> None:
    buf = b"\0" * (1 << 20)
    for _ in range(50):  # the peer's receiver may not listen yet
        try:
            conn = socket.create_connection((addr, port), timeout=30)
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
    else:
        raise RuntimeError(f"nothing listens on {addr}:{port}")
    end = time.perf_counter() + seconds
    with conn:
        while time.perf_counter() < end:
            conn.sendall(buf)


# -- the command ---------------------------------------------------------------------------

def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="processes per node")
    p.add_argument("--rate", default="1gbit", help="each link's rate each way (tc units)")
    p.add_argument("--prefix", default="zsbox", help="names of namespaces and interfaces")
    p.add_argument("--net", type=int, default=77, help="addresses 127.<net>.0.<k+1>")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--burst", default="256kb", help="tbf's bucket")
    p.add_argument("--out", help="the links' byte counts (JSON)")
    p.add_argument("--logs", help="each node's output (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the command")
    p.add_argument("--measure-rate", type=float, default=0.0, metavar="SECONDS",
                   help="first measure the link's rate with a raw transfer this long")
    p.add_argument("--check", action="store_true", help="say whether a cluster can be built")
    p.add_argument("--down", action="store_true",
                   help="remove the namespaces a killed run of this prefix left")
    p.add_argument("--receive", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--send", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.check or args.down or args.receive or args.send or command):
        p.error("give the training command after --, e.g. -- bench/compare.py --system "
                "ddp --out run.json")
    return args, command


def main(argv: list[str] | None = None) -> int:
    args, command = parse(argv)
    if args.receive:
        _receive(args.receive[0], int(args.receive[1]))
        return 0
    if args.send:
        _send(args.send[0], int(args.send[1]), float(args.send[2]))
        return 0
    if args.check:
        why = missing_requirements()
        print(why or "a cluster can be built here")
        return 1 if why else 0
    cluster = Cluster(args.nodes, args.nproc, args.rate, prefix=args.prefix, net=args.net,
                      mtu=args.mtu, burst=args.burst)
    if args.down:
        cluster._up = True
        cluster.down()
        return 0
    why = missing_requirements()
    if why:
        print(f"error: the cluster {why}", file=sys.stderr)
        return 2
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="zs-cluster-"))
    with stopped_by_signals(), cluster:
        result: dict[str, Any] = {"cluster": cluster.describe(), "command": shlex.join(command),
                                  "loadavg_before": loadavg()}
        if args.measure_rate:
            result["link_rate"] = cluster.measure_rate(args.measure_rate)
        result.update(cluster.run(command, logs, timeout=args.timeout))
        result["loadavg_after"] = loadavg()
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if all(code == 0 for code in result["returncodes"]) else 1


if __name__ == "__main__":
    sys.exit(main())

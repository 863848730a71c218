"""A fuzzer of every checkpoint loader, against checkpoints a stranger could hand us.

Starts from real checkpoints (DeepSpeed ZeRO-3, FSDP2's DCP, ours: written by
``tests/worlds/fuzz_sources.py``), applies the mutations of ``tests/support/mutations.py``
(every named one, then ``--cases`` random ones from ``--seed``) to a fresh copy each, and feeds
each copy to every loader of ``tests/support/fuzz_loaders.py``, each in a child forked from
this process (imports paid once) under a time limit and an address-space limit
(``RLIMIT_AS``: what the child had at the fork plus ``--memory-mib``). It requires, per
loader and case:

- no code executed: a payload's marker file never appears;
- no hang and no crash: the child answers within ``--timeout`` seconds;
- no allocation beyond the bound: a MemoryError or a failed allocation is a finding;
- either a ``CheckpointError`` that names a file of the checkpoint (and, for the named
  mutations, says what their entry expects), leaving an engine unchanged; or a load equal
  to the original's (the same refusal, where the original is refused: Lightning resumes
  only what Lightning wrote). Where no checksum covers the mutated bytes (our
  ``manifest.json``), equal weights are enough.

Every violation is printed with the case's name, seed and the loader's answer:

    python -m tests.support.fuzz --cases 300 --seed 1     # the long mode (docs/testing.md)
    python -m tests.support.fuzz --cases 0                # the named mutations only
    python -m tests.support.fuzz --only dcp/size_huge --loaders consolidate
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


@dataclass
class Outcome:
    """One loader's answer to one case, as the child reported it (or its death)."""

    loaded: bool = False
    weights: str | None = None
    full: str | None = None
    error: str | None = None
    message: str = ""
    untouched: bool | None = None
    died: str | None = None
    seconds: float = 0.0
    trace: str = ""
    root: str = ""
    """The checkpoint it loaded (messages name it)."""
    imported: list[str] = field(default_factory=list)
    """Modules the child imported: the parent imports them too, so later children have them."""


@dataclass
class Case:
    name: str
    source: str
    mutation: Any  # mutations.Mutation (None: the unmodified source)


@dataclass
class Report:
    cases: int = 0
    runs: int = 0
    refused: int = 0
    loaded: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------------------- sources
def make_sources(out: Path) -> Path:
    """The real writers' checkpoints under ``out`` (kept if already there)."""
    from tests.support.mutations import SOURCES

    if all((out / s).is_dir() for s in SOURCES):
        return out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(ROOT / "tests" / "worlds" / "fuzz_sources.py"), str(out)],
        env=env, cwd=out, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"writing the sources failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return out


# ---------------------------------------------------------------------------- children
def _child(loader: str, path: Path, scratch: Path, memory: int, write: int) -> None:
    """In the forked child: limit memory, load, report, exit without cleanup handlers."""
    from tests.support.fuzz_loaders import LOADERS

    os.setpgid(0, 0)
    log = os.open(scratch / "child.log", os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    status = open("/proc/self/status").read()
    vm = int(status.split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + memory, resource.RLIM_INFINITY))
    before = set(sys.modules)
    try:
        result: dict[str, Any] = {"loaded": True, **LOADERS[loader](path, scratch)}
    except BaseException as e:  # the report is the loader's answer, whatever it raised
        result = {"error": type(e).__name__, "message": str(e)[:6000],
                  "untouched": getattr(e, "untouched", None),
                  "trace": traceback.format_exc()[-4000:]}
    result["imported"] = sorted(set(sys.modules) - before)
    data = json.dumps(result).encode()
    while data:
        data = data[os.write(write, data):]
    os._exit(0)


def run_loader(loader: str, path: Path, scratch: Path, *, timeout: float, memory: int
               ) -> Outcome:
    """``loader`` on ``path`` in a forked child; its answer, or how it died."""
    scratch.mkdir(parents=True, exist_ok=True)
    read, write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _child(loader, path, scratch, memory, write)
        finally:
            os._exit(70)
    os.close(write)
    chunks, died = [], None
    while True:
        left = timeout - (time.monotonic() - start)
        ready, _, _ = select.select([read], [], [], max(left, 0))
        if not ready:
            died = f"no answer within {timeout:.0f} s (a hang?)"
            with_group_killed(pid)
            break
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - start
    if died is None and not chunks:
        died = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                else f"exited {os.WEXITSTATUS(status)} without an answer")
    if died is not None:
        return Outcome(died=died, seconds=seconds)
    return Outcome(**json.loads(b"".join(chunks)), seconds=seconds)


def with_group_killed(pid: int) -> None:
    """The child and anything it started (it leads its own process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------- the oracle
def _normal(text: str, root: Path) -> str:
    return text.replace(str(root), "<checkpoint>")


def judge(case: Case, loader: str, root: Path, marker: Path, got: Outcome, base: Outcome
          ) -> str | None:
    """What is wrong with ``got`` (``base``: the same loader on the unmodified source)."""
    if marker.exists():
        return "a payload ran (its marker file exists)"
    if got.died:
        return got.died
    text = f"{got.error}: {got.message}"
    if got.error == "MemoryError" or "can't allocate memory" in got.message or (
            "std::bad_alloc" in got.message):
        return f"allocated beyond the bound: {text}"
    expect = case.mutation.expect if case.mutation is not None else None
    if got.loaded:
        if expect is not None and loader not in case.mutation.unread_by:
            return f"loaded, where a refusal saying {expect!r} was expected"
        if not base.loaded:
            return f"loaded, where the original is refused ({base.error}: {base.message})"
        protected = case.mutation is None or case.mutation.protected
        if got.full == base.full or (not protected and got.weights == base.weights):
            return None
        return "loaded, but not what the original holds (undetected damage)"
    if not base.loaded and (got.error, _normal(got.message, root)) == (
            base.error, _normal(base.message, Path(base.root))):
        return None  # refused as the original is
    if got.error != "CheckpointError":
        return f"{text} (not a CheckpointError)\n{got.trace}"
    if str(root) not in got.message:
        return f"the refusal names no file of the checkpoint: {text}"
    if expect is not None and expect not in got.message:
        return f"refused, but without {expect!r}: {text}"
    if got.untouched is False:
        return f"the engine changed before the refusal: {text}"
    return None


# ---------------------------------------------------------------------------- the run
def all_cases(sources: Path, count: int, seed: int, named: bool = True) -> list[Case]:
    """Every named mutation of every source, then ``count`` random ones from ``seed``."""
    from tests.support.mutations import SOURCES, catalogue, random_mutation

    cases = []
    if named:
        for source in SOURCES:
            cases += [Case(f"{source}/{name}", source, m)
                      for name, m in catalogue(source).items()]
    for i in range(count):
        rng = random.Random(f"{seed}:{i}")
        source = rng.choice(SOURCES)
        kind, mutation = random_mutation(source, sources / source, rng)
        cases.append(Case(f"{source}/random-{seed}-{i} ({kind})", source, mutation))
    return cases


ALWAYS = ("engine", "consolidate")
"""With ``rotate``, the loaders every case meets; the others take turns."""


class Fuzzer:
    def __init__(self, sources: Path, work: Path, loaders: list[str], *, timeout: float,
                 memory: int, rotate: bool = False, verbose: bool = False) -> None:
        self.sources, self.work, self.loaders = sources, work, loaders
        self.timeout, self.memory, self.verbose = timeout, memory, verbose
        self.rotate = rotate
        self.report = Report()
        self.baseline: dict[tuple[str, str], Outcome] = {}
        self._n = 0

    def _copy(self, source: str) -> tuple[Path, Path, Path]:
        """A fresh copy of ``source`` to mutate, a good copy beside it (the target of links
        out of it), and the marker a payload would create."""
        self._n += 1
        case_dir = self.work / f"case{self._n}"
        root = case_dir / "checkpoint"
        shutil.copytree(self.sources / source, root, symlinks=True)
        shutil.copytree(self.sources / source, case_dir / "outside", symlinks=True)
        return case_dir, root, case_dir / "payload-ran"

    def _loaders_for(self, case: Case) -> list[str]:
        others = [name for name in self.loaders if name not in ALWAYS]
        if not self.rotate or case.mutation is None or not others:
            return self.loaders
        turn = others[self.report.cases % len(others)]
        return [name for name in self.loaders if name in ALWAYS or name == turn]

    def run(self, case: Case) -> None:
        from tests.support.mutations import Context

        case_dir, root, marker = self._copy(case.source)
        if case.mutation is not None:
            rng = random.Random(case.name)
            case.mutation.edit(Context(root, case_dir / "outside", marker, rng))
        self.report.cases += 1
        for loader in self._loaders_for(case):
            got = run_loader(loader, root, case_dir / f"scratch-{loader}",
                             timeout=self.timeout, memory=self.memory)
            got.root = str(root)
            self.report.runs += 1
            if case.mutation is None:
                _preload(got.imported)
                gc.freeze()  # the children's reference counting then copies fewer pages
                self.baseline[(case.source, loader)] = got
                problem = got.died or (None if got.loaded or got.error in (
                    "CheckpointError", "ValueError") else f"{got.error}: {got.message}")
            else:
                problem = judge(case, loader, root, marker, got,
                                self.baseline[(case.source, loader)])
            self.report.loaded += got.loaded
            self.report.refused += not got.loaded and got.died is None
            if self.verbose:
                state = "loaded" if got.loaded else got.died or f"{got.error}: {got.message}"
                print(f"  {case.name:48} {loader:11} {got.seconds:5.2f}s {state[:150]}",
                      flush=True)
            if problem is not None:
                finding = {"case": case.name, "loader": loader, "problem": problem,
                           "seconds": round(got.seconds, 2)}
                self.report.findings.append(finding)
                print(f"FINDING {case.name} [{loader}]: {problem}", flush=True)
        _remove(case_dir)


def _preload(names: list[str]) -> None:
    """Import what a child needed (torch imports much lazily, seconds on every fork)."""
    for name in names:
        if name.startswith("_"):
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S112 - a module that only imports in some contexts
            continue


def _remove(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):  # FIFOs and links are removed, not read
        if p.is_symlink() or not p.is_dir():
            p.unlink()
        else:
            p.rmdir()
    path.rmdir()


def fuzz(sources: Path, count: int, seed: int, loaders: list[str], *, named: bool = True,
         only: str | None = None, timeout: float = 60.0, memory_mib: int = 1024,
         rotate: bool = False, verbose: bool = False, work: Path | None = None) -> Report:
    """Run the cases (after each source's unmodified baseline); the report of findings."""
    import torch

    from tests.support.fuzz_loaders import FRAMEWORKS
    from tests.support.mutations import SOURCES

    torch.set_num_threads(1)  # the children fork from here: no thread pools to inherit
    if any(loader in FRAMEWORKS for loader in loaders):
        import lightning.pytorch  # noqa: F401  (paid once, before the forks)

        import zero_strategy.accelerate  # noqa: F401
        import zero_strategy.lightning  # noqa: F401
    import tests.support.fuzz_loaders  # noqa: F401
    import zero_strategy.checkpoint.convert  # noqa: F401

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zs-fuzz-", dir=work) as tmp:
        fuzzer = Fuzzer(sources, Path(tmp), loaders, timeout=timeout,
                        memory=memory_mib * MiB, rotate=rotate, verbose=verbose)
        for source in SOURCES:
            fuzzer.run(Case(f"{source}/original", source, None))
        for case in all_cases(sources, count, seed, named):
            if only is None or case.name.startswith(only):
                fuzzer.run(case)
    fuzzer.report.seconds = round(time.monotonic() - start, 1)
    return fuzzer.report


def main(argv: list[str] | None = None) -> int:
    from tests.support.fuzz_loaders import LOADERS

    parser = argparse.ArgumentParser(prog="python -m tests.support.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=100, help="random cases (after the "
                        "named ones)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loaders", default=",".join(LOADERS),
                        help=f"comma-separated, of {','.join(LOADERS)}")
    parser.add_argument("--sources", type=Path, help="where the real checkpoints are (or are "
                        "written, once); default: a temporary directory")
    parser.add_argument("--no-named", action="store_true", help="random cases only")
    parser.add_argument("--only", help="cases whose name starts with this")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per load")
    parser.add_argument("--memory-mib", type=int, default=1024,
                        help="address space a load may add to what the child starts with")
    parser.add_argument("--rotate", action="store_true", help="each case meets engine and "
                        "consolidate, and one other loader in turn (the integration tier's "
                        "budget); by default every case meets every loader")
    parser.add_argument("--report", type=Path, help="write the report here as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per load")
    args = parser.parse_args(argv)
    loaders = args.loaders.split(",")
    unknown = sorted(set(loaders) - set(LOADERS))
    if unknown:
        parser.error(f"unknown loaders {unknown}")
    with tempfile.TemporaryDirectory(prefix="zs-fuzz-sources-") as tmp:
        sources = make_sources(args.sources or Path(tmp))
        report = fuzz(sources, args.cases, args.seed, loaders, named=not args.no_named,
                      only=args.only, timeout=args.timeout, memory_mib=args.memory_mib,
                      rotate=args.rotate, verbose=args.verbose)
    print(f"{report.cases} cases, {report.runs} loads ({report.refused} refused, "
          f"{report.loaded} loaded) in {report.seconds} s: {len(report.findings)} findings")
    if args.report is not None:
        args.report.write_text(json.dumps(asdict(report), indent=1))
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())

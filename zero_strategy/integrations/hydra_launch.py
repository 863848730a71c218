"""Lightning's and Fabric's process launcher, made to run one Hydra job per world.

Lightning starts the other local ranks by re-running ``sys.argv``; under Hydra that re-runs a
whole ``-m`` sweep in every child. The mixin here gives each child the current job's resolved
overrides instead, and ends one job's world before a multirun starts the next.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..comm import groups

_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_HYDRA_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# Hydra overrides the children set themselves, or that only mean something to a sweep.
_CHILD_OWNED = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.sweeper", "hydra.launcher",
                "hydra.job.name", "hydra.output_subdir", "hydra.job.num", "hydra.job.id")


def _hydra_job_dir() -> str | None:
    """The running Hydra job's output directory, or None outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    return str(HydraConfig.get().runtime.output_dir)


def _script_command(absolute: Callable[[str], str] = os.path.abspath) -> list[str]:
    import __main__  # imported late: the main module of the process that launches

    if __main__.__spec__ is None:
        return [sys.executable, absolute(sys.argv[0])]
    return [sys.executable, "-m", __main__.__spec__.name]


def _hydra_cli_flags(argv: list[str]) -> list[str]:
    """--config-path/--config-name/--config-dir from the command line; overrides come from
    Hydra itself (sys.argv still holds the whole sweep in a multirun)."""
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _HYDRA_FLAGS and i + 1 < len(argv):
            kept += argv[i : i + 2]
            i += 2
            continue
        if arg.split("=", 1)[0] in _HYDRA_FLAGS and "=" in arg:
            kept.append(arg)
        i += 1
    return kept


def child_command(local_rank: int) -> tuple[list[str], str | None]:
    """The command line (and cwd) that runs rank ``local_rank`` of the current job.

    Outside Hydra: this script with its arguments, as Lightning does. Under Hydra: this job's
    resolved overrides in RUN mode, writing into this job's output directory. Lightning
    re-runs ``sys.argv``, which in a ``-m`` multirun re-runs the whole sweep in every child.
    """
    if _hydra_job_dir() is None:
        return _script_command() + sys.argv[1:], None
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    cfg = HydraConfig.get()
    hydra_overrides = [o for o in cfg.overrides.hydra
                       if not str(o).split("=", 1)[0].lstrip("+~").startswith(_CHILD_OWNED)]
    # The job may have changed directory (hydra.job.chdir): resolve from where it started.
    command = _script_command(to_absolute_path) + _hydra_cli_flags(sys.argv[1:])
    command += [str(o) for o in cfg.overrides.task] + [str(o) for o in hydra_overrides]
    command += [
        f'hydra.run.dir="{cfg.runtime.output_dir}"',
        f"hydra.job.name={cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",  # the rank-0 process already wrote this job's config
        "hydra.mode=RUN",  # even if the primary config asks for MULTIRUN
    ]
    return command, get_original_cwd()


@dataclasses.dataclass
class _LaunchedWorld:
    """Children a launcher started for one Hydra job, and the environment before it."""

    job: str
    procs: list[subprocess.Popen]
    env_before: dict[str, str | None]

    def end(self, timeout: float = 300.0) -> None:
        for proc in self.procs:
            proc.wait(timeout=timeout)  # they finish the job the parent has just finished
        groups.destroy_default_group()
        for key, value in self.env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_CURRENT_WORLD: _LaunchedWorld | None = None


class HydraJobLauncherMixin:
    """Makes Lightning's/Fabric's subprocess launchers run one Hydra job per world.

    Children get the current job's overrides (see ``child_command``). In a multirun the parent
    process runs the jobs one after another; when the next job launches, the previous job's
    world is ended first (children awaited, process group destroyed, launch variables
    restored), otherwise ``LOCAL_RANK`` left in the environment would make the next job think
    its processes were created externally and wait forever for peers that never start.
    """

    cluster_environment: Any
    num_processes: int
    num_nodes: int
    procs: list[subprocess.Popen]

    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        global _CURRENT_WORLD
        if _CURRENT_WORLD is not None and _CURRENT_WORLD.job != _hydra_job_dir():
            _CURRENT_WORLD.end()
            _CURRENT_WORLD = None
        return super().launch(function, *args, **kwargs)  # type: ignore[misc]

    def _call_children_scripts(self) -> None:
        global _CURRENT_WORLD
        self._check_can_spawn_children()  # type: ignore[attr-defined]
        env_before = {key: os.environ.get(key) for key in _LAUNCH_ENV}
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        self.procs = []
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            command, cwd = child_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))
        job = _hydra_job_dir()
        if job is not None:
            _CURRENT_WORLD = _LaunchedWorld(job, list(self.procs), env_before)

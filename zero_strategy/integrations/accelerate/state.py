"""Accelerate's state folder as ``ZeroAccelerator`` writes and reads it: where the engine's
sharded checkpoint lives inside it, and the checks made before ``load_state`` lets Accelerate
read any of its files (each a regular file inside the folder; registered objects' states
unpickled with ``weights_only=True`` only)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelerate.utils import load as accelerate_load

from ...checkpoint.errors import CheckpointError
from ...checkpoint.verify import member, refusal

CHECKPOINT_SUBDIR = "zero_checkpoint"
"""Where ``save_state`` puts the engine's sharded checkpoint inside Accelerate's state folder."""
CHECKPOINT_TAG = "state"
"""The engine checkpoint's tag: a second save into the same folder replaces the first."""

# The files Accelerate's load_state reads from a state folder, by name.
_ACCELERATE_FILES = re.compile(
    r"(model|pytorch_model|optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.(bin|safetensors)"
    r"|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|scaler\.pt")


def check_state_folder(folder: Path) -> None:
    """Each file Accelerate will read is a regular file inside the folder: no link out of it,
    no FIFO or device (reading ``/dev/zero`` never ends). What those files contain is read by
    Accelerate (``weights_only=True``, except registered objects: see ``read_custom_states``)."""
    for entry in folder.iterdir():
        if _ACCELERATE_FILES.fullmatch(entry.name):
            member(folder, entry, f"Accelerate state file {entry.name!r}")


def read_custom_states(folder: Path, count: int) -> list[Any]:
    """The states of the ``count`` registered objects, unpickled with ``weights_only=True``
    (tensors, numbers, strings, containers: no code runs); a file that needs more is refused."""
    states = []
    for index in range(count):
        file = folder / f"custom_checkpoint_{index}.pkl"
        if not file.exists() and not file.is_symlink():
            states.append(None)  # Accelerate's own count check reports it
            continue
        member(folder, file, f"registered object {index}'s state")
        try:
            states.append(accelerate_load(file, map_location="cpu", weights_only=True))
        except Exception as e:  # the restricted unpickler refused something: never retried
            raise CheckpointError(
                f"{file}: refused: cannot be unpickled with weights_only=True ({refusal(e)}). "
                "Accelerate would load it with weights_only=False, which runs any code the "
                "file holds; a registered object's state_dict() must hold plain data "
                "(tensors, numbers, strings, lists, dicts)") from e
    return states


@contextlib.contextmanager
def custom_states_from(states: list[Any]) -> Iterator[None]:
    """Accelerate (1.x) unpickles registered objects' files with ``weights_only=False``.
    For the duration of one ``load_state`` its loader hands out the states read safely
    beforehand instead (``accelerate.accelerator`` calls it by this module-level name)."""
    import accelerate.accelerator as accelerator_module

    original = accelerator_module.load_custom_state

    def load(obj: Any, path: str, index: int = 0) -> None:
        obj.load_state_dict(states[index])

    accelerator_module.load_custom_state = load
    try:
        yield
    finally:
        accelerator_module.load_custom_state = original

"""The checkpoint layer's one error type, in its own module so that readers, converters and
adapters can name it without importing the writer."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked; the message names the file and the cause."""

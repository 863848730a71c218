"""The engine: ``ZeroEngine`` (``facade.py``) over its parts, built by ``setup.py`` (the disk
tier's agreement in ``disk.py``), trained by ``step.py``, saved and closed by ``state.py``."""

from .facade import ZeroEngine

__all__ = ["ZeroEngine"]

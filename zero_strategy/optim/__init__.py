"""Optimizers over what a rank holds: elementwise optimizers on shard pieces (``sharded.py``),
whole-parameter optimizers on owning ranks (``owner.py``), the rebuilt inner optimizer
(``inner.py``), optimizer state in torch's and the checkpoint's formats (``state.py``), and
several optimizers used as one (``combined.py``)."""

"""Sharded checkpoints: writing them atomically (``write.py``), checking a directory nobody
vouches for before a tensor is read (``verify.py``), and reading into any world size and
stage, or consolidated into one state dict (``read.py``)."""

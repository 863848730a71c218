"""Where offloaded state rests and how it moves: host buffers and the copies to and from the
compute device (``transfers.py``)."""

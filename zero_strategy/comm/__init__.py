"""Communication: every ``torch.distributed`` call of the package (``collectives.py``) and the
block-wise int8 codec of quantized collectives (``int8.py``)."""

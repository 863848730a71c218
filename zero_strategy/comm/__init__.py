"""Communication: every ``torch.distributed`` call of the package, collectives over a group
(``collectives.py``) and the default group itself (``groups.py``); the handles a started
collective returns (``handles.py``), the rendezvous store's client (``store.py``) and the
block-wise int8 codec of quantized collectives (``int8.py``)."""

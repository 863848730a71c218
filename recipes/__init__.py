"""The Hydra recipes (``python recipes/train.py``): a package, so that every module here is
imported by its name (``recipes.launch``, ``recipes.worker``) in any process, including one
a cluster launcher starts in a fresh interpreter, which unpickles the task function by that
name. Install the project (``pip install -e ".[recipes]"``) to make it importable from
anywhere; the configs stay in ``conf/`` beside it."""

"""The sharding machinery under the engine: the plan (stage -> what is sharded), flat layouts,
units, the parameter and gradient stores, buffers, the runtime of forward and backward with
its hooks, parameter access outside forward, and sharded initialisation."""

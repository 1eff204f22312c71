"""Many processes: the sharding plan, the sharded embedding collection, launch and checkpoints."""

"""Scale-out: the device mesh and the sharding rules (sharding.py); per-device memory from a config (memory_plan.py)."""

"""Scale-out: the device mesh and the sharding rules (sharding.py)."""

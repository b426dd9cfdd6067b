"""Engine state: the device pools (cache.py) and the host allocators over them (allocator.py, prefix_cache.py: no jax)."""

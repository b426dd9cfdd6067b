from .checkpoint import has_orbax, restore_params, save_params
from .loader import CheckpointError, load_params, read_checkpoint_names


def load_model_params(path: str, cfg, dtype, load_mtp: bool = True, placement=None):
    """Params from a converted orbax copy when `path` has one, else from safetensors (placement: each param's
    sharding from its specs, each device shard read alone; loader.load_params). Returns (params, num_mtp_layers)."""
    if has_orbax(path):
        params, mtp = restore_params(path, cfg, dtype)
        if not load_mtp and mtp:
            params.pop("mtp", None)
            mtp = 0
        return params, mtp
    return load_params(path, cfg, dtype, load_mtp=load_mtp, placement=placement)

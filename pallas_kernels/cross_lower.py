"""Lower a jitted function for CUDA on a machine without a GPU (the Pallas GPU lowering rules run;
Triton's own compile does not). Used by the CUDA lowering tests and scripts/gpu_check.sh's preflight.

jax >= 0.11 asks the target GPU for its compute capability while lowering a Triton kernel; an
abstract device names it (the H200 we are lent by default)."""
from __future__ import annotations

import jax
from jax.export import DisabledSafetyCheck, export

TRITON_CALL = "__gpu$xla.gpu.triton"
TARGET = "NVIDIA H200"


def lower_for_cuda(fn, *specs, device_kind: str = TARGET) -> str:
    """The StableHLO text of jit(fn) lowered for CUDA at the given ShapeDtypeStructs."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        exp = export(jax.jit(fn), platforms=["cuda"],
                     disabled_checks=[DisabledSafetyCheck.custom_call(TRITON_CALL)])(*specs)
    return exp.mlir_module()

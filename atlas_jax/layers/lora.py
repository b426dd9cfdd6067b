"""Multi-adapter LoRA on one flat token axis: each token adds its own adapter's low-rank delta.

The pool for one projection holds every resident adapter: A [S, in, R], B [S, R, out] (scale folded
into B; slot 0 = zeros = the base model). Instead of gathering each token's adapter (punica's bgmv),
x is multiplied by every slot's A at once and the other slots' columns are zeroed, so the whole
batch is two dense matmuls of width S*R — one compiled shape for any mix of adapters, and at the
small S*R of a serving pool (e.g. 4 x 16) a few percent of the base projection's work.
"""
import jax.numpy as jnp


def lora_delta(x, a, b, slot):
    """x [N, in]; a [S, in, R]; b [S, R, out]; slot [N] int32 (0 = no adapter) -> [N, out] (x's dtype)."""
    s, _, r = a.shape
    xa = jnp.einsum("ni,sir->nsr", x, a.astype(x.dtype))                             # every slot's A
    xa = jnp.where(jnp.arange(s)[None, :, None] == slot[:, None, None], xa, jnp.zeros((), xa.dtype))
    return xa.reshape(x.shape[0], s * r) @ b.reshape(s * r, -1).astype(x.dtype)

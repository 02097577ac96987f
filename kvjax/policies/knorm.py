"""`knorm`: keep the tokens whose keys have the lowest L2 norm, per layer and KV head.

Acts at prefill only (decode appends). RoPE rotates pairs of channels, so the stored
(rotated) key has the norm of the unrotated one.
"""

import jax.numpy as jnp

from kvjax.policies.base import Policy, register


class KNorm(Policy):
  name = "knorm"

  def scores(self, ctx):
    return -jnp.linalg.norm(ctx.k_LBKSD.astype(jnp.float32), axis=-1)


register(KNorm())

"""The `none` layout: no K/V at all, only the token ids. Every step recomputes the whole
prefix (O(S^2) work per token): the quadratic baseline and the reference. The model never
reads this cache; `kvjax.decode.step.run` runs the recompute mode when it is handed one."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import base


@struct.dataclass
class TokenBuffer:
  tokens: jax.Array      # [B, S] int32
  lengths: jax.Array     # [B] int32
  spec: base.CacheSpec = struct.field(pytree_node=False)

  AXES: ClassVar[dict] = {"tokens": (base.BATCH, base.TOKENS), "lengths": base.PER_SEQUENCE}


class NoCache(base.Layout):
  name = "none"
  sized_as = "contiguous"  # sized as the K/V it recomputes at every step
  recomputes = True

  def init(self, spec: base.CacheSpec) -> TokenBuffer:
    B, S = spec.batch, spec.capacity
    return TokenBuffer(tokens=jnp.zeros((B, S), jnp.int32), lengths=jnp.zeros((B,), jnp.int32),
                       spec=spec)

  def write(self, buf: TokenBuffer, tokens_BT, positions_BT) -> TokenBuffer:
    """Append token ids (not K/V): padding (position -1) goes out of range and is dropped."""
    B, S = buf.tokens.shape
    rows = jnp.arange(B)[:, None]
    slots = jnp.where(positions_BT >= 0, positions_BT, S)
    lengths = buf.lengths + jnp.sum(positions_BT >= 0, axis=1).astype(jnp.int32)
    return TokenBuffer(tokens=buf.tokens.at[rows, slots].set(tokens_BT, mode="drop"),
                       lengths=lengths, spec=buf.spec)

  def closed_form_bytes(self, spec: base.CacheSpec) -> int:
    return 4 * spec.batch * spec.capacity + 4 * spec.batch

  def asymptotic(self, cfg) -> float | None:
    """The token id, recomputed into K/V at every step (a policy's compacted cache holds
    K and V: counted as such)."""
    from kvjax import policies
    return None if policies.evicts(cfg.cache) else 4.0


base.register(NoCache())

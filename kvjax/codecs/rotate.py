"""`cache.rotate`: an orthogonal change of basis of every head's K, Q and V around the cache.

With R an orthogonal D x D matrix (R Rᵀ = I), the model's attention layer
(`kvjax.model.layers`) stores k' = k R and v' = v R (keys after RoPE) and reads with
q' = q R, so every logit q'·k' = q R Rᵀ kᵀ = q·k is unchanged in exact arithmetic and so is
every probability; the attention output o' = Σ p v' = o R is rotated back, o = o' Rᵀ.
A quantizer then sees rotated vectors, whose outliers are spread over all D channels
(a Hadamard rotation of a vector with one large channel gives D channels of equal size),
so a per-token scale fits them better. The codecs, layouts, the residual window,
`cache.keep_first`, the attention reads (native kernel included) and the policies never
know: they see ordinary vectors. Policies that score by q·k (snapkv, h2o, tova) or by key
norms (knorm: |k R| = |k|) keep the same tokens; window and sinks do not read values.

  none      no rotation (the default)
  hadamard  the Sylvester Hadamard matrix / sqrt(D) (`scipy.linalg.hadamard`): D must be
            a power of two
  random    a Haar-random orthogonal matrix (`scipy.stats.ortho_group`) from
            `cache.rotate_seed` (recorded in every row's config), any D

Cost of a read: one [.., D] x [D, D] matmul per query head and per output head of each
new token (2·D² flops each; K and V heads once per written token), computed in float32 at
full precision and cast back. A fast Walsh-Hadamard transform would take D·log2 D adds; at
the head sizes used here the matmul is one small library call, so it is not built. The
cache's bytes do not change.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError

KINDS = ("none", "hadamard", "random")


def check(cache_cfg, model_cfg) -> None:
  """Host-side: a known kind, and a power-of-two head_dim for `hadamard`."""
  kind, D = cache_cfg.rotate, model_cfg.D
  if kind not in KINDS:
    raise KvjaxError(f"unknown cache.rotate '{kind}'; use one of {', '.join(KINDS)}")
  if kind == "hadamard" and D & (D - 1):
    raise KvjaxError(f"cache.rotate=hadamard needs a power-of-two head_dim, got {D}; use "
                     "cache.rotate=random (any head_dim) or none")


@functools.lru_cache(maxsize=16)
def matrix(kind: str, D: int, seed: int = 0) -> np.ndarray | None:
  """R [D, D] float32 for a `cache.rotate` kind (None: `none`)."""
  if kind == "none":
    return None
  if kind == "hadamard":
    from scipy.linalg import hadamard
    r = hadamard(D) / np.sqrt(D)
  else:
    from scipy.stats import ortho_group
    r = ortho_group.rvs(D, random_state=seed)
  return np.asarray(r, np.float32)


def of(cache_cfg, D: int) -> np.ndarray | None:
  """The rotation a cache config asks for at head_dim D (None: none)."""
  return matrix(cache_cfg.rotate, D, cache_cfg.rotate_seed)


def apply(x_D: jax.Array, r_DD, back: bool = False) -> jax.Array:
  """x R (or x Rᵀ with `back`) over the last axis, in float32, in x's dtype."""
  r = jnp.asarray(r_DD.T if back else r_DD)
  y = jnp.einsum("...d,de->...e", x_D.astype(jnp.float32), r,
                 precision=jax.lax.Precision.HIGHEST)
  return y.astype(x_D.dtype)

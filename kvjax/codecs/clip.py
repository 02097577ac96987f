"""`cache.clip`: how a quantized codec (`quant.ScaledCodec` and its subclasses) chooses the
range each group's codes cover.

  none  the whole range: the absmax (symmetric codecs) or min..max about the midpoint
        (asymmetric), so every element is within half a step of its code (quant's bounds)
  mse   the group is quantized at every ratio r of RATIOS (1, 0.95, ..., 0.4) of that range
        and keeps the codes whose decoded group has the least squared error, r = 1 on ties

With `mse` a few large elements are clipped to the range's ends so that every other one
gets finer steps; at 2 and 4 bits that is most of a Gaussian-like (rotated) group's error,
at 8 bits the full range always wins. The error is computed from the stored (bf16) scale
and zero exactly as `decode` reads them, and r = 1 is a candidate, so no group errs more
than unclipped (a non-finite error compares false: the full range stays). The search runs
per group at write (len(RATIOS) encodings a write), with no calibration data; the stored
layout, the bytes and every read are unchanged. It minimises the error of the stored
vectors, not of the attention: per-channel keys (`cache.k_axis=channel`) group one
channel over many tokens, where clipping flattens an extreme token (an attention sink's
key), which raised KL on SmolLM2 (docs/experiments.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from kvjax.errors import KvjaxError

RATIOS = tuple(round(1 - 0.05 * i, 2) for i in range(13))  # widest first
KINDS = ("none", "mse")


def check(cache_cfg, codecs: dict) -> None:
  """Host-side: a known kind, and `mse` only where a codec in use has ranges to clip (a
  `clip` knob: `quant.ScaledCodec` and its subclasses)."""
  kind, names = cache_cfg.clip, (cache_cfg.k_codec, cache_cfg.v_codec)
  if kind not in KINDS:
    raise KvjaxError(f"unknown cache.clip '{kind}'; use one of {', '.join(KINDS)}")
  if kind != "none" and not any(hasattr(codecs.get(n), "clip") for n in names):
    raise KvjaxError(f"cache.clip={kind} chooses quantized codecs' ranges, but cache.k_codec="
                     f"{names[0]} and cache.v_codec={names[1]} store floats; choose a quantized "
                     "codec (int8, int4, int2, fp8_e4m3, fp8_e5m2, nf4, nf2) or cache.clip=none")


def search(codec, xg, red):
  """(codes, scale, zero) of the groups `xg` (reduced over axis `red`) at `codec.clip`'s
  range: `codec._quantize(xg, red, r)` at r = 1, or at the RATIOS ratio of least error."""
  best = codec._quantize(xg, red)
  if codec.clip == "none":
    return best
  err = sq_error(codec, xg, red, best)
  for r in RATIOS[1:]:
    cand = codec._quantize(xg, red, r)
    e = sq_error(codec, xg, red, cand)
    pick = e < err
    err = jnp.where(pick, e, err)
    best = tuple(None if b is None else jnp.where(pick, c, b) for b, c in zip(best, cand))
  return best


def sq_error(codec, xg, red, quantized):
  """Squared error per group of (codes, scale, zero) against `xg`, decoded as `decode`
  decodes them: z + (c - h) s for asymmetric codecs, level(c) s for symmetric ones."""
  codes, scale, zero = quantized
  s = scale.astype(jnp.float32)
  if codec.asym:
    y = zero.astype(jnp.float32) + (codes.astype(jnp.float32) - codec.half) * s
  else:
    y = codec._levels(codes) * s
  return jnp.sum(jnp.square(y - xg), red, keepdims=True)

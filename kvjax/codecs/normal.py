"""Normal-float codecs, nf4 and nf2: 2^b fixed levels spaced as the quantiles of a unit
normal, on the scale machinery of `quant.ScaledCodec` (per-token absmax scales, groups
along head_dim with `cache.group_size`, per-channel keys with `cache.k_axis=channel`).

  x̂ = s · ℓ[c],  s >= max|x| over the group (bf16, rounded up),  c = the nearest level
  to x / s (4 or 2 bits, packed in bit planes as int4 / int2),  ℓ in [-1, 1]

The levels (`levels`) follow the NF4 construction: the unit normal's quantiles at 2^(b-1)
evenly spaced probabilities from `offset` down to 1/2 above zero and 2^(b-1) - 1 below it,
zero itself, all divided by the largest, so ±1 and 0 are levels; `offset` = 1 - (1/(2n) +
1/(2(n-1))) / 2 for n = 2^b levels (0.9677 at 4 bits, 0.8542 at 2: nf2's levels are -1, 0,
0.436, 1). Each level is then rounded to bfloat16, so the levels are
exact in the bf16 and float32 reads alike. No calibration data: the levels assume
roughly normal values within a group, which a rotation (`cache.rotate`) makes likelier.
So |x - x̂| <= s · (the widest gap between adjacent levels) / 2; a uniform grid of the same
bits has the same bound at every magnitude, these levels are denser near zero.

Bytes: the packed codes plus one bf16 scale per group (no zero point): int4's bytes less
its zeros. Reads: `qk` / `pv` are `ScaledCodec`'s with the codes looked up in
the levels, so the grouped, reference and native (XLA dots) reads all hold; the CPU read
kernel has no level table and neither has the Pallas kernel (`stored` says None: not
`ScaledCodec`'s integer codes), so `model.attention=pallas` is refused
for these codecs, and the accelerator program's folded read takes their own reads.
"""

from __future__ import annotations

import dataclasses
import functools
from statistics import NormalDist

import jax.numpy as jnp
import numpy as np

from kvjax.codecs import base, packing, quant


@functools.lru_cache(maxsize=None)
def levels(bits: int) -> tuple:
  """The 2^bits levels in [-1, 1], ascending, each a bfloat16 value (see the module doc)."""
  n = 2 ** bits
  offset = 1 - 0.5 * (1 / (2 * n) + 1 / (2 * (n - 1)))
  ppf = NormalDist().inv_cdf
  pos = [ppf(p) for p in np.linspace(offset, 0.5, n // 2 + 1)[:-1]]
  neg = [-ppf(p) for p in np.linspace(offset, 0.5, n // 2)[:-1]]
  lv = np.sort(np.array(neg + [0.0] + pos)) / max(pos)
  return tuple(float(x) for x in lv.astype(jnp.bfloat16).astype(np.float32))


@dataclasses.dataclass(frozen=True)
class NormalFloat(quant.ScaledCodec):
  """`ScaledCodec` (symmetric, absmax scales) with codes that index fixed normal levels."""

  kind: str = "nf"
  storage = None  # codes index levels: read through its own qk / pv only (no stored-type dot)

  def _quantize(self, xg, red, r: float = 1.0):
    lv = jnp.asarray(levels(self.bits), jnp.float32)
    amax = jnp.max(jnp.abs(xg), red, keepdims=True) * r
    scale = packing.round_up_bf16(jnp.maximum(amax, packing.TINY))
    y = jnp.clip(packing.div(xg, scale.astype(jnp.float32)), -1.0, 1.0)
    codes = jnp.searchsorted((lv[1:] + lv[:-1]) / 2, y)  # the nearest level's index
    return codes.astype(jnp.uint8), scale, None

  def _levels(self, codes):
    return jnp.asarray(levels(self.bits), jnp.float32)[codes]

  def encode(self, x_TD):
    out = super().encode(x_TD)
    return {**out, "codes": packing.pack(out["codes"], self.bits)}

  def codes(self, enc: dict, dtype=jnp.float32):
    """Each element's level ℓ[c] in `dtype` (exact: the levels are bf16 values)."""
    c = packing.unpack(enc["codes"], self.bits)
    return jnp.asarray(levels(self.bits), jnp.float32)[c].astype(dtype)


base.register(NormalFloat("nf4", jnp.uint8, bits=4))
base.register(NormalFloat("nf2", jnp.uint8, bits=2))

"""Quantized cache codecs: int8 (symmetric), int4 / int2 (asymmetric, packed), fp8 e4m3 / e5m2.

Every codec stores a dict of leaves, each with the token axis at -2:
  codes [..., T, D * bits / 8]  int8 | packed uint8 | float8 bits as uint8
  scale [..., T, n] (per token, n = D / group_size groups along head_dim)
        or [..., T / U, D] (`axis="channel"`: one scale per channel per U tokens, KIVI keys)
  zero  like scale, asymmetric codecs only.

Math (x̂ is what the attention effectively reads; s, z the *stored* scale and zero):
  int8      x̂ = s * c,            c = round(x / s) in [-127, 127], s >= max|x| / 127
  int4/int2 x̂ = z + (c - h) * s,  c in [0, 2h], h = (2^bits - 1) / 2, z = group midpoint
  fp8       x̂ = s * c,            c = fp8(x / s), s >= max|x| / fp8_max
So |x - x̂| <= s/2 for the integer codecs and <= max(2^-(m+1) |x|, s * 2^(e_min - m - 1))
for fp8 (m mantissa bits, e_min the smallest normal exponent). The codes are computed
against the stored (rounded) scale and zero, so the bounds hold for what is stored.

With `cache.clip=mse` (`kvjax.codecs.clip`) the range is searched per group, so the bounds
hold inside the chosen range and each group errs no more than unclipped.

Decisions, and why:
  - Scales and zeros are bfloat16: it has float32's exponent range, so the scale of any
    finite input is representable (fp16 overflows at 65504 and underflows at 6e-8); its
    8-bit mantissa costs nothing in accuracy because the scale is rounded *up* before the
    codes are computed (the clipping range always covers the group) and the zero is
    rounded before the codes too. Two bytes halve fp32's metadata (int4, D=128, whole-head
    groups: 64 payload + 4 metadata bytes per vector).
  - fp8 carries a per-token (per-group) scale: unscaled e4m3 turns values above 448 into
    NaN and flushes |x| < 2^-9 to zero; with the scale the error is purely relative at
    2 bytes per head vector (1.6% at D=128).
  - The asymmetric zero is the group midpoint, so z + (c - h) * s never overflows even for
    inputs near float32's limits (min + c * s would).
  - Scales are floored at the smallest normal float32, so all-zero and constant groups
    get a finite scale (no 0/0).
  - Non-finite input propagates, as with the fp32 cache: a group holding a NaN or +-Inf
    stores scale (and zero) = NaN, so the whole group reads back as NaN and the attention
    shows it; other groups are unaffected. Nothing is silently clamped away.

Reading never dequantizes the cache: per-token scales are folded into the logits (K) and
the probabilities (V); channel scales are folded into the query (K). Codes are widened
only one block of C stored tokens at a time (`qk`/`pv`, called by the
attention's blockwise read), because XLA:CPU materializes a converted operand of a dot:
without blocks the widened codes would be a full-precision copy of the layer's cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.codecs import base, clip, logits, packing
from kvjax.codecs import stored_type_reads
from kvjax.codecs.packing import SCALE_BYTES, SCALE_DTYPE, pack, unpack  # noqa: F401 (the face)
from kvjax.errors import KvjaxError

# Plane-wise reads (`ScaledCodec._planes`) only for planes at least this wide: 64-wide
# planes (int4 at head_dim 128) read faster plane by plane than unpacked, narrower ones
# slower (dots too short for XLA:CPU); docs/methods.md, "CPU decode".
PLANE_MIN = 64


@dataclasses.dataclass(frozen=True)
class ScaledCodec(base.Codec):
  """Codes plus per-group scales (and zeros). `dtype` is the stored code type."""

  storage = "scaled"  # (base.Codec.storage, what `stored` says)

  kind: str = "int"      # int: symmetric | uint: asymmetric, packed | fp8
  bits: int = 8
  group: int = 0         # token axis: elements per group along head_dim (0: whole head)
                         # channel axis: tokens per scale group (U)
  axis: str = "token"    # token | channel
  clip: str = "none"     # none | mse (cache.clip: kvjax.codecs.clip)

  @property
  def asym(self) -> bool:
    return self.kind == "uint"

  @property
  def half(self) -> float:
    return (2 ** self.bits - 1) / 2

  @property
  def token_block(self) -> int:
    return self.group if self.axis == "channel" else 1

  def configure(self, cache_cfg, role: str) -> "ScaledCodec":
    axis = cache_cfg.k_axis if role == "k" else "token"
    return dataclasses.replace(self, group=cache_cfg.group_size, axis=axis, clip=cache_cfg.clip)

  def check(self, cache_cfg, model_cfg, role: str) -> None:
    """Group sizes that divide head_dim, packing that fits it, and what per-channel (KIVI)
    keys need: a group size and a residual window of whole groups."""
    c, D, g = cache_cfg, model_cfg.D, cache_cfg.group_size
    axis = c.k_axis if role == "k" else "token"
    if axis == "token" and g and D % g:
      raise KvjaxError(f"cache.group_size={g} does not divide head_dim={D} (cache.{role}_codec="
                       f"{self.name} groups along head_dim); use a divisor of {D}, or 0 for "
                       "whole heads")
    per = 8 // self.bits
    if D % per:
      raise KvjaxError(f"{self.name} packs {per} values per byte but head_dim={D} is not a "
                       f"multiple of {per}; choose another codec")
    if axis != "channel":
      return
    if not g:
      raise KvjaxError("cache.k_axis=channel needs cache.group_size (tokens per key-scale "
                       "group, e.g. 32)")
    if not c.residual:
      raise KvjaxError(f"cache.k_axis=channel needs a full-precision residual window: set "
                       f"cache.residual to a multiple of cache.group_size={g} (e.g. {2 * g})")
    if c.residual % g:
      raise KvjaxError(f"cache.residual={c.residual} must be a multiple of cache.group_size={g} "
                       f"with cache.k_axis=channel; e.g. cache.residual="
                       f"{max(g, c.residual // g * g)}")

  # -- storage -------------------------------------------------------------------------
  def init(self, shape):
    shapes = jax.eval_shape(self.encode, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def encode(self, x_TD: jax.Array) -> dict:
    x = x_TD.astype(jnp.float32)
    *lead, T, D = x.shape
    finite = jnp.isfinite(x)
    x = jnp.where(finite, x, 0.0)
    if self.axis == "channel":
      U = self.group
      if T % U:
        raise KvjaxError(f"channel-axis codec encodes whole groups of {U} tokens, got {T}")
      grouped, red = (*lead, T // U, U, D), -2
    else:
      g = self.group or D
      grouped, red = (*lead, T, D // g, g), -1
    xg = x.reshape(grouped)
    ok = jnp.all(finite.reshape(grouped), axis=red, keepdims=True)
    codes, scale, zero = clip.search(self, xg, red)  # _quantize at cache.clip's range
    nan = jnp.array(jnp.nan, packing.SCALE_DTYPE)
    meta = lambda a: base.store_bits(jnp.squeeze(jnp.where(ok, a, nan), red))  # noqa: E731
    out = {"codes": codes.reshape(*lead, T, D), "scale": meta(scale)}
    if self.kind == "uint":
      out["codes"] = packing.pack(out["codes"], self.bits)
      out["zero"] = meta(zero)
    return out

  def _levels(self, codes):
    """The value of each unscaled symmetric code (int8: the integer; fp8: its float)."""
    return base.load_bits(codes, self.dtype).astype(jnp.float32)

  def _quantize(self, xg, red, r: float = 1.0):
    """(codes, scale, zero) of the groups `xg`, covering the fraction `r` of each range."""
    if self.asym:
      mx, mn = jnp.max(xg, red, keepdims=True), jnp.min(xg, red, keepdims=True)
      zero = jnp.clip(mx / 2 + mn / 2, -packing.BF16_MAX, packing.BF16_MAX).astype(packing.SCALE_DTYPE)
      zf = zero.astype(jnp.float32)
      reach = jnp.maximum(mx - zf, zf - mn) * r
      scale = packing.round_up_bf16(jnp.maximum(reach / self.half, packing.TINY))
      c = jnp.round(packing.div(xg - zf, scale.astype(jnp.float32)) + self.half)
      return jnp.clip(c, 0, 2 * self.half).astype(jnp.uint8), scale, zero
    qmax = 127.0 if self.kind == "int" else float(jnp.finfo(self.dtype).max)
    amax = jnp.max(jnp.abs(xg), red, keepdims=True) * r
    scale = packing.round_up_bf16(jnp.maximum(amax / qmax, packing.TINY))
    y = jnp.clip(packing.div(xg, scale.astype(jnp.float32)), -qmax, qmax)
    codes = jnp.round(y).astype(jnp.int8) if self.kind == "int" else \
        base.store_bits(y.astype(self.dtype))
    return codes, scale, None

  def codes(self, enc: dict, dtype=jnp.float32) -> jax.Array:
    """The integer / fp8 code of every element, widened to `dtype`: [..., T, D]."""
    raw = enc["codes"]
    if self.asym:
      return packing.unpack(raw, self.bits).astype(dtype)
    return base.load_bits(raw, self.dtype).astype(dtype)

  def decode(self, enc: dict, dtype=jnp.float32) -> jax.Array:
    """Dequantize everything (reference and tests only; the attention reads through
    `qk`/`pv`)."""
    c = self.codes(enc)
    T, D = c.shape[-2:]
    rep, ax = (T // enc["scale"].shape[-2], -2) if self.axis == "channel" else \
        (D // enc["scale"].shape[-1], -1)
    widen = lambda a: jnp.repeat(packing.load_meta(a), rep, axis=ax)  # noqa: E731
    if self.asym:
      x = widen(enc["zero"]) + (c - self.half) * widen(enc["scale"])
    else:
      x = c * widen(enc["scale"])
    # The rounded-up scale can push the extreme code a hair past float32's max for inputs
    # within 2^-7 of it; clipping only moves x̂ towards x, so the bound holds (NaN stays).
    fmax = float(jnp.finfo(jnp.float32).max)
    return jnp.clip(x, -fmax, fmax).astype(dtype)

  def bytes_per_token(self, n_kv_heads: int, head_dim: int) -> float:
    meta = packing.SCALE_BYTES * (2 if self.asym else 1)
    if self.axis == "channel":
      meta_per_token = meta * head_dim / self.group
    else:
      meta_per_token = meta * head_dim // (self.group or head_dim)
    return n_kv_heads * (head_dim * self.bits / 8 + meta_per_token)

  # -- the attention's reads (one block of stored tokens at a time) -------------------
  def _parts(self, enc, dtype):
    """Codes widened to `dtype`, scale and the asymmetric offset z - h*s (float32)."""
    scale = packing.load_meta(enc["scale"])
    off = packing.load_meta(enc["zero"]) - self.half * scale if self.asym else None
    return self.codes(enc, dtype), scale, off

  def _planes(self, enc, dtype) -> list:
    """The codes as bit planes widened to `dtype`, each [..., C, D / p] (p codes per byte;
    plane i holds elements [i D/p, (i+1) D/p), see `pack`), straight from the packed bytes:
    reads that consume planes separately never build the unpacked (concatenated) codes.
    Planes narrower than PLANE_MIN elements come back unpacked as one array instead."""
    if not self._plane_wise(enc):
      return [self.codes(enc, dtype)]
    w = enc["codes"].astype(jnp.int32)
    return [((w >> (i * self.bits)) & (2 ** self.bits - 1)).astype(dtype)
            for i in range(8 // self.bits)]

  def _plane_wise(self, enc) -> bool:
    """Packed codes whose bit planes (`codes` bytes per vector) are at least PLANE_MIN wide."""
    return self.asym and enc["codes"].shape[-1] >= PLANE_MIN

  @property
  def stored(self) -> base.Stored:  # (base.Codec.stored)
    """Scaled storage: the read kernel's kind (3 int8, 4 int4, 5 int2, 6 / 7 fp8) for every
    scale layout; a subclass whose codes mean something else (`storage` None) has none."""
    if self.storage != "scaled":
      return base.Stored(self.storage)
    if self.kind == "fp8":
      kernel = 6 if jnp.dtype(self.dtype) == jnp.dtype(jnp.float8_e4m3fn) else 7
    else:
      kernel = {8: 3, 4: 4, 2: 5}[self.bits]
    scales = "channel" if self.axis == "channel" else "grouped" if self.group else "whole"
    return base.Stored("scaled", kernel, scales)

  def qk(self, q_BKGTD, enc, in_stored_type: bool = False):
    """Logits over a block of C stored tokens, scales folded in: [B, K, G, T, C]; `in_stored_type`:
    in the codes' stored type (`codecs.stored_type_reads`), for the codes this class stores."""
    if in_stored_type and self.storage == "scaled":
      return stored_type_reads.qk(self, q_BKGTD, enc)
    c_BKCD, s, off = self._parts(enc, q_BKGTD.dtype)
    G, D = q_BKGTD.shape[2], q_BKGTD.shape[4]
    f32 = jnp.float32
    if self.axis == "channel":  # s, off [B, K, J, D]: scale the query once per token group
      return logits.channel_logits(q_BKGTD, c_BKCD, s, off)
    n = s.shape[-1]  # per-token scales [B, K, C, n]: fold into the logits per group
    if n == 1 and (self.asym or base.per_head(G, D)):
      # Whole-head scales: the plain einsum, one per bit plane of packed codes (q's matching
      # columns), or G matvecs. int8/fp8 keys otherwise take the grouped form below, which
      # measured faster for them (results/cpu/NOTES.md); unpacked int4/int2 keys were faster
      # in this one.
      planes = self._planes(enc, q_BKGTD.dtype)
      pw = D // len(planes)  # plane width
      l = sum(base.dot_qk(q_BKGTD[..., i * pw:(i + 1) * pw], c) for i, c in enumerate(planes))
      l = l * s[:, :, None, None, :, 0]
      if off is not None:
        l = l + jnp.sum(q_BKGTD.astype(f32), -1)[..., None] * off[:, :, None, None, :, 0]
      return l
    return logits.group_logits(q_BKGTD, c_BKCD, s, off)

  def pv(self, p_BKGTC, enc, in_stored_type: bool = False):
    """Probability-weighted values of a block of C tokens, scales folded into p: [B,K,G,T,D];
    `in_stored_type` as in `qk`."""
    if in_stored_type and self.storage == "scaled":
      return stored_type_reads.pv(self, p_BKGTC, enc)
    c_BKCD, s, off = self._parts(enc, jnp.float32)
    B, K, G, T, C = p_BKGTC.shape
    D = c_BKCD.shape[-1]
    p = p_BKGTC.astype(jnp.float32)
    if self.axis == "channel":  # s, off [B, K, J, D]
      J = s.shape[-2]
      pj = p.reshape(B, K, G, T, J, C // J)
      t = jnp.einsum("bkgtju,bkjud->bkgtjd", pj, c_BKCD.reshape(B, K, J, C // J, D))
      out = jnp.einsum("bkgtjd,bkjd->bkgtd", t, s)
      if off is not None:
        out = out + jnp.einsum("bkgtj,bkjd->bkgtd", jnp.sum(pj, -1), off)
      return out
    n = s.shape[-1]
    if n == 1 and (self._plane_wise(enc) or not self.asym):
      # Whole-head scales: fold into p and use the plain einsum (per bit plane when packed).
      # The grouped form below made XLA:CPU write each widened int8 V block transposed (a
      # second strided copy per block, as costly as the widening itself); for unpacked
      # int4/int2 codes it measured faster than the plain form, so those stay below.
      ps = p * s[:, :, None, None, :, 0]
      out = jnp.concatenate([base.dot_pv(ps, c) for c in self._planes(enc, jnp.float32)],
                            axis=-1)
      if off is not None:
        out = out + jnp.einsum("bkgtc,bkc->bkgt", p, off[..., 0])[..., None]
      return out
    ps = p[..., None] * s[:, :, None, None]  # [B, K, G, T, C, n]
    out = jnp.einsum("bkgtcn,bkcnd->bkgtnd", ps, c_BKCD.reshape(B, K, C, n, D // n))
    if off is not None:
      out = out + jnp.einsum("bkgtc,bkcn->bkgtn", p, off)[..., None]
    return out.reshape(B, K, G, T, D)


base.register(ScaledCodec("int8", jnp.int8, kind="int", bits=8))
base.register(ScaledCodec("int4", jnp.uint8, kind="uint", bits=4))
base.register(ScaledCodec("int2", jnp.uint8, kind="uint", bits=2))
base.register(ScaledCodec("fp8_e4m3", jnp.float8_e4m3fn, kind="fp8", bits=8))
base.register(ScaledCodec("fp8_e5m2", jnp.float8_e5m2, kind="fp8", bits=8))


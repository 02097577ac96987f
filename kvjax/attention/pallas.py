"""`model.attention: pallas`: the `grouped` attention with each stored segment read by a
Pallas kernel straight from the codec storage.

The kernel reads what the cache holds and nothing else, as each codec says
(`Codec.stored`): "float", fp32 or bf16/fp16 bit patterns; "scaled", int8 codes +
per-token scales, packed int4/int2 codes + scale/zero, fp8 bits + scale. Each
step loads one block of stored tokens, one column chunk at a time (a chunk = one packed bit
plane x one scale group, so no unpack/concatenate is ever needed), and its codes reach each
dot through the unpack and a convert to the query's dtype only: the scales multiply the
logits after the key dot and the probabilities before the value dot, the asymmetric
offsets add (row sums) x offset, as in `attention.folded`. No full-precision copy of the
cache exists. Contiguous storage (also the
stacked-by-layer store, `Segment.layer`) is read `BLOCK` tokens per step; paged storage one
page per step, the page found through the block table inside the kernel.

Grid: (batch, kv head, query-row tile, split of the token axis). Each split runs an online
softmax over its blocks up to its row's last valid slot (at most the live length: a loop
with a data-dependent trip count, so nothing retraces as the cache fills and a short row
of a ragged batch stops early) and writes a partial (m, l, acc); the splits, the
other segments and the new tokens are merged in XLA by `xla.grouped` ("flash
decoding"). Query rows are the G query heads x T new tokens of one kv head, so a kv head's
bytes are read once for all its query heads, padded to a power of two and to at least
ROW_MIN = 16 rows (the MMA tile: decode's few rows still multiply through `dot`); a `dot`
with any dimension below 16 multiply-reduces instead. BLOCK, SPLITS, ROW_MIN, ROW_BLOCK,
NUM_WARPS and NUM_STAGES are the knobs `configs/accel/pallas_sweep.yaml` sweeps.

Falls back to the XLA read (`xla.attend_segment`) for per-channel key scales
(`cache.k_axis=channel`, whose scales span token blocks). A codec whose storage is its own
(`storage` None: nf4/nf2's level tables, or any codec that changes the storage without
saying what it is) is refused on the host in one line. Off GPU the kernel runs in Pallas interpret mode (slow, for tests
and smoke runs). Shape limits (also one-line `KvjaxError`s): head_dim and the page size
must be powers of two (Triton tensors are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax.attention import base, xla
from kvjax.codecs import base as codec_base, for_role, packing
from kvjax.errors import KvjaxError

BLOCK = 64        # contiguous storage: stored tokens per kernel step (a power of two)
SPLITS = 8        # token-axis splits per (batch, kv head): parallelism for small batches
ROW_BLOCK = 64    # query rows per program (prefill tiles its G*T rows)
ROW_MIN = 16      # rows are padded to at least this many (16: decode uses `dot`)
DOT_MIN = 16      # every dim of a `dot` must reach this, else multiply-reduce
NUM_WARPS = 4     # Triton only
NUM_STAGES = 2    # Triton only: software-pipelining stages
INTERPRET = None  # None: interpret mode unless the default backend is a GPU


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def check_shapes(head_dim: int, page_size: int = 0) -> None:
  """What the kernel cannot take, refused on the host with the fix."""
  if not _pow2(head_dim):
    raise KvjaxError(f"model.attention=pallas needs a power-of-two head_dim, got {head_dim}; "
                     "use model.attention=grouped")
  if page_size and not _pow2(page_size):
    raise KvjaxError(f"model.attention=pallas needs a power-of-two cache.page_size, got "
                     f"{page_size}; set cache.page_size=16 (or use model.attention=grouped)")


def check_config(c, m) -> None:
  """The registry's config check (`attention.check`): the same limits, and a read for the
  storage of both codecs, before tracing."""
  check_shapes(m.D, c.page_size if c.layout == "paged" else 0)
  if m.windowed:
    raise KvjaxError(f"model.attention=pallas has no sliding-window read (model.sliding_window="
                     f"{m.sliding_window}); use model.attention=grouped or native")
  for role in ("k", "v"):
    codec = for_role(getattr(c, f"{role}_codec"), c, role)
    if codec.stored.kind not in ("float", "scaled"):
      raise KvjaxError(f"model.attention=pallas has no read for {codec.name}'s storage "
                       f"(cache.{role}_codec); use model.attention=grouped or native")


def _kernel_reads(codec) -> bool:
  kind = codec.stored.kind
  return kind == "float" or (kind == "scaled" and codec.axis != "channel")


def _scaled(codec) -> bool:
  return codec.stored.kind == "scaled"


def _chunks(codec, D: int):
  """Static plan of a codec's column chunks: (first element, width, packed-byte offset,
  bit shift, scale column). Chunks never straddle a bit plane or a scale group."""
  if not _scaled(codec):
    return [(0, D, 0, 0, 0)]
  per = 8 // codec.bits if codec.asym else 1
  pw, g = D // per, codec.group or D
  cs = min(pw, g)
  return [(e, cs, e % pw, e // pw * codec.bits, e // g) for e in range(0, D, cs)]


def _codes(codec, load, chunk, dt):
  """One column chunk of the loaded block's codes as `dt` [C, width]: the unpack (shift
  and mask of a packed plane) and a convert, nothing else. `load(leaf, col, width)` reads
  that leaf's columns for the block's tokens."""
  _, cs, off, shift, _ = chunk
  if not _scaled(codec):
    return codec_base.load_bits(load("x", 0, cs), codec.dtype).astype(dt)
  raw = load("codes", off, cs)
  if codec.asym:
    return ((raw >> shift) & (2 ** codec.bits - 1)).astype(dt)
  return codec_base.load_bits(raw, codec.dtype).astype(dt)


def _scales(codec, load, chunk):
  """The chunk's per-token scale and asymmetric offset z - h s, float32 [C] (None, None
  for a float codec; offset None when symmetric): applied around the dots, never to codes."""
  if not _scaled(codec):
    return None, None
  j = chunk[4]
  s = packing.load_meta(load("scale", j, 1))[:, 0]
  if not codec.asym:
    return s, None
  return s, packing.load_meta(load("zero", j, 1))[:, 0] - codec.half * s


def _mm(a, b, contract_b: int, dt):
  """a [rows, inner] with b [cols, inner] (contract_b=1, -> [rows, cols]) or b [inner, cols]
  (contract_b=0), in float32: `dot` on `dt` operands (the query's dtype: bf16 models use the
  tensor cores) when every dim is big enough for Triton, else a float32 multiply-reduce."""
  if min(*a.shape, *b.shape) >= DOT_MIN:  # float32 operands at full precision (no TF32)
    prec = jax.lax.Precision.HIGHEST if jnp.dtype(dt) == jnp.float32 else None
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), (((1,), (contract_b,)), ((), ())),
                               precision=prec, preferred_element_type=jnp.float32)
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if contract_b == 1:
    return jnp.sum(a[:, None, :] * b[None, :, :], axis=2)
  return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)


def _kernel(meta_ref, q_ref, mask_ref, bt_ref, *refs, names, kc, vc, S, C, per_split, paged):
  """One (batch, kv head, row tile, split): online softmax over this split's blocks."""
  nk = len(names[0])
  k_refs = dict(zip(names[0], refs[:nk]))
  v_refs = dict(zip(names[1], refs[nk:nk + len(names[1])]))
  m_ref, l_ref, acc_ref = refs[nk + len(names[1]):]
  layer, end = meta_ref[0], meta_ref[1]
  tile, D = q_ref.shape
  f32, dt = jnp.float32, q_ref.dtype
  k_chunks, v_chunks = _chunks(kc, D), _chunks(vc, D)

  def block(i, state):
    m, l, accs = state
    if paged:  # one page per step; an unallocated entry (= P) is clamped, its slots masked
      P = next(iter(k_refs.values())).shape[1]
      page = jnp.minimum(bt_ref[i], P - 1)
      valid = mask_ref[pl.ds(i * C, C)] != 0
      tok = (page, slice(None))
    else:  # the last block is pulled back to end at S; tokens already read are masked
      start = jnp.minimum(i * C, S - C)
      idx = start + jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
      valid = (mask_ref[pl.ds(start, C)] != 0) & (idx >= i * C)
      tok = (pl.ds(start, C),)
    load_from = lambda refs: lambda n, col, w: refs[n][(layer, *tok, pl.ds(col, w))]  # noqa
    kl, vl = load_from(k_refs), load_from(v_refs)
    logits = jnp.zeros((tile, C), f32)
    for ch in k_chunks:  # per-token scales multiply the logits after the dot
      q = q_ref[:, pl.ds(ch[0], ch[1])]
      part = _mm(q, _codes(kc, kl, ch, dt), 1, dt)
      s, off = _scales(kc, kl, ch)
      if s is not None:
        part = part * s[None, :]
      if off is not None:
        part = part + jnp.sum(q.astype(f32), axis=1)[:, None] * off[None, :]
      logits += part
    logits = jnp.where(valid[None, :], logits, base.MASKED)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    p = jnp.where(valid[None, :], jnp.exp(logits - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    new = []
    for a, ch in zip(accs, v_chunks):  # per-token scales fold into the probabilities
      s, off = _scales(vc, vl, ch)
      part = _mm(p if s is None else p * s[None, :], _codes(vc, vl, ch, dt), 0, dt)
      if off is not None:
        part = part + jnp.sum(p * off[None, :], axis=1)[:, None]
      new.append(a * corr[:, None] + part)
    return m_new, l * corr + jnp.sum(p, axis=1), tuple(new)

  s = pl.program_id(3)
  lo = s * per_split
  hi = jnp.minimum(lo + per_split, (end + C - 1) // C)
  init = (jnp.full((tile,), base.MASKED, f32), jnp.zeros((tile,), f32),
          tuple(jnp.zeros((tile, ch[1]), f32) for ch in v_chunks))
  m, l, accs = jax.lax.fori_loop(lo, hi, block, init)
  m_ref[...] = m
  l_ref[...] = l
  for a, ch in zip(accs, v_chunks):
    acc_ref[:, pl.ds(ch[0], ch[1])] = a


def _leaves(enc, stacked: bool):
  """Storage leaves by name, each with a leading layer axis ([L, B|P, K, S|ps, X])."""
  enc = enc if isinstance(enc, dict) else {"x": enc}
  return {n: (a if stacked else a[None]) for n, a in sorted(enc.items())}


def segment_state(q_BKGTD, seg):
  """The kernel's partial state over one segment: m, l [B, K, Z, G, T], acc [.., D]
  (Z = splits of the token axis, not yet merged)."""
  B, K, G, T, D = q_BKGTD.shape
  S = seg.mask_BS.shape[1]
  # Segment kinds (kvjax.cache.base): a PagedSegment has a block table, a LayerSegment
  # (and so a PagedSegment) the stacked store and a layer index, a plain Segment neither.
  pages, layer = getattr(seg, "pages", None), getattr(seg, "layer", None)
  paged = pages is not None
  check_shapes(D, seg.page_size if paged else 0)
  C = seg.page_size if paged else min(BLOCK, 1 << (S.bit_length() - 1))  # <= S, a power of 2
  n_blocks = -(-S // C)
  per_split = -(-n_blocks // SPLITS)
  Z = -(-n_blocks // per_split)
  n_rows = G * T
  n_pad = max(1 << (n_rows - 1).bit_length(), ROW_MIN)  # rows padded to a power of two
  tile = min(n_pad, ROW_BLOCK)
  q = jnp.pad(q_BKGTD.reshape(B, K, n_rows, D), ((0, 0), (0, 0), (0, n_pad - n_rows), (0, 0)))
  live = S if seg.live is None else seg.live
  stacked = layer is not None
  layer = 0 if layer is None else layer
  # Per row: the layer and where its reads end (past its last valid slot, at most `live`).
  end_B = jnp.minimum(jnp.max(jnp.where(seg.mask_BS, jnp.arange(1, S + 1), 0), axis=1), live)
  meta = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B,)),
                    end_B.astype(jnp.int32)], axis=1)
  ks, vs = _leaves(seg.k, stacked), _leaves(seg.v, stacked)
  bt = pages.astype(jnp.int32) if paged else jnp.zeros((B, 1), jnp.int32)

  def store_spec(a):  # the whole stored sequence of (b, h); the kernel slices the blocks
    if paged:
      return pl.BlockSpec((a.shape[0], a.shape[1], None, *a.shape[3:]),
                          lambda b, h, r, s: (0, 0, h, 0, 0))
    return pl.BlockSpec((a.shape[0], None, None, *a.shape[3:]), lambda b, h, r, s: (0, b, h, 0, 0))

  kernel = functools.partial(_kernel, names=(list(ks), list(vs)), kc=seg.k_codec, vc=seg.v_codec,
                             S=S, C=C, per_split=per_split, paged=paged)
  row = lambda b, h, r, s: (b, h, s, r)  # noqa: E731
  interpret = jax.default_backend() != "gpu" if INTERPRET is None else INTERPRET
  extra = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # GPU-only: imported when used
    extra["compiler_params"] = plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
  f32 = jnp.float32
  m, l, acc = pl.pallas_call(
      kernel, grid=(B, K, n_pad // tile, Z),
      in_specs=[pl.BlockSpec((None, 2), lambda b, h, r, s: (b, 0)),
                pl.BlockSpec((None, None, tile, D), lambda b, h, r, s: (b, h, r, 0)),
                pl.BlockSpec((None, S), lambda b, h, r, s: (b, 0)),
                pl.BlockSpec((None, bt.shape[1]), lambda b, h, r, s: (b, 0))]
      + [store_spec(a) for a in (*ks.values(), *vs.values())],
      out_specs=[pl.BlockSpec((None, None, None, tile), row),
                 pl.BlockSpec((None, None, None, tile), row),
                 pl.BlockSpec((None, None, None, tile, D), lambda b, h, r, s: (b, h, s, r, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, K, Z, n_pad), f32),
                 jax.ShapeDtypeStruct((B, K, Z, n_pad), f32),
                 jax.ShapeDtypeStruct((B, K, Z, n_pad, D), f32)],
      interpret=interpret, name="kvjax_segment_attention", **extra,
  )(meta, q, seg.mask_BS.astype(jnp.int8), bt, *ks.values(), *vs.values())
  rows = lambda a: a[:, :, :, :n_rows].reshape(B, K, Z, G, T, *a.shape[4:])  # noqa: E731
  return rows(m), rows(l), rows(acc)


def merge(state, m_BKZGT, l_BKZGT, acc_BKZGTD):
  """Fold the splits' partial states into the running (m, l, acc) (the online-softmax
  rescaling of `base.update`, with a partial state in place of a block of logits)."""
  m0, l0, acc0 = state
  m = jnp.maximum(m0, jnp.max(m_BKZGT, axis=2))
  c0, c = jnp.exp(m0 - m), jnp.exp(m_BKZGT - m[:, :, None])
  return (m, l0 * c0 + jnp.sum(l_BKZGT * c, axis=2),
          acc0 * c0[..., None] + jnp.sum(acc_BKZGTD * c[..., None], axis=2))


def attend_segment(q_BKGTD, seg, state, program: str = "cpu", bucket: int = 0):
  """`xla.attend_segment` with the kernel's read, or the XLA read of `program` where it
  has none."""
  if seg.mask_BS.shape[1] == 0:
    return state
  if not (_kernel_reads(seg.k_codec) and _kernel_reads(seg.v_codec)) or \
      seg.head_BKS is not None:  # (one slot mask per sequence; per-head budgets read in XLA)
    return xla.attend_segment(q_BKGTD, seg, state, program=program, bucket=bucket)
  return merge(state, *segment_state(q_BKGTD, seg))


def pallas(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, *, program: str = "cpu",
           bucket: int = 0) -> jax.Array:
  """`xla.grouped` with every stored segment read by the Pallas kernel (its own loop stops
  at each row's live length, so it takes no bucket)."""
  read = functools.partial(attend_segment, program=program, bucket=bucket)
  return xla.grouped(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, read=read)


base.register("pallas", pallas, check=check_config)

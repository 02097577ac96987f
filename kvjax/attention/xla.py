"""Attention variants. MHA, GQA and MQA are one grouped computation.

Queries are grouped as [B, K, G, T, D] (G = H // K query heads share one KV head), so
MHA is G = 1 and MQA is K = 1, and the cache only ever holds K heads. A layer attends to
the stored segments its cache layout hands it (read through each segment's codec, which
folds quantization scales into the logits and probabilities) plus the T new tokens of
this call, causally. All segments share one softmax.

Reads are blockwise with an online softmax (running max, running sum, rescaled
accumulator): on the CPU a stored segment is read `codecs.READ_CHUNK` tokens at a time in
a `lax.while_loop` whose trip count is the segment's *live* length (`Segment.live`, data,
not shape), so a decode step reads the tokens the cache holds, not its allocated
capacity, and prefill into an empty cache reads nothing. Nothing retraces as lengths
grow. Only one block of codes is ever widened at a time (XLA:CPU materializes the
converted operand of a dot), so no full-precision copy of the cache exists. That is the
CPU program (`model.program`, `attention.base.program`); in the accelerator program a
segment is one block (`block_size`, bounded by the decode call's bucket): no loop and no
host round trip, each block read through `folded` (only a convert before each dot).

"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax import codecs
from kvjax.attention import base, folded
from kvjax.errors import KvjaxError

def block_size(seg, S: int, chunk: int | None = None, program: str = "cpu",
               bucket: int = 0) -> int:
  """Tokens per block. The CPU program: `chunk` (default READ_CHUNK) rounded to whole units
  of the segment (codec token blocks, pages), at most S. The accelerator program: one
  block of the whole segment (no loop), or, with a `bucket` and a segment whose valid
  slots lie below its live length, of its first `bucket` slots (rounded up to whole units):
  the host picks the bucket per decode call so that every step's live length stays within
  it (`decode.bucket_for`), and the call reads what the cache holds, not its capacity.

  The loop is for XLA:CPU, whose dot materializes a widened operand. On a GPU the
  convert fuses into the dot, and a `while` whose trip count is data costs a device-to-host
  copy of its predicate and a stream sync per iteration (and the switched layer scan a
  branch pick per projection, see `step.prepare_params`), which dominated the step on the
  H200 (docs/gpu.md). One block reads every slot it covers, masked; a prompt's pass skips an
  empty segment (`attend_segment`)."""
  U = seg.unit
  if program == "accelerator":
    if bucket and seg.live is not None:
      return min(S, -(-bucket // U) * U)
    return S
  return min(S, max(U, (chunk or codecs.READ_CHUNK) // U * U))


def window_mask(seg, floor_BT):
  """A segment's slots [B, T, S'] each query may see under a window: valid, at or above the
  query's floor (`model.layers.window_floor`). The layout must say where each slot is."""
  if seg.pos_BS is None:
    raise KvjaxError("this cache layout does not record token positions, so a layer with "
                     "model.sliding_window cannot read it; use cache.layout=contiguous or paged")
  return seg.mask_BS[:, None, :] & (seg.pos_BS[:, None, :] >= floor_BT[:, :, None])


def attend_segment(q_BKGTD, seg, state, in_stored_type: bool = False, chunk: int | None = None,
                   program: str = "cpu", bucket: int = 0, floor_BT=None):
  """Online softmax over the stored tokens [0, live) of one segment, block by block,
  `chunk` tokens at a time; `native` reads each block through the codecs' stored-type
  dots (`Codec.qk` / `pv` with `in_stored_type=True`). The
  accelerator program reads one block (`block_size`) through `folded`, where only a convert
  precedes each dot. `floor_BT` [B, T]: each query sees only slots holding a position at
  or above its floor (a sliding window; None: no window)."""
  S = seg.mask_BS.shape[1]
  if S == 0:
    return state
  C = block_size(seg, S, chunk, program, bucket)
  accel = program == "accelerator"
  if in_stored_type:
    qk = functools.partial(seg.k_codec.qk, in_stored_type=True)
    pv = functools.partial(seg.v_codec.pv, in_stored_type=True)
  elif accel:
    qk = functools.partial(folded.qk, seg.k_codec)
    pv = lambda p, v: folded.pv(seg.v_codec, p, v, q_BKGTD.dtype)  # noqa: E731
  else:
    qk, pv = seg.k_codec.qk, seg.v_codec.pv
  live = S if seg.live is None else seg.live

  def block(i, st):
    # The last block may overrun S: its start is pulled back to S - C (still a whole
    # number of codec blocks) and the tokens already read are masked out.
    start = jnp.minimum(i * C, S - C)
    k, v = seg.cut(seg.k, start, C), seg.cut(seg.v, start, C)
    idx_C = start + jnp.arange(C)
    mask_BC = jax.lax.dynamic_slice_in_dim(seg.mask_BS, start, C, axis=1) & \
        (idx_C >= i * C)[None, :]
    mask = mask_BC[:, None, None, None, :]
    if seg.head_BKS is not None:  # [B, K, 1, 1, C]: per-head budgets (kvjax.policies.heads)
      mask = mask & jax.lax.dynamic_slice_in_dim(seg.head_BKS, start, C, axis=2)[:, :, None,
                                                                                   None]
    if floor_BT is not None:  # [B, 1, 1, T, C]: each query's own window
      pos_BC = jax.lax.dynamic_slice_in_dim(seg.pos_BS, start, C, axis=1)
      mask = mask & (pos_BC[:, None, None, None, :] >= floor_BT[:, None, None, :, None])
    return base.update(st, qk(q_BKGTD, k), mask, lambda p: pv(p, v))

  if accel:  # one block: no loop
    if q_BKGTD.shape[3] > 1 and seg.live is not None:
      # A prompt's pass (T > 1) skips a segment with nothing live (prefill into an empty
      # cache) at the cost of one host round trip per layer; a decode step never branches.
      return jax.lax.cond(jnp.asarray(seg.live) > 0, lambda st: block(0, st), lambda st: st,
                          state)
    return block(0, state)
  if C == S:
    return block(0, state)
  n = (jnp.asarray(live, jnp.int32) + C - 1) // C
  return jax.lax.fori_loop(0, n, block, state)


# Queries of a prompt attended together to the prompt's own tokens. Keys beyond a block's
# last query are skipped, and a windowed layer's block reads only its band of keys, which
# assumes that within one call the valid positions of a row are start + token index
# (prefill, engine chunks, recompute and training all place token t at position start + t,
# padding at -1). The [B, K, G, T, T] logits of a whole prompt, and the several passes over
# them (mask, max, exp, sum), were the bulk of prefill (docs/methods.md, "CPU decode", *A
# prompt attends to itself in query blocks*).
NEW_BLOCK = 128  # queries a block of a prompt's pass (fewer under a window: `prompt_blocks`)
KEY_BLOCK = 512  # keys a block of a prompt's own keys (a window's band under a window)


def prompt_blocks(T: int, band: int = 0) -> tuple[int, int]:
  """(queries, keys) a block of a prompt's pass over its own T keys. Without a window,
  NEW_BLOCK queries against KEY_BLOCK keys at a time. Under a window of `band` tokens
  (`model.sliding_window`, the static bound of every layer's window) a block of queries
  sees at most band + queries - 1 keys, so a key block of band + queries reads a windowed
  layer's band in one block; queries are band / 8 (at most NEW_BLOCK, at least 8), so a
  windowed layer reads (band + queries) / band = 1.125 times the keys its window needs."""
  if band <= 0:
    return NEW_BLOCK, KEY_BLOCK
  Cq = max(8, min(NEW_BLOCK, band // 8))
  return Cq, band + Cq


def key_spans(lo_T, T: int, Cq: int, Ck: int, xp=jnp):
  """For each block of Cq queries, the first key it may see and how many key blocks of Ck
  it reads: `lo_T` [Tq] is each query's lowest visible key index (0 without a window; Tq for
  padding), and block i reads keys [lo_i, min(T, (i + 1)·Cq)) in ceil(span / Ck) blocks.
  `xp=numpy` counts on the host what the traced loop reads (`keys_read`)."""
  Tq = lo_T.shape[0]
  lo_N = xp.minimum(xp.min(lo_T.reshape(Tq // Cq, Cq), axis=1), T)
  hi_N = xp.minimum(xp.arange(1, Tq // Cq + 1) * Cq, T)
  n_N = xp.maximum(hi_N - lo_N + Ck - 1, 0) // Ck
  return lo_N, n_N


def keys_read(T: int, window: int = 0, band: int = 0) -> int:
  """Keys the prompt's pass of T tokens reads from its own keys, summed over its queries,
  in one layer whose window is `window` (0: full attention) in a model whose static bound
  is `band`: the count of the traced loop (`key_spans`), for tests and reports."""
  import numpy as np  # noqa: PLC0415
  Cq, Ck = prompt_blocks(T, band)
  if T <= Cq:
    return T * T
  Tq = -(-T // Cq) * Cq
  t_T = np.arange(Tq)
  lo_T = np.where(t_T < T, np.maximum(t_T - window + 1, 0) if window else 0, Tq)
  _, n_N = key_spans(lo_T, T, Cq, Ck, np)
  return int(np.sum(n_N) * Ck * Cq)


def _new_tokens(q_BKGTD, k_BKID, v_BKID, pos_q_BT, pos_k_BI, floor_BT=None, fresh_I=None):
  """Logits, mask and value read of a block of queries against a block of this call's own
  keys (causal, and within each query's window if floored; `fresh_I`: the keys of the block
  not read before)."""
  f32 = jnp.float32
  l_new = jnp.einsum("bkgtd,bkid->bkgti", q_BKGTD, k_BKID, preferred_element_type=f32)
  causal_BTI = (pos_k_BI[:, None, :] <= pos_q_BT[:, :, None]) & (pos_k_BI[:, None, :] >= 0)
  if floor_BT is not None:
    causal_BTI = causal_BTI & (pos_k_BI[:, None, :] >= floor_BT[:, :, None])
  if fresh_I is not None:
    causal_BTI = causal_BTI & fresh_I[None, None, :]
  pv_new = lambda p: jnp.einsum("bkgti,bkid->bkgtd", p.astype(v_BKID.dtype), v_BKID,  # noqa
                                preferred_element_type=f32)
  return l_new, causal_BTI[:, None, None], pv_new


def _initial(B, K, G, T, D):
  f32 = jnp.float32
  return (jnp.full((B, K, G, T), base.MASKED, f32), jnp.zeros((B, K, G, T), f32),
          jnp.zeros((B, K, G, T, D), f32))


def _finish(state):
  """Padding queries see no key at all (s = 0): they read 0, never NaN."""
  _, s, acc = state
  return acc / jnp.where(s > 0, s, 1.0)[..., None]


def _read_stored(q_BKGTD, segments, state, read, program, bucket, floor_BT):
  window = {} if floor_BT is None else {"floor_BT": floor_BT}
  if read is None:
    read = functools.partial(attend_segment, program=program, bucket=bucket)
  for seg in segments:  # (a segment may read itself in another form: `Segment.attend`)
    state = seg.attend(q_BKGTD, state, lambda q, s, st: read(q, s, st, **window))
  return state


def _by_query_block(q_BKGTD, k_BKTD, v_BKTD, positions_BT, segments, read, program, bucket,
                    floor_BT, band):
  """A prompt's pass, one block of queries at a time in a `lax.scan` (`prompt_blocks`): the
  program and its compile time do not grow with T, and no [T, S] logits exist. Each block
  reads the stored segments (each skips an empty one on its own), then its own keys from
  the first one any of its queries sees (its window's band) to its last query, KEY_BLOCK at
  a time in a loop whose trip count is data (`key_spans`)."""
  B, K, G, T, D = q_BKGTD.shape
  Cq, Ck = prompt_blocks(T, band)
  Tq, Tk = -(-T // Cq) * Cq, max(T, Ck)
  pad = lambda a, n, axis, value=0: jnp.pad(  # noqa: E731
      a, [(0, n - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)],
      constant_values=value)
  q_pad, pos_q = pad(q_BKGTD, Tq, 3), pad(positions_BT, Tq, 1, -1)
  floor_pad = None if floor_BT is None else pad(floor_BT, Tq, 1)
  k_pad, v_pad, pos_k = pad(k_BKTD, Tk, 2), pad(v_BKTD, Tk, 2), pad(positions_BT, Tk, 1, -1)
  t_T = jnp.arange(Tq, dtype=jnp.int32)
  if floor_BT is None:
    lo_T = jnp.where(t_T < T, 0, Tq)
  else:  # index of each query's floor: floor - (position - index), over the valid rows
    lo_BT = jnp.where(pos_q >= 0, floor_pad - pos_q + t_T[None, :], Tq)
    lo_T = jnp.maximum(jnp.min(lo_BT, axis=0), 0)
  lo_N, n_N = key_spans(lo_T, T, Cq, Ck)

  def block(_, x):
    i, lo, n = x
    t0 = i * Cq
    cut = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, t0, Cq, axis)  # noqa: E731
    q, pq = cut(q_pad, 3), cut(pos_q, 1)
    fq = None if floor_pad is None else cut(floor_pad, 1)
    state = _read_stored(q, segments, _initial(B, K, G, Cq, D), read, program, bucket, fq)

    def keys(j, st):
      # The last block may overrun Tk: its start is pulled back, and the keys read before
      # are masked out (`fresh`).
      want = lo + j * Ck
      s0 = jnp.minimum(want, Tk - Ck)
      kc = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, s0, Ck, axis)  # noqa: E731
      fresh_I = s0 + jnp.arange(Ck) >= want
      return base.update(st, *_new_tokens(q, kc(k_pad, 2), kc(v_pad, 2), pq, kc(pos_k, 1), fq,
                                          fresh_I))
    return None, _finish(jax.lax.fori_loop(0, n, keys, state))

  N = Tq // Cq
  _, out_NBKGCD = jax.lax.scan(block, None, (jnp.arange(N, dtype=jnp.int32), lo_N, n_N))
  out = jnp.moveaxis(out_NBKGCD, 0, 3).reshape(B, K, G, Tq, D)
  return out[:, :, :, :T]


def grouped(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, read=None, *,
            program: str = "cpu", bucket: int = 0, floor_BT=None, band: int = 0) -> jax.Array:
  """Grouped-query attention over stored segments + the new tokens. Returns [B, T, H, D].
  `read(q_BKGTD, seg, state) -> state` reads one stored segment (default: the XLA read of
  the resolved `program`, `attend_segment`; `kvjax.attention.pallas` plugs in its
  kernel). `floor_BT` [B, T] (a sliding window): the lowest position each
  query sees, passed on to `read` as `floor_BT=` (None: every earlier token); `band`: the
  static bound of the windows (`model.sliding_window`), which sizes a prompt's blocks."""
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  G = H // K
  q_BKGTD = (q_BTHD * (D ** -0.5)).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
  k_BKTD = k_BTKD.transpose(0, 2, 1, 3)
  v_BKTD = v_BTKD.transpose(0, 2, 1, 3)
  if T > prompt_blocks(T, band)[0]:  # a prompt: blocks of queries in one scan
    out_BKGTD = _by_query_block(q_BKGTD, k_BKTD, v_BKTD, positions_BT, segments, read,
                                program, bucket, floor_BT, band if floor_BT is not None else 0)
  else:  # a decode step or a short prompt: one block of queries, all of its own keys
    state = _read_stored(q_BKGTD, segments, _initial(B, K, G, T, D), read, program, bucket,
                         floor_BT)
    out_BKGTD = _finish(base.update(state, *_new_tokens(q_BKGTD, k_BKTD, v_BKTD, positions_BT,
                                                        positions_BT, floor_BT)))
  return out_BKGTD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


def reference(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, floor_BT=None,
              band: int = 0) -> jax.Array:
  """The plain path (tests): every stored slot dequantized, one softmax over everything
  (every key read, masked: `band`, which sizes the blocked variants' blocks, is not used)."""
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  q_BKGTD = (q_BTHD * (D ** -0.5)).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
  whole = lambda seg, enc: seg.cut(enc, 0, seg.mask_BS.shape[1])  # noqa: E731
  segments = [seg.dense() for seg in segments]  # (a latent's rows up-projected)
  ks = [seg.k_codec.decode(whole(seg, seg.k), jnp.float32) for seg in segments] + \
      [k_BTKD.transpose(0, 2, 1, 3).astype(jnp.float32)]
  vs = [seg.v_codec.decode(whole(seg, seg.v), jnp.float32) for seg in segments] + \
      [v_BTKD.transpose(0, 2, 1, 3).astype(jnp.float32)]
  causal_BTI = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & \
      (positions_BT[:, None, :] >= 0)
  if floor_BT is not None:
    causal_BTI = causal_BTI & (positions_BT[:, None, :] >= floor_BT[:, :, None])
  K = k_BTKD.shape[2]

  def seg_mask(seg):  # [B, K, T, S']
    m = jnp.broadcast_to(seg.mask_BS[:, None, :], (B, T, seg.mask_BS.shape[1])) \
        if floor_BT is None else window_mask(seg, floor_BT)
    m = m[:, None]
    return m if seg.head_BKS is None else m & seg.head_BKS[:, :, None, :]
  masks = [jnp.broadcast_to(seg_mask(seg), (B, K, T, seg.mask_BS.shape[1])) for seg in segments]
  masks += [jnp.broadcast_to(causal_BTI[:, None], (B, K, T, T))]
  k, v, mask = (jnp.concatenate(ks, axis=2), jnp.concatenate(vs, axis=2),
                jnp.concatenate(masks, axis=3))
  logits = jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD.astype(jnp.float32), k)
  probs = jax.nn.softmax(jnp.where(mask[:, :, None], logits, base.MASKED), axis=-1)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


base.register("grouped", grouped)
base.register("reference", reference)

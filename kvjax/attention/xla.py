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


def attend_segment(q_BKGTD, seg, state, native: bool = False, chunk: int | None = None,
                   program: str = "cpu", bucket: int = 0, floor_BT=None):
  """Online softmax over the stored tokens [0, live) of one segment, block by block,
  `chunk` tokens at a time; `native` reads each block through the codecs' stored-type
  dots (`Codec.qk` / `pv` with `native=True`). The
  accelerator program reads one block (`block_size`) through `folded`, where only a convert
  precedes each dot. `floor_BT` [B, T]: each query sees only slots holding a position at
  or above its floor (a sliding window; None: no window)."""
  S = seg.mask_BS.shape[1]
  if S == 0:
    return state
  C = block_size(seg, S, chunk, program, bucket)
  accel = program == "accelerator"
  if native:
    qk = functools.partial(seg.k_codec.qk, native=True)
    pv = functools.partial(seg.v_codec.pv, native=True)
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
# last query are skipped, which assumes that within one call the valid positions of a row
# increase with the token index (prefill, engine chunks, recompute and training all place
# token t at position start + t, padding at -1). The [B, K, G, T, T] logits of a whole
# prompt, and the several passes over them (mask, max, exp, sum), were the bulk of prefill
# (docs/methods.md, "CPU decode", *A prompt attends to itself in query blocks*).
NEW_BLOCK = 128


def _new_tokens(q_BKGTD, k_BKID, v_BKID, pos_q_BT, pos_k_BI, floor_BT=None):
  """Logits, mask and value read of a block of queries against this call's own keys, the
  I tokens up to the block's end (causal, and within each query's window if floored)."""
  f32 = jnp.float32
  l_new = jnp.einsum("bkgtd,bkid->bkgti", q_BKGTD, k_BKID, preferred_element_type=f32)
  causal_BTI = (pos_k_BI[:, None, :] <= pos_q_BT[:, :, None]) & (pos_k_BI[:, None, :] >= 0)
  if floor_BT is not None:
    causal_BTI = causal_BTI & (pos_k_BI[:, None, :] >= floor_BT[:, :, None])
  pv_new = lambda p: jnp.einsum("bkgti,bkid->bkgtd", p.astype(v_BKID.dtype), v_BKID,  # noqa
                                preferred_element_type=f32)
  return l_new, causal_BTI[:, None, None], pv_new


def _by_query_block(q_BKGTD, seg, state, bucket: int, floor_BT=None):
  """The accelerator program's read of one stored segment for a prompt: NEW_BLOCK queries
  at a time, so no [T, S] logits exist. Each block skips an empty segment on its own (one
  `cond` each): under one `cond` for all blocks, XLA:CPU kept every block's logits alive
  at once (the compiled prefill's temporaries, tests/test_accel.py)."""
  T = q_BKGTD.shape[3]
  parts = [attend_segment(q_BKGTD[:, :, :, t0:t0 + NEW_BLOCK], seg,
                          jax.tree.map(lambda a: a[:, :, :, t0:t0 + NEW_BLOCK], state),  # noqa: B023
                          program="accelerator", bucket=bucket,
                          floor_BT=None if floor_BT is None else floor_BT[:, t0:t0 + NEW_BLOCK])
           for t0 in range(0, T, NEW_BLOCK)]
  return jax.tree.map(lambda *a: jnp.concatenate(a, axis=3), *parts)


def grouped(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, read=None, *,
            program: str = "cpu", bucket: int = 0, floor_BT=None) -> jax.Array:
  """Grouped-query attention over stored segments + the new tokens. Returns [B, T, H, D].
  `read(q_BKGTD, seg, state) -> state` reads one stored segment (default: the XLA read of
  the resolved `program`, `attend_segment`; `kvjax.attention.pallas` plugs in its
  kernel). `floor_BT` [B, T] (a sliding window): the lowest position each
  query sees, passed on to `read` as `floor_BT=` (None: every earlier token)."""
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  G = H // K
  q_BKGTD = (q_BTHD * (D ** -0.5)).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
  k_BKTD = k_BTKD.transpose(0, 2, 1, 3)
  v_BKTD = v_BTKD.transpose(0, 2, 1, 3)

  f32 = jnp.float32
  state = (jnp.full((B, K, G, T), base.MASKED, f32), jnp.zeros((B, K, G, T), f32),
           jnp.zeros((B, K, G, T, D), f32))
  # The accelerator program reads each stored segment in one block, so a prompt's logits
  # against it would be [T, S] at once: it reads them NEW_BLOCK queries at a time instead.
  per_block = read is None and program == "accelerator" and T > NEW_BLOCK
  window = {} if floor_BT is None else {"floor_BT": floor_BT}
  for seg in segments:
    if per_block:
      state = _by_query_block(q_BKGTD, seg, state, bucket, floor_BT)
    else:
      state = read(q_BKGTD, seg, state, **window) if read else \
          attend_segment(q_BKGTD, seg, state, program=program, bucket=bucket, **window)
  # The new tokens: causal by position; padding (position -1) is never a key. A prompt is
  # read NEW_BLOCK queries at a time, each block against the keys up to its own end only.
  outs = []
  for t0 in range(0, T, NEW_BLOCK):
    t1 = min(T, t0 + NEW_BLOCK)
    st = jax.tree.map(lambda a: a[:, :, :, t0:t1], state)  # noqa: B023
    _, s, acc = base.update(st, *_new_tokens(
        q_BKGTD[:, :, :, t0:t1], k_BKTD[:, :, :t1], v_BKTD[:, :, :t1], positions_BT[:, t0:t1],
        positions_BT[:, :t1], None if floor_BT is None else floor_BT[:, t0:t1]))
    # Padding queries see no key at all (s = 0): they read 0, never NaN.
    outs.append(acc / jnp.where(s > 0, s, 1.0)[..., None])
  out_BKGTD = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
  return out_BKGTD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


def reference(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, floor_BT=None) -> jax.Array:
  """The plain path (tests): every stored slot dequantized, one softmax over everything."""
  B, T, H, D = q_BTHD.shape
  K = k_BTKD.shape[2]
  q_BKGTD = (q_BTHD * (D ** -0.5)).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
  whole = lambda seg, enc: seg.cut(enc, 0, seg.mask_BS.shape[1])  # noqa: E731
  ks = [seg.k_codec.decode(whole(seg, seg.k), jnp.float32) for seg in segments] + \
      [k_BTKD.transpose(0, 2, 1, 3).astype(jnp.float32)]
  vs = [seg.v_codec.decode(whole(seg, seg.v), jnp.float32) for seg in segments] + \
      [v_BTKD.transpose(0, 2, 1, 3).astype(jnp.float32)]
  causal_BTI = (positions_BT[:, None, :] <= positions_BT[:, :, None]) & \
      (positions_BT[:, None, :] >= 0)
  if floor_BT is not None:
    causal_BTI = causal_BTI & (positions_BT[:, None, :] >= floor_BT[:, :, None])
  masks = [jnp.broadcast_to(seg.mask_BS[:, None, :], (B, T, seg.mask_BS.shape[1]))
           if floor_BT is None else window_mask(seg, floor_BT) for seg in segments] + [causal_BTI]
  k, v, mask = (jnp.concatenate(ks, axis=2), jnp.concatenate(vs, axis=2),
                jnp.concatenate(masks, axis=2))
  logits = jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD.astype(jnp.float32), k)
  probs = jax.nn.softmax(jnp.where(mask[:, None, None], logits, base.MASKED), axis=-1)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


base.register("grouped", grouped)
base.register("reference", reference)

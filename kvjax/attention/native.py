"""The `native` attention, the default on the CPU: the grouped computation of
`xla.grouped` with every stored segment read where its bytes are, not in a widened copy.

A segment whose codecs and storage the CPU read kernel knows (`kvjax.kernels`: fp32, bf16,
fp16, int8, int4, int2 and fp8 with whole-head or head_dim-group scales per token, or
per-channel keys; contiguous, per-layer and paged storage) is read by it: each code
converted where it is used, the rows spread over XLA's threads. Any other segment (the
normal-float codecs), and every segment where the kernel is not built, is read block by block in its
codes' own type through XLA's library dots (`Codec.qk` / `pv` with `in_stored_type=True`,
`kvjax.codecs.dots`): bf16 blocks through bf16 dots, int8 / int4 / int2 codes through int8
dots, fp8 through bf16, each scale applied outside the dot. `CHUNK` tokens a block: no
block is widened there, so a block only bounds the logits of one online-softmax step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from kvjax import kernels
from kvjax.attention import base, xla

CHUNK = 1024  # stored tokens per block of the XLA route


def merge(state, part):
  """Fold one segment's online-softmax partial state into the running one."""
  (m1, s1, a1), (m2, s2, a2) = state, part
  m = jnp.maximum(m1, m2)
  c1, c2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
  return m, s1 * c1 + s2 * c2, a1 * c1[..., None] + a2 * c2[..., None]


def read_segment(q_BKGTD, seg, state, program: str = "cpu", bucket: int = 0,
                 floor_BT=None):
  """One stored segment into the state: through the kernel where it reads the segment,
  else through the stored-type dots (blocks of `program`, `xla.block_size`). Under a
  window (`floor_BT`), one query a row (a decode step) folds its window into the slot mask,
  which the kernel reads; several queries a row each keep their own window in the XLA read."""
  if seg.mask_BS.shape[1] == 0:
    return state
  if floor_BT is not None and q_BKGTD.shape[3] == 1:
    seg, floor_BT = dataclasses.replace(seg, mask_BS=xla.window_mask(seg, floor_BT)[:, 0]), None
  part = None if floor_BT is not None else kernels.read(q_BKGTD, seg)
  if part is None:
    return xla.attend_segment(q_BKGTD, seg, state, in_stored_type=True, chunk=CHUNK, program=program,
                              bucket=bucket, floor_BT=floor_BT)
  return merge(state, part)


def native(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, *, program: str = "cpu",
           bucket: int = 0, floor_BT=None, band: int = 0):
  """`xla.grouped` with the stored segments read by `read_segment`."""
  read = functools.partial(read_segment, program=program, bucket=bucket)
  return xla.grouped(q_BTHD, k_BTKD, v_BTKD, positions_BT, segments, read=read,
                     floor_BT=floor_BT, band=band)


base.register("native", native)

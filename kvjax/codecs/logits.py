"""Logits of scaled integer codes with their scales folded in, the two forms every read
that multiplies codes directly shares (`quant.ScaledCodec`, the accelerator's folded read):
per-channel scales over groups of tokens, and per-token scales over groups along head_dim."""

from __future__ import annotations

import jax.numpy as jnp


def channel_logits(q_BKGTD, c_BKCD, s_BKJD, off_BKJD):
  """Logits of codes with per-channel scales (and zero points) over J groups of U tokens:
  the query scaled once per group, the zero points a per-row constant."""
  B, K, G, T, D = q_BKGTD.shape
  C, J, f32 = c_BKCD.shape[-2], s_BKJD.shape[-2], jnp.float32
  qs_BKGTJD = (q_BKGTD[:, :, :, :, None].astype(f32) * s_BKJD[:, :, None, None]).astype(q_BKGTD.dtype)
  l = jnp.einsum("bkgtjd,bkjud->bkgtju", qs_BKGTJD, c_BKCD.reshape(B, K, J, C // J, D),
                 preferred_element_type=f32)
  if off_BKJD is not None:
    l = l + jnp.einsum("bkgtd,bkjd->bkgtj", q_BKGTD.astype(f32), off_BKJD)[..., None]
  return l.reshape(B, K, G, T, C)


def group_logits(q_BKGTD, c_BKCD, s_BKCX, off_BKCX):
  """Logits of codes with per-token scales (and zero points) for X groups along head_dim
  (the scale leaves' storage width): one product per group, the scales applied to its
  partial logits."""
  B, K, G, T, D = q_BKGTD.shape
  C, n, f32 = c_BKCD.shape[-2], s_BKCX.shape[-1], jnp.float32
  qn = q_BKGTD.reshape(B, K, G, T, n, D // n)
  l = jnp.einsum("bkgtnd,bkcnd->bkgtcn", qn, c_BKCD.reshape(B, K, C, n, D // n),
                 preferred_element_type=f32)
  l = jnp.einsum("bkgtcn,bkcn->bkgtc", l, s_BKCX)
  if off_BKCX is not None:
    l = l + jnp.einsum("bkgtn,bkcn->bkgtc", jnp.sum(qn.astype(f32), -1), off_BKCX)
  return l

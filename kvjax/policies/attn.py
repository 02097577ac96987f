"""Attention mass of chosen prompt queries on every prompt key: the scores that `snapkv`,
`h2o` and `tova` rank tokens by; and, for `h2o` and `tova`, which keep evicting during
decode (`DecodeScored`, score-and-replace), the attention of each new query over the
tokens held.

Where a decode step's weights come from: the score-and-replace rule
(`replace.ScoreAndReplace.step`) recomputes them in the cache's write (`step_attention`,
on the held keys the layout lends it, `Slots.keys`: the pages' contiguous view on the
paged layout) from the layer's rotated query, which the model hands to a layout whose
policy asks for it (`decode_queries`, `Layout.wants_queries`). That reads the held keys a
second time in each step (the attention read them once), but keeps the attention as it is:
its online softmax never forms normalized weights (blockwise, running max and sum; the
Pallas kernel likewise), so returning them would widen every attention variant's contract
and cost every cache, evicting or not.
"""

import jax
import jax.numpy as jnp

from kvjax import codecs
from kvjax.policies.replace import ScoreAndReplace


MASS_BLOCK = 256  # chosen queries a block of `attention_mass` (h2o chooses every prompt query)


def attention_mass(q_LBTHD, k_LBKSD, lengths_B, qpos_BW):
  """[L, B, K, S]: for each key, the softmax attention it gets from the W queries at
  positions `qpos_BW` ([B, W] int32; -1: no query), summed over those queries and averaged
  over the G query heads that share its KV head. Causal: the query at t sees keys j <= t,
  and only j < length. The chosen queries are gathered and scored MASS_BLOCK at a time (a
  `lax.scan` per layer, summing as it goes), so the work is W x S per layer and no more than
  MASS_BLOCK x S logits exist at once: a 32k-token prompt scored by every query (h2o)
  never forms its [T, T] attention."""
  L, B, T, H, D = q_LBTHD.shape
  K, S = k_LBKSD.shape[2], k_LBKSD.shape[3]
  W, G = qpos_BW.shape[1], H // K
  Wb = min(W, MASS_BLOCK)
  N = -(-W // Wb)
  qpos_NBW = jnp.pad(qpos_BW, [(0, 0), (0, N * Wb - W)], constant_values=-1) \
      .reshape(B, N, Wb).transpose(1, 0, 2)
  j_S = jnp.arange(S)

  def layer(args):
    q_BTHD, k_BKSD = args
    k_BKSD = k_BKSD.astype(jnp.float32)

    def block(acc_BKGS, qpos_BW):
      idx = jnp.clip(qpos_BW, 0, T - 1)[:, :, None, None]
      q_BWHD = jnp.take_along_axis(q_BTHD, idx, axis=1).astype(jnp.float32)
      q_BKGWD = q_BWHD.reshape(B, Wb, K, G, D).transpose(0, 2, 3, 1, 4)
      logits = jnp.einsum("bkgwd,bksd->bkgws", q_BKGWD * D ** -0.5, k_BKSD)
      see_BWS = (j_S[None, None, :] <= qpos_BW[:, :, None]) & \
          (j_S[None, None, :] < lengths_B[:, None, None]) & (qpos_BW >= 0)[:, :, None]
      mask = see_BWS[:, None, None]
      p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
      p = jnp.where(mask, p, 0.0)  # rows with no visible key (no query) give 0, not NaN
      return acc_BKGS + p.sum(axis=3), None

    acc_BKGS, _ = jax.lax.scan(block, jnp.zeros((B, K, G, S), jnp.float32), qpos_NBW)
    return acc_BKGS.mean(axis=2)  # [B, K, S]

  return jax.lax.map(layer, (q_LBTHD, k_LBKSD))


def step_attention(q_HD, k_store, kc, mask_S, k_new_KD):
  """The softmax attention of one new query per row over its held keys and its own key,
  as the attention computes it (the held keys read through the codec `READ_CHUNK` slots at
  a time, the new key as it came), averaged over the G query heads of each KV head:
  (held [L·B, K, S] float32, zero where `mask_S` is False; own [L·B, K]). Each argument's
  one leading axis is the rows, layers x sequences flattened (named by its trailing axes
  only); `k_store`: the K codec storage, leaves [L·B, K, S, ...]."""
  rows, H, D = q_HD.shape
  K, S = k_new_KD.shape[1], mask_S.shape[1]
  q_KGTD = (q_HD * D ** -0.5).reshape(rows, K, H // K, 1, D)
  C = min(S, codecs.READ_CHUNK)
  blocks = [kc.qk(q_KGTD, jax.tree.map(lambda a: a[:, :, s:s + C], k_store))  # noqa: B023
            for s in range(0, S, C)]
  l_held = jnp.concatenate(blocks, axis=-1)[:, :, :, 0]  # [L·B, K, G, S]
  l_own = jnp.einsum("nkgd,nkd->nkg", q_KGTD[:, :, :, 0], k_new_KD.astype(q_KGTD.dtype),
                     preferred_element_type=jnp.float32)
  l_held = jnp.where(mask_S[:, None, None], l_held, -jnp.inf)
  m = jnp.maximum(jnp.max(l_held, axis=-1), l_own)  # finite: the own key is always seen
  e_held, e_own = jnp.exp(l_held - m[..., None]), jnp.exp(l_own - m)
  z = jnp.sum(e_held, axis=-1) + e_own
  return (e_held / z[..., None]).mean(axis=2), (e_own / z).mean(axis=2)


class DecodeScored(ScoreAndReplace):
  """Score-and-replace by attention (mixed into `h2o`, `tova`): each new query's softmax
  over the held tokens and its own key (`step_attention`) scores them."""

  decode_queries = True

  def step_scores(self, spec, keys, mask_BS, k_LBKD, q_LBHD):
    L, B, K, _ = k_LBKD.shape
    S = mask_BS.shape[1]
    rows = lambda a: a.reshape(L * B, *a.shape[2:])  # noqa: E731  [L, B, ...] -> [L*B, ...]
    own_held, own_new = step_attention(rows(q_LBHD), jax.tree.map(rows, keys), spec.kc,
                                       jnp.tile(mask_BS, (L, 1)), rows(k_LBKD))
    return own_held.reshape(L, B, K, S), own_new.reshape(L, B, K)

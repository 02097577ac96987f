"""Rotary position embeddings in the rotate-half convention of Hugging Face Llama, with
Llama-3 `rope_scaling` (read by the model, and by the latent layout at read time)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> jax.Array:
  """Inverse frequencies [D/2], with Llama-3 `rope_scaling` when the config has it; `local`:
  the local layers' base (`model.rope_local_theta`, unscaled) where one is set."""
  D = cfg.D
  if local and cfg.rope_local_theta:
    return 1.0 / (cfg.rope_local_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
  scaling = dict(cfg.rope_scaling)
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "llama3":
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    inv = jnp.where(medium, smoothed, scaled)
  return inv


def rope_cos_sin(positions_BT: jax.Array, cfg: ModelConfig,
                 local: bool = False) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables [B, T, D] in the rotate-half convention of HF Llama (float32)."""
  freqs = jnp.maximum(positions_BT, 0)[..., None].astype(jnp.float32) * \
      rope_inv_freq(cfg, local)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array) -> jax.Array:
  """x [B, T, heads, D] (H query heads, K KV heads, or any number) rotated at the positions
  of the tables ([B, T, D], or [B, T, heads, D]: each head its own, `partial`)."""
  dtype = x.dtype
  x = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  if cos_BTD.ndim == 3:
    cos_BTD, sin_BTD = cos_BTD[:, :, None, :], sin_BTD[:, :, None, :]
  out = x * cos_BTD + rotated * sin_BTD
  return out.astype(dtype)


def partial(cos_BTD, sin_BTD, keep):
  """Per-head tables [B, T, heads, D] that rotate only the frequency pairs `keep` [heads, P]
  marks (1: rotated; 0: left as it is, cos 1 and sin 0): partial RoPE
  (`model.rope_pairs`)."""
  keep_D = jnp.concatenate([keep, keep], axis=-1).astype(bool)[None, None]
  return (jnp.where(keep_D, cos_BTD[:, :, None, :], 1.0),
          jnp.where(keep_D, sin_BTD[:, :, None, :], 0.0))


def pair_columns(keep_pairs, r: int):
  """(rope [K, 2r], rest [K, D - 2r]) head_dim columns of each head: those of its r kept
  frequency pairs (`keep_pairs` [K, D/2], 1 where kept: pair i is columns i and i + D/2), in
  order, and the others. Traced or not: r is static."""
  P = keep_pairs.shape[-1]
  order = jnp.argsort(-keep_pairs.astype(jnp.float32), axis=-1, stable=True)  # kept pairs first
  kept, rest = order[:, :r], order[:, r:]
  return (jnp.concatenate([kept, kept + P], axis=-1),
          jnp.concatenate([rest, rest + P], axis=-1))


def default_keep(L: int, K: int, P: int, r: int):
  """[L, K, P] the partial-RoPE mask of a fresh model: the r highest-frequency pairs."""
  return jnp.broadcast_to((jnp.arange(P) < r).astype(jnp.float32), (L, K, P))

"""Refusing non-finite weights at load: one NaN in a norm makes every logit NaN, and the
model then "generates" token 0 and evaluates to ppl NaN. Every reader (GGUF, Hugging Face
safetensors, orbax checkpoints) checks each tensor on the host as it reads it and names it.

    finite.check(arr, "blk.3.attn_norm.weight", path)
    finite.check_cast(arr, np.float16, "blk.3.attn_norm.weight", path)  # model.param_dtype
    finite.check_tree(params, ckpt_dir)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import KvjaxError


def is_finite(arr) -> bool:
  """Whether every element is finite. For float32 and narrower, a float64 sum is NaN or
  infinite exactly when some element is (such values cannot overflow a float64 sum), and
  needs no boolean copy of the weights."""
  if isinstance(arr, jax.Array):  # on its device: no copy of the weights to the host
    return bool(jnp.isfinite(arr).all()) if jnp.issubdtype(arr.dtype, jnp.inexact) else True
  arr = np.asarray(arr)
  if arr.dtype.kind in "biu":
    return True  # integers and booleans are always finite
  with np.errstate(all="ignore"):  # no RuntimeWarning on stderr beside the error line
    if arr.dtype.itemsize >= 8:  # float64 (or complex) values can overflow a float64 sum
      return bool(np.isfinite(arr).all())
    return bool(np.isfinite(np.sum(arr, dtype=np.float64)))


def check(arr, name: str, where) -> None:
  """One line naming the tensor and the file when `arr` holds a NaN or an infinity."""
  if not is_finite(arr):
    with np.errstate(all="ignore"):
      bad = int(np.size(arr) - np.count_nonzero(np.isfinite(np.asarray(arr, np.float64))))
    raise KvjaxError(f"tensor '{name}' in {where} holds {bad} non-finite value(s) (NaN or "
                     "infinity); the file is corrupt: restore or re-download it")


def check_cast(arr, dtype, name: str, where) -> None:
  """One line when finite weights overflow the narrower `model.param_dtype` they are cast
  to (a float32 value past float16's 65504 becomes infinity)."""
  arr = np.asarray(arr)
  if np.dtype(dtype).itemsize >= arr.dtype.itemsize:
    return
  with np.errstate(all="ignore"):
    cast = arr.astype(dtype)
  if not is_finite(cast):
    raise KvjaxError(f"tensor '{name}' in {where} holds values beyond the range of "
                     f"model.param_dtype={np.dtype(dtype).name}; load it in float32 "
                     "(--set model.param_dtype=float32)")


def check_tree(tree, where, like=None) -> None:
  """`check` for every leaf of a parameter tree, named by its path ('layers.q_proj.kernel'),
  and `check_cast` to the dtypes of the matching leaves of `like` when given."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  dtypes = [x.dtype for x in jax.tree_util.tree_leaves(like)] if like is not None else None
  for i, (path, leaf) in enumerate(leaves):
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    check(leaf, name, where)
    if dtypes is not None:
      check_cast(leaf, dtypes[i], name, where)

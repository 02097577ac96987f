"""Reading a Hugging Face checkpoint's safetensors weights (one file or index-listed shards)
into the parameter tree of `kvjax.model.Transformer`: torch Linear [out, in] -> Dense
kernels [in, out], per-layer tensors stacked on the layer axis, every tensor used once.
A corrupt or truncated file, a malformed shard index and a non-finite tensor are one line
naming the file (and the tensor).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from kvjax.config import Config, jsonfile
from kvjax.errors import KvjaxError
from kvjax.io import finite

_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Tensors that carry no weights kvjax needs (older checkpoints saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _tensor_files(folder: Path) -> dict[str, Path]:
  """tensor name -> safetensors file, from the shard index or the single file(s)."""
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    data = jsonfile.read(index, "shard index", "restore the file or re-save the checkpoint")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v and "/" not in v for v in weight_map.values()):
      raise KvjaxError(f"malformed {index}: expected a 'weight_map' object of tensor name -> "
                       "shard file name; restore the file or re-save the checkpoint")
    for name in sorted(set(weight_map.values())):
      if not (folder / name).is_file():
        raise KvjaxError(f"shard {name} listed in {index.name} is missing from {folder}")
    return {k: folder / v for k, v in weight_map.items()}
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise KvjaxError(f"{folder} has no *.safetensors weights; save the model with "
                     "save_pretrained(..., safe_serialization=True)")
  from safetensors import safe_open
  out = {}
  for f in files:
    try:
      with safe_open(str(f), framework="np") as st:
        out.update({k: f for k in st.keys()})
    except Exception as e:  # safetensors raises its own error types for corrupt files
      raise KvjaxError(f"cannot read {f}: {_first_line(e)}") from None
  return out


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


class _Reader:
  """Lazy tensor access across files, keeping each file open once."""

  def __init__(self, files: dict[str, Path]):
    self.files, self._open, self.used = files, {}, set()

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    from safetensors import safe_open

    if name not in self.files:
      raise KvjaxError(f"tensor '{name}' is missing from the checkpoint; the folder is "
                       "incomplete or config.json does not match the weights")
    path = self.files[name]
    if path not in self._open:
      try:
        self._open[path] = safe_open(str(path), framework="np")
      except Exception as e:  # noqa: BLE001  (corrupt or truncated file)
        raise KvjaxError(f"cannot read {path}: {_first_line(e)}") from None
    handle = self._open[path]
    try:
      got = tuple(handle.get_slice(name).get_shape())
    except Exception as e:  # noqa: BLE001  a shard index naming a tensor its file lacks
      raise KvjaxError(f"cannot read tensor '{name}' from {path}: "
                       f"{_first_line(e)}") from None
    if got != shape:
      raise KvjaxError(f"tensor '{name}' has shape {list(got)} but config.json implies "
                       f"{list(shape)}; the weights do not match the config")
    self.used.add(name)
    try:
      arr = handle.get_tensor(name)
    except Exception as e:  # noqa: BLE001  data past the end of a truncated file
      raise KvjaxError(f"cannot read tensor '{name}' from {path}: "
                       f"{_first_line(e)}") from None
    if arr.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
      raise KvjaxError(f"tensor '{name}' has dtype {arr.dtype}; kvjax reads float32/float16/bfloat16")
    finite.check(arr, name, path)
    finite.check_cast(arr, dtype, name, path)
    return arr.astype(dtype)


def _prefix(files: dict[str, Path]) -> str:
  """'model.' for *ForCausalLM checkpoints, '' for bare *Model ones."""
  return "model." if any(k.startswith("model.") for k in files) else ""


def read_params(folder: str | Path, cfg: Config) -> dict:
  """Params in the layout of `kvjax.model.Transformer`, cast to `model.param_dtype`."""
  m = cfg.model
  reader = _Reader(_tensor_files(Path(folder)))
  pre = _prefix(reader.files)
  dtype = _DTYPES[m.param_dtype]
  E, H, K, D, F, V = m.d_model, m.n_heads, m.n_kv_heads, m.D, m.F, m.vocab_size
  # name -> (HF shape of one layer's tensor, transpose to [in, out])
  linear = {"self_attn.q_proj": (H * D, E), "self_attn.k_proj": (K * D, E),
            "self_attn.v_proj": (K * D, E), "self_attn.o_proj": (E, H * D),
            "mlp.gate_proj": (F, E), "mlp.up_proj": (F, E), "mlp.down_proj": (E, F)}

  def stacked(suffix, shape, transpose=False):
    arrs = [reader.get(f"{pre}layers.{i}.{suffix}", shape, dtype) for i in range(m.n_layers)]
    return np.stack([a.T if transpose else a for a in arrs])

  layers = {}
  for hf_name, shape in linear.items():
    short = hf_name.split(".")[1]
    layers[short] = {"kernel": stacked(f"{hf_name}.weight", shape, transpose=True)}
    if m.qkv_bias and short in ("q_proj", "k_proj", "v_proj"):
      layers[short]["bias"] = stacked(f"{hf_name}.bias", (shape[0],))
  for norm in ("input_layernorm", "post_attention_layernorm"):
    layers[norm] = {"weight": stacked(f"{norm}.weight", (E,))}
  params = {"embed_tokens": {"embedding": reader.get(f"{pre}embed_tokens.weight", (V, E), dtype)},
            "layers": layers, "norm": {"weight": reader.get(f"{pre}norm.weight", (E,), dtype)}}
  if not m.tie_embeddings:
    params["lm_head"] = {"kernel": reader.get("lm_head.weight", (V, E), dtype).T}
  leftover = [k for k in reader.files if k not in reader.used
              and not k.endswith(_IGNORED_SUFFIXES) and not (m.tie_embeddings and k == "lm_head.weight")]
  if leftover:
    raise KvjaxError(f"checkpoint tensor '{leftover[0]}' (and {len(leftover) - 1} more) has no "
                     "place in kvjax's model; an unsupported feature (bias, extra layer)?")
  return params

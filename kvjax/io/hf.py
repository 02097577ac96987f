"""Hugging Face checkpoint import: Llama, Qwen2 and Mistral folders into a kvjax Config + params.

    cfg = hf.load_config("path/to/folder")            # config.json only (kvjax size --hf)
    cfg, params = hf.load("path/to/folder", {...})    # plus *.safetensors (kvjax generate --hf)

No torch at run time: tensors are read with `safetensors.safe_open(framework="np")`
(bf16 arrives as an `ml_dtypes.bfloat16` array), one file or shards listed by
`model.safetensors.index.json`. Per-layer tensors are stacked on the leading layer axis
of the scanned model and torch Linear weights [out, in] become Dense kernels [in, out].

Everything kvjax does not implement fails loudly with one line, because a checkpoint that
loads but computes a different function is worse than one that does not load: rope types
other than default/llama3, bias on o_proj or the MLP, partial rotary, non-SiLU MLPs,
unexpected tensors. Sliding-window attention (Mistral, Qwen2 with use_sliding_window) is
honoured exactly by capping `model.max_seq_len` at the window: with at most `window`
tokens in a sequence the window never excludes anything (HF masks key j for query i only
when i - j >= window), and `generate.check_request` rejects longer requests on the host.

This module reads config.json and checks the result; the tensors are kvjax.io.hf_weights'
(`read_params`).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp

from kvjax import config as config_lib
from kvjax.config import Config, jsonfile
from kvjax.errors import KvjaxError
from kvjax.io.hf_weights import read_params

FAMILIES = ("llama", "mistral", "qwen2")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_hf_config(folder: str | Path) -> dict:
  """The folder's config.json as a dict, with one-line errors for a bad folder."""
  folder = Path(folder)
  if not folder.is_dir():
    raise KvjaxError(f"Hugging Face folder not found: {folder}; pass the checkpoint directory")
  path = folder / "config.json"
  if not path.exists():
    raise KvjaxError(f"{folder} has no config.json; pass a Hugging Face checkpoint folder")
  data = jsonfile.read(path, "Hugging Face config", "restore the file or re-save the checkpoint")
  if not isinstance(data, dict):
    raise KvjaxError(f"malformed {path}: expected a JSON object")
  check_types(data, path)
  return data


_NUM = (int, float)
# Every config.json field kvjax reads -> (accepted JSON types, as the message says it);
# null is "not set" for all of them. Numbers get their range checks where they are read.
_TYPES = {
    **{k: (str, "a string") for k in ("model_type", "hidden_act", "hidden_activation",
                                       "torch_dtype", "dtype")},
    **{k: (bool, "true or false") for k in ("attention_bias", "mlp_bias", "use_sliding_window",
                                             "tie_word_embeddings")},
    **{k: (dict, "an object") for k in ("rope_scaling", "rope_parameters")},
    **{k: (_NUM, "a number") for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
        "rms_norm_eps", "rope_theta", "partial_rotary_factor", "sliding_window",
        "max_window_layers", "pretraining_tp")},
    "layer_types": (list, "a list of strings"),
}
_ROPE_TYPES = {"rope_type": (str, "a string"), "type": (str, "a string"),
               **{k: (_NUM, "a number") for k in ("rope_theta", "partial_rotary_factor",
                                                   *_LLAMA3_KEYS)}}


def check_types(data: dict, path="config.json") -> None:
  """One line naming the first field of `data` kvjax reads whose JSON type is wrong (a
  `rope_scaling` list, a `layer_types` number, `tie_word_embeddings: "false"`)."""
  def bad(key, want, got):
    return KvjaxError(f"config.json field '{key}' must be {want}, got {got!r:.60}; fix {path} "
                      "(the folder's config does not describe a usable model)")

  def walk(obj: dict, types: dict, inside: str) -> None:
    for key, (kinds, want) in types.items():
      val = obj.get(key)
      if val is not None and (not isinstance(val, kinds) or (kinds is not bool
                                                             and isinstance(val, bool))):
        raise bad(key + inside, want, val)

  walk(data, _TYPES, "")
  for key in ("rope_scaling", "rope_parameters"):
    walk(data.get(key) or {}, _ROPE_TYPES, f"' of '{key}")
  types = data.get("layer_types")
  if types is not None and not all(isinstance(t, str) for t in types):
    raise bad("layer_types", "a list of strings", types)


def _number(key: str, value, integer: bool = True, minimum: float = 1):
  """A config.json numeric field, checked before any arithmetic: an int (or finite float)
  >= `minimum` (> 0 for floats with minimum 0), else one line naming the field."""
  kind = "an integer" if integer else "a finite number"
  bound = f">= {minimum}" if integer else "> 0"
  ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
  if ok and integer:
    ok = float(value).is_integer() and value >= minimum
  elif ok:
    ok = value > 0
  if not ok:
    raise KvjaxError(f"config.json field '{key}' must be {kind} {bound}, got {value!r}; "
                     "fix config.json (the folder's config does not describe a usable model)")
  return int(value) if integer else float(value)


def _rope(hf: dict) -> tuple[float, tuple]:
  """(rope_theta, kvjax rope_scaling pairs) from either the old (`rope_theta` +
  `rope_scaling`) or the transformers-5 (`rope_parameters`) form of config.json."""
  params = dict(hf.get("rope_scaling") or {})
  params.update(hf.get("rope_parameters") or {})
  theta = _number("rope_theta", params.pop("rope_theta", hf.get("rope_theta", 10000.0)), False)
  kind = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise KvjaxError("partial_rotary_factor != 1 is not supported by kvjax's RoPE")
  if kind == "default":
    return theta, ()
  if kind != "llama3":
    raise KvjaxError(f"rope scaling type '{kind}' is not supported (kvjax implements default "
                     "and llama3); use a checkpoint without it")
  params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
  missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
  if missing:
    raise KvjaxError(f"llama3 rope scaling in config.json lacks {', '.join(missing)}")
  pairs = [("rope_type", "llama3")] + [(k, _number(k, params[k], False)) for k in _LLAMA3_KEYS]
  return theta, tuple(sorted(pairs))


def sliding_window(hf: dict) -> int | None:
  """The attention window the HF model applies to some layer, or None when it has none."""
  window = hf.get("sliding_window")
  if not window:
    return None
  window = _number("sliding_window", window)
  if hf.get("model_type") == "qwen2":
    types = hf.get("layer_types")
    if types is not None:
      return window if "sliding_attention" in types else None
    if not hf.get("use_sliding_window", False):
      return None
    n = _number("num_hidden_layers", _need(hf, "num_hidden_layers"))
    first = _number("max_window_layers", hf.get("max_window_layers") or 0, minimum=0)
    return window if first < n else None
  return window


def _need(hf: dict, key: str):
  if hf.get(key) is None:
    raise KvjaxError(f"config.json lacks '{key}'; the checkpoint folder is incomplete")
  return hf[key]


def _need_int(hf: dict, key: str) -> int:
  return _number(key, _need(hf, key))


def config_overrides(hf: dict) -> dict:
  """Dotted kvjax config keys for an HF config dict (raises on anything unsupported)."""
  kind = hf.get("model_type")
  if kind not in FAMILIES:
    raise KvjaxError(f"unsupported model_type '{kind}'; kvjax imports {', '.join(FAMILIES)}")
  act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
  if act != "silu":
    raise KvjaxError(f"hidden_act '{act}' is not supported; kvjax's MLP is SwiGLU (silu)")
  if hf.get("attention_bias"):
    raise KvjaxError("attention_bias=true (bias on o_proj) is not supported; kvjax has q/k/v bias only")
  if hf.get("mlp_bias"):
    raise KvjaxError("mlp_bias=true is not supported; kvjax's MLP has no bias")
  if hf.get("pretraining_tp", 1) not in (1, None):
    raise KvjaxError(f"pretraining_tp={hf['pretraining_tp']} is not supported; set it to 1")
  E, H = _need_int(hf, "hidden_size"), _need_int(hf, "num_attention_heads")
  theta, scaling = _rope(hf)
  max_len = _need_int(hf, "max_position_embeddings")
  window = sliding_window(hf)
  if window is not None:
    max_len = min(max_len, window)
  return {
      "model.vocab_size": _need_int(hf, "vocab_size"),
      "model.d_model": E,
      "model.n_layers": _need_int(hf, "num_hidden_layers"),
      "model.n_heads": H,
      "model.n_kv_heads": _number("num_key_value_heads", hf.get("num_key_value_heads") or H),
      "model.head_dim": _number("head_dim", hf.get("head_dim") or max(E // H, 1)),
      "model.d_ff": _need_int(hf, "intermediate_size"),
      "model.rope_theta": theta,
      "model.rope_scaling": dict(scaling),
      "model.norm_eps": _number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), False),
      "model.qkv_bias": kind == "qwen2",
      "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
      "model.max_seq_len": max_len,
      "model.dtype": "float32",
      "model.param_dtype": "float32",
  }


def load_config(folder: str | Path, overrides: dict | None = None) -> Config:
  """A kvjax Config for the checkpoint folder (fp32 compute unless overridden)."""
  folder = Path(folder)
  hf = read_hf_config(folder)
  tok = folder / "tokenizer.json"
  base = {**config_overrides(hf), "tokenizer": str(tok) if tok.is_file() else "none",
          "name": f"hf-{hf['model_type']}-{folder.name}"}
  cfg = config_lib.apply_overrides(Config(), base)
  if overrides:
    cfg = config_lib.apply_overrides(cfg, overrides)
  window = sliding_window(hf)
  if window is not None and cfg.model.max_seq_len > window:
    raise KvjaxError(f"model.max_seq_len={cfg.model.max_seq_len} exceeds the checkpoint's "
                     f"sliding_window={window}, which kvjax does not implement; keep it <= {window}")
  return cfg


def load(folder: str | Path, overrides: dict | None = None) -> tuple[Config, dict]:
  """(Config, params as jax arrays) for a Hugging Face checkpoint folder."""
  cfg = load_config(folder, overrides)
  from kvjax import memory
  memory.check_params(cfg, f"the weights of {folder}")
  params = read_params(folder, cfg)
  check_tree(cfg, params)
  return cfg, to_device(params)


def to_device(tree: dict) -> dict:
  """A nested dict of numpy arrays as jax arrays, emptied leaf by leaf as it goes, so the
  host copy and the device copy of the weights never both exist whole (a load's peak is
  then about one copy and a leaf, not two copies)."""
  out = {}
  for name in list(tree):
    sub = tree.pop(name)
    out[name] = to_device(sub) if isinstance(sub, dict) else jnp.asarray(sub)
    del sub
  return out


def check_tree(cfg: Config, params: dict) -> None:
  """The imported tree must be exactly what the model initialises (names, shapes)."""
  from kvjax.model import Transformer

  tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  want = jax.eval_shape(Transformer(cfg.model).init, jax.random.PRNGKey(0), tokens, tokens)
  want = jax.tree_util.tree_map(lambda x: tuple(x.shape), want["params"])
  got = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
  if want != got:
    raise KvjaxError("imported parameter tree does not match kvjax's model for this config; "
                     "did --set change a model shape key?")


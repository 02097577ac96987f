"""GGUF import: llama, qwen2 and gemma3 GGUF files into a kvjax Config, params and tokenizer.

    cfg = gguf.load_config("model.gguf")            # metadata only (kvjax size --gguf)
    cfg, params = gguf.load("model.gguf", {...})    # plus dequantized tensors (generate --gguf)
    tok = gguf_tokenizer.tokenizer_json("model.gguf")  # the `tokenizers` BPE it describes

The file's header is parsed by `gguf_file` (fast: a 262k-token vocabulary in well under a
second; `size` and refusals read nothing else) and every tensor type ggml's `gguf` package
can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants,
...) becomes the model's `param_dtype`. GGUF stores tensors in ggml's order, which numpy
reads as torch's [out, in]; Dense kernels are the transpose. The converter that writes
llama GGUF files permutes the rows of the Q and K projections so that ggml's RoPE (which
rotates adjacent pairs) matches the checkpoint's rotate-half RoPE; kvjax rotates halves
like Hugging Face, so `unpermute` undoes that permutation per head. qwen2 and gemma3
files are not permuted (ggml rotates halves for them). Each architecture is an `Arch`:
the model settings it fixes (Gemma 3's q/k norms, sandwich norms, scaled embeddings, GELU
gate, every 6th layer global with local layers windowed and on their own RoPE base), and
the extra per-layer norms it stores.

What kvjax does not implement, and what is malformed, fails with one line naming the file
and what was found: another architecture, RoPE scaling, partial rotary, a tensor type the
reader cannot dequantize, a missing key or tensor, a metadata field of the wrong type (a
number stored as a string), a non-finite weight, a truncated file.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from kvjax import config as config_lib
from kvjax.config import Config
from kvjax.errors import KvjaxError
from kvjax.io import finite, gguf_file

@dataclasses.dataclass(frozen=True)
class Arch:
  """What one GGUF architecture is in kvjax's one model definition."""

  permuted: bool = False   # the converter permuted Q/K rows for ggml's adjacent-pair RoPE
  settings: tuple = ()     # (dotted key, value) fixed by the architecture
  norms: tuple = ()        # (GGUF tensor, kvjax norm) beyond attn_norm / ffn_norm
  rope_local_theta: float = 0.0  # the local layers' RoPE base (not in the metadata)
  global_every: int = 0    # every Nth layer is global (not in the metadata)


# Gemma 3: the converter stores each norm's weight as 1 + w, so kvjax's `weight * x` RMSNorm
# reads them as they are; every 6th layer is global and local layers rotate with base 10k.
ARCHES = {
    "llama": Arch(permuted=True),
    "qwen2": Arch(),
    "gemma3": Arch(settings=(("model.qk_norm", True), ("model.sandwich_norm", True),
                             ("model.embed_scale", True), ("model.mlp_act", "gelu_tanh")),
                   norms=(("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm"),
                          ("post_attention_norm", "post_attn_norm"),
                          ("post_ffw_norm", "post_ffw_norm")),
                   rope_local_theta=10000.0, global_every=6),
}
ARCHITECTURES = tuple(ARCHES)
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# GGUF tensor name (per layer) -> (kvjax leaf, kvjax sub-key); shapes come from the config.
_LAYER_TENSORS = {
    "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
    "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def reader(path: str):
  """The parsed file (`gguf_file.GGUFFile`: metadata, tensor table, a read-only map of its
  bytes), cached: metadata and tensors share it; a file rewritten in place (another size,
  mtime, ctime or inode) is read afresh."""
  try:
    st = os.stat(path)
  except OSError:
    st = None
  stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) if st else None
  return _open_version(str(path), stamp)


@functools.lru_cache(maxsize=4)
def _open_version(path: str, version):
  del version  # part of the cache key only
  return gguf_file.open_file(path)


reader.cache_clear = _open_version.cache_clear
_LISTS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
          "tokenizer.ggml.scores")


def metadata(path: str | Path) -> dict:
  """The file's metadata fields (the tokenizer's vocabulary-sized arrays left out)."""
  return {k: v for k, v in reader(str(path)).fields.items() if k not in _LISTS}


def _need(meta: dict, key: str, path) -> object:
  if key not in meta:
    raise KvjaxError(f"GGUF file {path} lacks metadata key '{key}'; the file is incomplete or "
                     "not a model of a supported architecture")
  return meta[key]


def _bad(path, key: str, want: str, got) -> KvjaxError:
  return KvjaxError(f"GGUF file {path}: metadata '{key}' must be {want}, got {got!r:.60}; the "
                    "file is corrupt or its converter wrote a field kvjax cannot read")


def _int(meta: dict, key: str, path, default=None, minimum: int = 1) -> int:
  """An integer metadata field (required when `default` is None), checked before use."""
  val = _need(meta, key, path) if default is None else meta.get(key, default)
  if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < minimum:
    raise _bad(path, key, f"an integer >= {minimum}", val)
  return int(val)


def _float(meta: dict, key: str, path, default: float) -> float:
  """A positive float32 metadata field, as `_f32` writes it."""
  val = meta.get(key, default)
  ok = not isinstance(val, bool) and isinstance(val, (int, float, np.integer, np.floating))
  if ok:
    with np.errstate(over="ignore"):
      val = _f32(val) if np.isfinite(np.float32(val)) else float("inf")
  if not ok or not (np.isfinite(val) and val > 0):
    raise _bad(path, key, "a positive finite float32", meta.get(key, default))
  return val


def _str(meta: dict, key: str, path, default: str | None = None) -> str | None:
  val = _need(meta, key, path) if default is None else meta.get(key, default)
  if not isinstance(val, str):
    raise _bad(path, key, "a string", val)
  return val


def config_overrides(meta: dict, path="the file") -> dict:
  """Dotted kvjax config keys for a GGUF file's metadata (raises on anything unsupported).
  Every field is type-checked before use: a number stored as a string or an array is one
  line naming the field, not a traceback."""
  arch = _str(meta, "general.architecture", path)
  if arch not in ARCHITECTURES:
    raise KvjaxError(f"GGUF architecture '{arch}' is not supported; kvjax imports "
                     f"{', '.join(ARCHITECTURES)}")
  a = f"{arch}."
  E = _int(meta, a + "embedding_length", path)
  H = _int(meta, a + "attention.head_count", path)
  K = _int(meta, a + "attention.head_count_kv", path, H)
  D = _int(meta, a + "attention.key_length", path, max(E // H, 1))
  rot = _int(meta, a + "rope.dimension_count", path, D)
  if rot != D:
    raise KvjaxError(f"GGUF rope.dimension_count={rot} != head dim {D} (partial rotary) is not "
                     "supported by kvjax's RoPE")
  scaling = _str(meta, a + "rope.scaling.type", path, "none")
  factor = meta.get(a + "rope.scaling.factor", 1.0)
  if scaling not in ("none", "") or factor not in (0.0, 1.0):
    raise KvjaxError(f"GGUF RoPE scaling '{scaling}' (factor {factor!r:.20}) is not supported; "
                     "kvjax reads unscaled RoPE from GGUF files")
  vocab = meta.get(a + "vocab_size")
  vocab = _vocab_len(path) if vocab is None else _int(meta, a + "vocab_size", path)
  spec = ARCHES[arch]
  extra = dict(spec.settings)
  if spec.global_every:
    extra.update({"model.global_every": spec.global_every,
                  "model.rope_local_theta": spec.rope_local_theta,
                  "model.sliding_window": _int(meta, a + "attention.sliding_window", path, 0, 0),
                  "model.query_scale": float(D)})
  return {
      "model.vocab_size": vocab,
      "model.d_model": E,
      "model.n_layers": _int(meta, a + "block_count", path),
      "model.n_heads": H,
      "model.n_kv_heads": K,
      "model.head_dim": D,
      "model.d_ff": _int(meta, a + "feed_forward_length", path),
      "model.rope_theta": _float(meta, a + "rope.freq_base", path, 10000.0),
      "model.rope_scaling": {},
      "model.norm_eps": _float(meta, a + "attention.layer_norm_rms_epsilon", path, 1e-5),
      "model.qkv_bias": _has_tensor(path, "blk.0.attn_q.bias"),
      "model.tie_embeddings": not _has_tensor(path, "output.weight"),
      "model.max_seq_len": _int(meta, a + "context_length", path),
      "model.dtype": "float32",
      "model.param_dtype": "float32",
      **extra,
  }


def _f32(x) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
  9.999999747378752e-06), so configs read as the checkpoint's authors wrote them."""
  return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def _vocab_len(path) -> int:
  tokens = reader(str(path)).fields.get("tokenizer.ggml.tokens")
  if tokens is None:
    raise KvjaxError(f"GGUF file {path} states no vocab_size and has no tokenizer tokens")
  return len(tokens)


def _has_tensor(path, name: str) -> bool:
  return name in reader(str(path)).tensors


def load_config(path: str | Path, overrides: dict | None = None) -> Config:
  """A kvjax Config for the GGUF file (fp32 compute unless overridden)."""
  path = Path(path)
  meta = metadata(path)
  tok = f"gguf:{path}" if "tokenizer.ggml.model" in meta else "none"
  base = {**config_overrides(meta, path), "tokenizer": tok, "name": f"gguf-{path.stem}"}
  if "rope_freqs.weight" in reader(str(path)).tensors:
    raise KvjaxError(f"{path} carries rope_freqs.weight (llama3-style RoPE scaling), which "
                     "kvjax does not read from GGUF; import the Hugging Face folder instead")
  cfg = config_lib.apply_overrides(Config(), base)
  return config_lib.apply_overrides(cfg, overrides) if overrides else cfg


# -- tensors ------------------------------------------------------------------------------
def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo the GGUF converter's per-head Q/K row permutation ([out, in], out = heads * D).

  The converter groups each head's rows as (D/2, 2) pairs interleaved from (2, D/2) halves;
  this restores the halves order that rotate-half RoPE expects.
  """
  out, rest = w.shape[0], w.shape[1:]
  half = out // n_heads // 2
  return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """The converter's permutation (inverse of `unpermute`); used to write test files."""
  out, rest = w.shape[0], w.shape[1:]
  half = out // n_heads // 2
  return w.reshape(n_heads, 2, half, *rest).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t, path) -> np.ndarray:
  from gguf import GGMLQuantizationType, quants

  try:
    arr = quants.dequantize(t.data, t.tensor_type)
  except NotImplementedError:
    raise KvjaxError(f"tensor '{t.name}' in {path} has type {t.tensor_type.name}, which the gguf "
                     "package cannot dequantize; use a file with another quantization") from None
  except Exception as e:  # noqa: BLE001  short or corrupt data
    raise KvjaxError(f"cannot dequantize tensor '{t.name}' ({GGMLQuantizationType(t.tensor_type).name}) "
                     f"in {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
  return np.asarray(arr, np.float32)


def read_params(path: str | Path, cfg: Config) -> dict:
  """Params in the layout of `kvjax.model.Transformer`, cast to `model.param_dtype`."""
  m = cfg.model
  tensors = reader(str(path)).tensors
  dtype = _DTYPES[m.param_dtype]
  E, H, K, D, F, V = m.d_model, m.n_heads, m.n_kv_heads, m.D, m.F, m.vocab_size
  shapes = {"attn_q": (H * D, E), "attn_k": (K * D, E), "attn_v": (K * D, E),
            "attn_output": (E, H * D), "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}
  used = set()

  def get(name: str, shape: tuple) -> np.ndarray:
    if name not in tensors:
      raise KvjaxError(f"tensor '{name}' is missing from {path}; the file is incomplete or its "
                       "metadata does not match its tensors")
    used.add(name)
    arr = _dequantize(tensors[name], path)
    if tuple(arr.shape) != shape:
      raise KvjaxError(f"tensor '{name}' in {path} has shape {list(arr.shape)} but the metadata "
                       f"implies {list(shape)}")
    finite.check(arr, name, path)
    finite.check_cast(arr, dtype, name, path)
    return arr

  arch = ARCHES[metadata(path)["general.architecture"]]
  norms = {g: (leaf, (E,)) for g, leaf in _NORMS.items()}
  norms.update({g: (leaf, (D,) if leaf in ("q_norm", "k_norm") else (E,))
                for g, leaf in arch.norms})
  biased = ("attn_q", "attn_k", "attn_v") if m.qkv_bias else ()
  # each stacked [L, ...] leaf allocated once and filled layer by layer (a list of the
  # layers' arrays stacked at the end would hold every layer weight twice)
  L = m.n_layers
  layers: dict = {leaf: {"kernel": np.empty((L, *shapes[g][::-1]), dtype),
                         **({"bias": np.empty((L, shapes[g][0]), dtype)} if g in biased else {})}
                  for g, leaf in _LAYER_TENSORS.items()}
  layers.update({leaf: {"weight": np.empty((L, *shape), dtype)} for leaf, shape in norms.values()})
  for i in range(L):
    for g, leaf in _LAYER_TENSORS.items():
      w = get(f"blk.{i}.{g}.weight", shapes[g])
      b = get(f"blk.{i}.{g}.bias", shapes[g][:1]) if g in biased else None
      if arch.permuted and g in ("attn_q", "attn_k"):
        heads = H if g == "attn_q" else K
        w = unpermute(w, heads)
        b = None if b is None else unpermute(b, heads)
      layers[leaf]["kernel"][i] = w.T
      if b is not None:
        layers[leaf]["bias"][i] = b
    for g, (leaf, shape) in norms.items():
      layers[leaf]["weight"][i] = get(f"blk.{i}.{g}.weight", shape)
  cast = lambda a: a.astype(dtype, copy=False)  # noqa: E731 (a dequantized copy: no second)
  params = {"embed_tokens": {"embedding": cast(get("token_embd.weight", (V, E)))},
            "layers": layers, "norm": {"weight": cast(get("output_norm.weight", (E,)))}}
  if not m.tie_embeddings:
    params["lm_head"] = {"kernel": cast(get("output.weight", (V, E)).T)}
  leftover = sorted(set(tensors) - used)
  if leftover:
    raise KvjaxError(f"GGUF tensor '{leftover[0]}' (and {len(leftover) - 1} more) has no place in "
                     "kvjax's model; an unsupported feature (bias, extra layer)?")
  return params


def load(path: str | Path, overrides: dict | None = None) -> tuple[Config, dict]:
  """(Config, params as jax arrays) for a GGUF file of a supported architecture (`ARCHES`)."""
  from kvjax.io import hf

  cfg = load_config(path, overrides)
  params = read_params(path, cfg)
  hf.check_tree(cfg, params)
  return cfg, hf.to_device(params)

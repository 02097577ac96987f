"""The config dataclasses (model, cache, workload, mesh, train, and `Config` over them), the
map of section names to their dataclasses, and the dotted keys they define.

Frozen and hashable, so a config can be passed to `jax.jit` as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 260          # V: 256 bytes + specials (kvjax.io.tokenizer.BYTE_VOCAB)
  d_model: int = 64              # E
  n_layers: int = 2              # L
  n_heads: int = 4               # H
  n_kv_heads: int = 4            # K: MHA when == H, MQA when 1, GQA between
  head_dim: int = 0              # D: 0 means d_model // n_heads
  d_ff: int = 0                  # F: 0 means the Llama rule round(8/3 * E) to a multiple of 8
  attention: str = "auto"        # attention variant, from kvjax.attention.ATTENTIONS (auto:
                                 # native on the CPU, grouped on accelerators)
  rope_theta: float = 10000.0
  rope_scaling: tuple = ()       # (("rope_type","llama3"), ("factor", 8.0), ...) as sorted pairs
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  tie_embeddings: bool = False
  dtype: str = "float32"         # activation / compute dtype
  param_dtype: str = "float32"
  scan_unroll: int = 1           # layers are scanned; >= n_layers: prefill, decode and serve
                                 # run them unrolled over per-layer weights (model.unrolled)
  max_seq_len: int = 4096        # longest position the model is meant for (RoPE tables, checks)
  latent_rank: int = 0           # A > 0: rank-A K/V projections, cacheable as latents (kvjax.cache.latent)
  rope_pairs: int = 0            # r > 0: each KV head rotates r of its D/2 frequency pairs (the
                                 # `rope_keep` param picks them) and the rest not (partial RoPE);
                                 # a latent then caches those 2r key columns beside the latent
                                 # and its decode reads the latent absorbed (MLA)
  program: str = "auto"          # cpu | accelerator | auto (per backend): the layer loop and
                                 # cache read the compiled programs use (attention.base.program)
  layer_loop: str = "auto"       # scan | switch | unrolled | auto (per program): how the layers
                                 # run (kvjax.decode.step.layer_loop, the one place it is decided)
  # Architecture knobs beyond Llama (kvjax.model.layers): Qwen2 is Llama + qkv_bias; Gemma 3
  # sets every one of these.
  qk_norm: bool = False          # RMSNorm over head_dim on each query and key head (q_norm, k_norm)
  sandwich_norm: bool = False    # a norm after attention and after the MLP too (post_attn_norm,
                                 # post_ffw_norm), before each residual add
  embed_scale: bool = False      # embeddings multiplied by sqrt(d_model)
  mlp_act: str = "silu"          # silu | gelu_tanh: the gate's activation
  query_scale: float = 0.0       # logits scaled by query_scale**-0.5 (0: head_dim)
  # Layer types: with global_every = N, layers i with (i + 1) % N == 0 are global and the
  # rest local (0: every layer global). Local layers attend to the last `sliding_window`
  # tokens (0: all of them) and rotate with rope_local_theta (0: rope_theta).
  global_every: int = 0
  sliding_window: int = 0        # W
  rope_local_theta: float = 0.0

  @property
  def D(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def F(self) -> int:
    if self.d_ff:
      return self.d_ff
    return 8 * ((int(round(8 * self.d_model / 3)) + 7) // 8)

  @property
  def G(self) -> int:
    return self.n_heads // self.n_kv_heads

  def is_local(self, layer: int) -> bool:
    """Layer `layer` is a local one (its own RoPE base, and the window if one is set)."""
    return bool(self.global_every) and (layer + 1) % self.global_every != 0

  def window_of(self, layer: int) -> int:
    """The tokens layer `layer` attends to (0: all)."""
    return self.sliding_window if (self.is_local(layer) or not self.global_every) else 0

  @property
  def windowed(self) -> bool:
    """Some layer attends to a window of the last tokens only."""
    return self.sliding_window > 0

  @property
  def variant(self) -> str:
    """MHA / GQA-<kv heads> / MQA (`variant_name`), the name used everywhere."""
    return variant_name(self.n_heads, self.n_kv_heads)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  layout: str = "contiguous"     # none | contiguous | paged | latent (kvjax.cache.LAYOUTS)
  codec: str = ""                # sets k_codec and v_codec when given
  k_codec: str = "fp32"
  v_codec: str = "fp32"
  capacity: int = 0              # S tokens per sequence; 0 means prompt + new tokens
  k_axis: str = "token"          # token | channel (per-channel key scales, KIVI)
  group_size: int = 0            # quantization group along head_dim (token axis) or tokens
  residual: int = 0              # full-precision window of recent tokens (KIVI's R)
  page_size: int = 16
  num_pages: int = 0             # paged pool size; 0 means enough for batch * capacity
  policy: str = "full"           # token eviction policy (kvjax.policies.POLICIES)
  budget: int = 0                # tokens kept per sequence (per layer and KV head); 0: unset
  ratio: float = 0.0             # alternative to budget: fraction of each prompt kept, (0, 1]
  sinks: int = 4                 # first tokens always kept by policy `sinks`
  window: int = 0                # recent (window/sinks/h2o) or snapkv observation window
  heads: str = "uniform"         # uniform | adaptive: one budget per layer spread over its KV
                                 # heads by score (AdaKV; kvjax.policies.heads)
  rotate: str = "none"           # none | hadamard | random: K, Q, V rotated per head (kvjax.codecs.rotate)
  rotate_seed: int = 0           # the seed of `rotate: random`'s orthogonal matrix
  keep_first: int = 0            # tokens at each sequence's start kept in full precision
  clip: str = "none"             # none | mse: each quantization group's range searched for the
                                 # least squared error (kvjax.codecs.clip)


def variant_name(n_heads: int, n_kv_heads: int) -> str:
  """The attention variant's one name: MHA, MQA, or GQA-N with N the KV heads (the GQA
  paper's groups), so Qwen2.5's 14 query heads on 2 KV heads are GQA-2."""
  if n_kv_heads == n_heads:
    return "MHA"
  if n_kv_heads == 1:
    return "MQA"
  return f"GQA-{n_kv_heads}"


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  batch: int = 1
  prompt_len: int = 16
  gen_len: int = 16
  temperature: float = 0.0       # 0 means greedy
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int = -1               # stop token; -1 means none
  repeats: int = 5               # timing repeats (median reported)
  prefill_chunk: int = 0         # N > 0: a prompt is prefilled N tokens at a time through the
                                 # cache (bounded temporaries; kvjax.decode.prefill); 0: whole


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  data: str = "stdlib"           # stdlib (Python's own sources and docs) | a text file or folder
  steps: int = 200
  batch: int = 16
  seq_len: int = 128
  lr: float = 3e-3
  min_lr_ratio: float = 0.1      # cosine decays to lr * min_lr_ratio
  warmup: int = 20
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  eval_every: int = 50
  eval_batches: int = 8
  checkpoint_every: int = 100
  log_every: int = 10
  recall_mix: float = 0.0        # fraction of each batch that is associative recall (kvjax.lab.data)
  recall_pairs: int = 8          # key-value pairs (and queries) per recall sequence


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = 1
  model: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  cache: CacheConfig = CacheConfig()
  workload: WorkloadConfig = WorkloadConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  seed: int = 0
  tokenizer: str = "bytes"       # bytes | none | a path to tokenizer.json
  experiment: str = ""           # experiment name for `kvjax run`
  grid: tuple = ()               # ((dotted key, (values...)), ...) expanded by `kvjax run`
  params: tuple = ()             # experiment-specific options as sorted (key, value) pairs
  name: str = ""

  def to_dict(self) -> dict:
    return _to_plain(self)

  def hash(self) -> str:
    """12 hex digits identifying what runs: the config with every field that holds its
    default left out, so adding a new option (with a default that changes nothing) keeps
    the hash of every config, and every committed results row, as it was."""
    blob = json.dumps(_non_default(self), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]

  def param(self, key: str, default: Any = None) -> Any:
    return dict(self.params).get(key, default)

  def param_int(self, key: str, default: int = 0) -> int:
    """`param` as a whole number; anything else (a list, a fraction, text, a bool) is the
    user's error, named in one line (KvjaxError)."""
    val = self.param(key, default)
    if isinstance(val, bool) or not isinstance(val, (int, float, str)):
      val = None
    elif isinstance(val, str):
      val = int(val) if val.strip().lstrip("+-").isdigit() else None
    elif isinstance(val, float):
      val = int(val) if val.is_integer() else None
    if val is None:
      from kvjax.errors import KvjaxError
      raise KvjaxError(f"params.{key} must be a whole number, got {self.param(key)!r}"
                       + ("; a list of values belongs in grid:, one cell each"
                          if isinstance(self.param(key), (list, tuple)) else ""))
    return val


def _non_default(obj: Any) -> dict:
  """`to_dict` without the fields equal to their dataclass default (recursively)."""
  out = {}
  for f in dataclasses.fields(obj):
    val = getattr(obj, f.name)
    if dataclasses.is_dataclass(val):
      sub = _non_default(val)
      if sub:
        out[f.name] = sub
    elif val != f.default:
      out[f.name] = _to_plain(val) if f.name not in ("grid", "params", "rope_scaling") \
          else {k: _to_plain(v) for k, v in val}
  return out


def _to_plain(obj: Any) -> Any:
  if dataclasses.is_dataclass(obj):
    out = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    for key in ("grid", "params", "rope_scaling"):
      if key in out:
        out[key] = {k: _to_plain(v) for k, v in getattr(obj, key)}
    return out
  if isinstance(obj, tuple):
    return [_to_plain(v) for v in obj]
  return obj


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "workload": WorkloadConfig,
             "mesh": MeshConfig, "train": TrainConfig}
_FREEFORM = ("grid", "params", "model.rope_scaling")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
  return typing.get_type_hints(cls)  # evaluates every annotation string: slow, so once


def field_type(cls: type, name: str) -> Any:
  """The type annotation of field `name` of dataclass `cls` (resolved, not a string)."""
  return _hints(cls)[name]


def known_keys() -> list[str]:
  """Every key a config accepts: top-level names, then `section.field` per section."""
  keys = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS]
  for sec, cls in SECTIONS.items():
    keys += [f"{sec}.{f.name}" for f in dataclasses.fields(cls)]
  return keys

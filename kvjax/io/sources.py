"""Where a model comes from, one name for every command and experiment.

A source is `KIND:REF` or a bare reference whose kind is inferred:

  config:FILE.yaml      random weights of a config's shape (seeded by its `seed`)
  checkpoint:DIR        a kvjax (orbax) checkpoint folder, e.g. one `kvjax train` wrote
  hf:DIR                a Hugging Face Llama/Qwen2/Mistral safetensors folder
  gguf:FILE|NAME        a llama-architecture GGUF file, or a model `kvjax models` knows

The CLI's `--config/--checkpoint/--hf/--gguf` flags and experiment configs'
`params.models` lists both resolve here, so every place that takes a model takes all four.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvjax import config as config_lib
from kvjax import registries  # noqa: F401  (config.validate then knows every registry's names)
from kvjax.errors import KvjaxError

KINDS = ("config", "checkpoint", "hf", "gguf")


@dataclasses.dataclass(frozen=True)
class Source:
  kind: str
  ref: str

  def __str__(self) -> str:
    return f"{self.kind}:{self.ref}"

  @property
  def name(self) -> str:
    """A short label for results rows and plots: the file's name without its .gguf / .yaml
    suffix (a named model keeps its whole name: `qwen2.5-coder-0.5b`, not `qwen2.5-coder-0`)."""
    name = Path(self.ref).name
    for suffix in (".gguf", ".yaml", ".yml"):
      if self.kind in ("gguf", "config") and name.endswith(suffix):
        return name[:-len(suffix)]
    return name


def parse(spec: str) -> Source:
  """`KIND:REF`, or a bare path / model name whose kind is inferred."""
  from kvjax.io import zoo

  spec = str(spec)
  kind, sep, ref = spec.partition(":")
  if sep and kind in KINDS:
    if not ref:
      raise KvjaxError(f"model source '{spec}' names no {kind}")
    return Source(kind, ref)
  p = Path(spec)
  if spec in zoo.MODELS or spec.endswith(".gguf"):
    return Source("gguf", spec)
  if p.suffix in (".yaml", ".yml"):
    return Source("config", spec)
  if (p / "config.yaml").is_file():
    return Source("checkpoint", spec)
  if (p / "config.json").is_file():
    return Source("hf", spec)
  raise KvjaxError(f"cannot tell what model '{spec}' is; write it as one of "
                   + ", ".join(f"{k}:..." for k in KINDS))


def from_args(args) -> Source:
  """The source named by a command's --config/--checkpoint/--hf/--gguf flag; none named
  is the default config (a tiny random model: `kvjax generate --prompt-ids 1,2,3`)."""
  for kind in KINDS:
    ref = getattr(args, kind, None)
    if ref:
      return Source(kind, ref)
  return Source("config", "")


def load_config(src: Source, overrides: dict | None = None) -> config_lib.Config:
  """The model's Config without reading weights (what `kvjax size` needs)."""
  if src.kind == "gguf":
    from kvjax.io import gguf
    from kvjax.io import zoo
    return gguf.load_config(zoo.resolve_gguf(src.ref), overrides)
  if src.kind == "hf":
    from kvjax.io import hf
    return hf.load_config(src.ref, overrides)
  if src.kind == "checkpoint":
    from kvjax.io import checkpoint
    return checkpoint.read_config(src.ref, overrides)
  return config_lib.load(src.ref or None, overrides)


def load(src: Source, overrides: dict | None = None):
  """(Config, params, tokenizer or None) for a source; `overrides` are dotted config keys."""
  from kvjax.io import tokenizer

  if src.kind == "gguf":
    from kvjax import memory
    from kvjax.io import gguf
    from kvjax.io import zoo
    path = zoo.resolve_gguf(src.ref)
    # weights are dequantized to model.param_dtype: refuse before reading them when they
    # cannot fit (hf and checkpoint loads check the same inside their own load)
    memory.check_params(gguf.load_config(path, overrides), f"the weights of {src.ref}")
    cfg, params = gguf.load(path, overrides)
    folder = None
  elif src.kind == "hf":
    from kvjax.io import hf
    cfg, params = hf.load(src.ref, overrides=overrides)
    folder = src.ref
  elif src.kind == "checkpoint":
    from kvjax.io import checkpoint
    cfg, params = checkpoint.load(src.ref, overrides=overrides)
    folder = None
  else:
    from kvjax import memory, model
    from kvjax.decode import sharding
    cfg = config_lib.load(src.ref or None, overrides)
    memory.check_params(cfg)  # refuse weights that cannot fit before creating them
    if sharding.is_sharded(cfg):  # created already split: never whole on one device
      params = sharding.init_params(cfg, sharding.make_mesh(cfg))
    else:
      params = model.init_params(cfg.model, cfg.seed)
    folder = None
  return cfg, params, tokenizer.get_tokenizer(cfg.tokenizer, folder)

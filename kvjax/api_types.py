"""The Python API's values: `CacheConfig` (the cache settings a call asks for) and the
results of `Model.generate`, `Model.evaluate`, `Model.size` and `kvjax.run`.

Each result is a dataclass of the fields a notebook reads most, built from the dict the
command line prints with --json; `to_dict()` gives that dict back unchanged, and any other
key of it reads as an attribute too (`r.bits_per_element`, an interval field evaluate adds).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

from kvjax import config as config_lib
from kvjax.errors import KvjaxError


def _cache_fields() -> list[tuple]:
  """One optional field per `cache.*` config key, None meaning "as the model has it"."""
  hints = typing.get_type_hints(config_lib.CacheConfig)
  return [(f.name, Optional[hints[f.name]], dataclasses.field(default=None))
          for f in dataclasses.fields(config_lib.CacheConfig)]


CacheConfig = dataclasses.make_dataclass("CacheConfig", _cache_fields(), frozen=True)
CacheConfig.__module__ = __name__
CacheConfig.__doc__ = (
    "Cache settings for one call, by the names of the `cache.*` config keys (docs/"
    "architecture.md), e.g. `CacheConfig(codec=\"int4\", k_axis=\"channel\", group_size=32, "
    "residual=128)`. A field left None keeps the model's own setting; codec names are the "
    "CLI's (fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int8, int4, int2, and any registered one). "
    "Fields: " + ", ".join(f.name for f in dataclasses.fields(config_lib.CacheConfig)) + ".")


def cache_items(cache) -> dict[str, Any]:
  """`cache.*` overrides of a CacheConfig, a dict ({"codec": "int4"} or dotted keys), a
  codec name, or None; unknown keys are refused as `--set` refuses them."""
  if cache is None:
    return {}
  if isinstance(cache, str):
    return {"cache.codec": cache}
  if isinstance(cache, CacheConfig):
    cache = {k: v for k, v in dataclasses.asdict(cache).items() if v is not None}
  elif isinstance(cache, config_lib.CacheConfig):
    default = config_lib.CacheConfig()
    cache = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)
             if getattr(cache, f.name) != getattr(default, f.name)}
  if not isinstance(cache, dict):
    raise KvjaxError(f"cache= expects a kvjax.CacheConfig, a dict or a codec name, got "
                     f"{type(cache).__name__}")
  bad = [k for k in cache if not isinstance(k, str)]
  if bad:
    raise KvjaxError(f"cache= keys are cache.* key names (text), got {bad[0]!r}")
  return {k if k.startswith("cache.") else f"cache.{k}": v for k, v in cache.items()}


@dataclasses.dataclass
class Result:
  """A command's result: typed fields, and `raw`, the CLI's JSON dict."""

  raw: dict = dataclasses.field(repr=False)

  @classmethod
  def of(cls, raw: dict, **fields):
    names = [f.name for f in dataclasses.fields(cls) if f.name != "raw"]
    return cls(raw=raw, **{n: fields.get(n, raw.get(n)) for n in names})

  def to_dict(self) -> dict:
    """The dict `kvjax <command> --json` prints for the same request."""
    return dict(self.raw)

  def __getattr__(self, name: str):
    raw = self.__dict__.get("raw")
    if raw is not None and name in raw:
      return raw[name]
    raise AttributeError(f"{type(self).__name__} has no field '{name}'")


@dataclasses.dataclass
class GenerateResult(Result):
  """`Model.generate`: the new tokens (cut after the first stop token) and their text, for
  one prompt as one list / string, for a batch as one per prompt; the cache's bytes after
  the last token; time to first token (prefill + first sample) and time per output token."""

  text: Any = None              # str, or list[str] for a batch (None: no tokenizer)
  tokens: Any = None            # list[int], or list[list[int]] for a batch
  cache_bytes: int = 0
  ttft_s: float = 0.0
  tpot_s: float = 0.0
  compile_s: float = 0.0
  k_codec: str = ""
  v_codec: str = ""
  random_weights: bool = False


@dataclasses.dataclass
class EvalResult(Result):
  """`Model.evaluate`: the cache against an fp32 cache on the same tokens: perplexities, the
  relative Δppl, mean KL(ref || cache) in nats, argmax agreement, and the bytes the cache
  held per token at this context (`bytes_per_token_asymptotic`: the long-context limit)."""

  ppl: float = 0.0
  ppl_ref: float = 0.0
  dppl_rel: float = 0.0
  kl: float = 0.0
  agreement: float = 0.0
  bytes_per_token: float = 0.0
  bytes_per_token_asymptotic: float = 0.0
  bits_per_element: float = 0.0
  cache_bytes: int = 0
  k_codec: str = ""
  v_codec: str = ""


@dataclasses.dataclass
class SizeResult(Result):
  """`Model.size`: closed-form bytes per token held at `seq_len`, the total for the batch,
  and with a budget, how many sequences fit after the weights (per whole-head codec too)."""

  bytes_per_token: float = 0.0
  total_bytes: int = 0
  bits_per_element: float = 0.0
  k_codec: str = ""
  v_codec: str = ""
  max_sequences: Optional[int] = None
  max_sequences_by_codec: Optional[dict] = None
  batch_fits: Optional[bool] = None


@dataclasses.dataclass
class RunReport(Result):
  """`kvjax.run`: the experiment, its results file, cells in the grid and cells run now."""

  experiment: str = ""
  path: str = ""
  cells: int = 0
  ran: int = 0

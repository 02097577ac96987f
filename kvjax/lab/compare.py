"""Paired comparisons against any reference: A against B on the same tokens.

`kvjax eval --ref SETTING`, `Model.evaluate(ref=...)`, `Model.compare(...)` and the quality
experiment's `params.reference` all hold a cache (A) to a reference (B) read on the same
token windows: Δppl = ppl(A) / ppl(B) - 1, KL(B || A) and the argmax agreement of A with B,
each with its paired 95 % interval (`kvjax.lab.intervals`: the tokens are shared, so each
window's sums for A and B are taken together). B is

  - a cache setting of the same model: a codec name (`bf16`, `int8`) or `cache.*` keys as
    `KEY=VALUE[,KEY=VALUE...]` (`codec=int4,group_size=32`, `k_codec=int8,v_codec=int4`),
    applied to a plain fp32 contiguous cache (the default reference, `fp32`);
  - another model or checkpoint read through its fp32 cache: a source (`checkpoint:DIR`,
    `hf:DIR`, `gguf:FILE|NAME`, `config:FILE.yaml`, or a folder kvjax recognises) whose
    tokenizer reads the text to the same ids and whose vocabulary is the same size (two
    models are compared position by position, so they must see one token sequence).

B's log-probabilities are computed once per window and reused for every setting held to
it (`kvjax.lab.evaluate.eval_settings`).
"""

from __future__ import annotations

from pathlib import Path

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab import evaluate

FP32 = "fp32"


def kind_of(spec: str) -> str:
  """"model" when `spec` names a model source (KIND:REF or a model folder), else "cache"."""
  from kvjax.io import sources
  spec = str(spec)
  kind, sep, _ = spec.partition(":")
  if sep and kind in sources.KINDS:
    return "model"
  p = Path(spec)
  if spec.endswith((".gguf", ".yaml", ".yml")) or (p / "config.yaml").is_file() \
      or (p / "config.json").is_file():
    return "model"
  return "cache"


def cache_items(spec: str) -> dict:
  """`cache.*` overrides of a cache setting: a codec name, or KEY=VALUE pairs."""
  spec = str(spec).strip()
  if not spec:
    raise KvjaxError("--ref is empty; name a codec (bf16), cache keys (codec=int4,group_size=32)"
                     " or a model (checkpoint:DIR)")
  if "=" not in spec:
    return {"cache.codec": spec}
  items = {}
  for part in spec.split(","):
    key, sep, value = part.partition("=")
    key = key.strip()
    if not sep or not key or not value.strip():
      raise KvjaxError(f"--ref {spec!r}: write cache keys as KEY=VALUE[,KEY=VALUE], e.g. "
                       "codec=int4,group_size=32")
    items[key if key.startswith("cache.") else f"cache.{key}"] = value.strip()
  return config_lib.parse_set([f"{k}={v}" for k, v in items.items()])


def cache_reference(cfg: config_lib.Config, params, spec=None, label: str | None = None,
                    items: dict | None = None) -> evaluate.Reference:
  """A cache setting of the same model, on a plain fp32 contiguous cache otherwise."""
  base = evaluate.reference_config(cfg)
  items = cache_items(spec) if items is None else items
  if not items or items == {"cache.codec": FP32}:
    return evaluate.Reference(base, params, "fp32 cache", "cache")
  ref_cfg = config_lib.apply_overrides(base, items)
  c = ref_cfg.cache
  codec = c.k_codec if c.k_codec == c.v_codec else f"K{c.k_codec}/V{c.v_codec}"
  name = label or (str(spec) if spec is not None and "=" in str(spec) else codec)
  return evaluate.Reference(ref_cfg, params, f"{name} cache", "cache")


def model_reference(cfg: config_lib.Config, tok, ref_cfg: config_lib.Config, ref_params,
                    ref_tok, label: str, sample: str = "") -> evaluate.Reference:
  """Another model (its fp32 cache) as the reference, once it reads the same tokens."""
  check_same_tokens(cfg, tok, ref_cfg, ref_tok, label, sample)
  return evaluate.Reference(evaluate.reference_config(ref_cfg), ref_params,
                            f"{label} (fp32 cache)", "model")


def check_same_tokens(cfg, tok, ref_cfg, ref_tok, label: str, sample: str = "") -> None:
  """Two models compared position by position must share a vocabulary and a tokenizer."""
  va, vb = cfg.model.vocab_size, ref_cfg.model.vocab_size
  if va != vb:
    raise KvjaxError(f"--ref {label} has a vocabulary of {vb} tokens, this model {va}; compare "
                     "models that share a tokenizer")
  if tok is None or ref_tok is None:
    raise KvjaxError(f"--ref {label}: both models need a tokenizer to read the text")
  text = sample[:2000] or "The cache keeps every key and value a decoder has seen."
  if list(tok.encode(text)) != list(ref_tok.encode(text)):
    raise KvjaxError(f"--ref {label} tokenizes the text differently; compare models that "
                     "share a tokenizer")


def reference(spec, cfg: config_lib.Config, params, tok, sample: str = "") -> evaluate.Reference:
  """The reference `spec` names (module docstring), for a model loaded as (cfg, params, tok)."""
  if spec is None or spec == "":
    return evaluate.fp32_reference(cfg, params)
  if kind_of(spec) == "cache":
    return cache_reference(cfg, params, spec)
  from kvjax import memory
  from kvjax.io import sources
  src = sources.parse(str(spec))
  memory.check_params(sources.load_config(src), f"the weights of --ref {spec}")
  ref_cfg, ref_params, ref_tok = sources.load(src)
  return model_reference(cfg, tok, ref_cfg, ref_params, ref_tok, str(src), sample)


def eval_cli(src, overrides: dict, ref: str | None, text: str = "stdlib", tokens: int = 512,
             seqs: int = 4, chunk: int = 1, progress: bool = True) -> dict:
  """`kvjax eval ... --ref SETTING`: the configured cache against the reference."""
  from kvjax.io import sources

  text_source = evaluate.eval_inputs(text, tokens, seqs, chunk)  # before any weight loads
  if kind_of(ref) == "cache":
    cache_items(ref)  # a malformed setting refused before the weights load
  evaluate.check_tokens(tokens, sources.load_config(src, overrides).model.max_seq_len)
  cfg, params, tok = sources.load(src, overrides)
  r = reference(ref, cfg, params, tok, text_source)
  return evaluate.eval_loaded(cfg, params, tok, src, text, tokens, seqs, chunk, progress,
                              text_source, r)

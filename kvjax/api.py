"""The Python API: what a notebook uses, over the same code the command line runs.

    import kvjax
    m = kvjax.load("smollm2-135m")                 # the real model (GGUF), by name
    c = kvjax.CacheConfig(codec="int4", k_axis="channel", group_size=32, residual=128)
    out = m.generate("The capital of France is", cache=c, max_new_tokens=16)
    r = m.evaluate(cache=c, tokens=256)            # ppl, kl, agreement, bytes_per_token
    s = m.size(cache=c, seq_len=32768, batch=8, budget="80GiB")
    kvjax.run("configs/quickstart.yaml", out="results/q"); kvjax.plot("results/q", out="plots")

`generate` is `kvjax generate` (kvjax.decode.generate), `evaluate` is `kvjax eval`
(kvjax.lab.evaluate), `size` is `kvjax size` (the CLI's own command on the same flags), `run`
is `kvjax run` (kvjax.lab.runner), `plot` is `kvjax plot` (kvjax.lab.plots). The weights are read once, by
`load`; each call applies its cache settings to the loaded model's config, validated as
`--set` validates them, so a bad value raises `KvjaxError` with the CLI's one-line message.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

from kvjax import config as config_lib
from kvjax import envcheck, faces, inputs
from kvjax import registries  # noqa: F401  (config.validate then knows every registry's names)
from kvjax.api_types import (CacheConfig, EvalResult, GenerateResult, RunReport, SizeResult,
                             cache_items)
from kvjax.errors import KvjaxError, as_arg

__all__ = ["CacheConfig", "EvalResult", "GenerateResult", "Model", "RunReport", "SizeResult",
           "load", "plot", "results", "run", "size"]

Prompt = str | Sequence[int]


class RandomWeightsWarning(UserWarning):
  """The model was initialised, not read: its text is noise (speed and memory are real)."""


def resolve_source(spec: str):
  """A model source (kvjax.io.sources) for a name: a known real model, KIND:REF, or a
  packaged shape (random weights)."""
  from kvjax.io import sources, zoo

  spec = str(spec)
  if spec in config_lib.shape_names() and spec not in zoo.MODELS:
    return sources.Source("config", spec)
  if spec.startswith("shape:"):
    return sources.Source("config", spec[len("shape:"):])
  return sources.parse(spec)


def load(source: str = "smollm2-135m", overrides: dict | None = None) -> "Model":
  """Load a model by source name: a model `kvjax models` knows (`smollm2-135m`),
  `gguf:PATH`, `hf:DIR`, `checkpoint:DIR`, `config:FILE.yaml`, or a packaged shape
  (`llama3-8b`, `shape:smollm2-135m`) with random weights (a `RandomWeightsWarning`, and
  `Model.random_weights`). `overrides` are dotted config keys applied at load
  (`{"model.n_kv_heads": 1}`)."""
  envcheck.check()  # KVJAX_*, XLA_FLAGS: before JAX makes a device, as the CLI checks them
  from kvjax.io import sources

  src = resolve_source(source)
  over = dict(overrides or {})
  cfg, params, tok = sources.load(src, over)
  if src.kind == "config":
    warnings.warn(f"{src}: random weights (a shape is initialised, not trained): its text is "
                  "noise; speed and memory are real", RandomWeightsWarning, stacklevel=2)
  return Model(cfg, params, tok, src, over)


class Model:
  """A loaded model: its config (`config`), weights, tokenizer and source.

  Every method takes `cache=`: a `CacheConfig`, a dict of `cache.*` keys
  (`{"codec": "int8"}`) or a codec name (`"int4"`); None keeps the loaded config's cache
  (fp32 unless the load's overrides said otherwise)."""

  def __init__(self, cfg: config_lib.Config, params, tokenizer, source, overrides: dict):
    self.config, self.params, self.tokenizer, self.source = cfg, params, tokenizer, source
    self.overrides = overrides

  @property
  def random_weights(self) -> bool:
    """True when the weights were initialised (a config or shape), not read."""
    return self.source.kind == "config"

  @property
  def name(self) -> str:
    return str(self.source)

  def __repr__(self) -> str:
    m = self.config.model
    return (f"Model({self.source}: {m.variant} L={m.n_layers} H={m.n_heads} K={m.n_kv_heads} "
            f"D={m.D}{', random weights' if self.random_weights else ''})")

  def with_cache(self, cache=None, **workload) -> config_lib.Config:
    """The loaded config with `cache` settings (and `workload.*` keys) applied, validated."""
    items = {**cache_items(cache), **{f"workload.{k}": v for k, v in workload.items()
                                      if v is not None}}
    return config_lib.apply_overrides(self.config, items) if items else self.config

  def encode(self, text: str, chat: bool = False) -> list[int]:
    """Token ids of `text` (through the model's chat template with `chat`)."""
    return faces.prompts(self.tokenizer, text, chat=chat)[0]

  def generate(self, prompt: Prompt | list[Prompt], cache=None, max_new_tokens: int = 16,
               chat: bool = False, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               stop: bool = True) -> GenerateResult:
    """Prefill + decode through the cache, as `kvjax generate`. `prompt`: a text, a list
    of ids, or a list of either (a ragged batch). `chat` renders a text prompt as one
    user turn through the model's own template; generation stops at the model's stop
    tokens (EOS, end of turn) unless `stop=False`. Greedy unless `temperature` > 0."""
    items, batch = inputs.prompts(prompt)  # (kvjax.inputs: the checks the CLI's flags get)
    inputs.integer("max_new_tokens", max_new_tokens)
    inputs.seed(seed)
    for name, value, integer in (("temperature", temperature, False), ("top_k", top_k, True),
                                 ("top_p", top_p, False)):
      inputs.number(name, value, f"workload.{name}", integer)
    for name, flag in (("chat", chat), ("stop", stop)):
      if not isinstance(flag, bool):
        raise KvjaxError(f"{name} must be True or False, got {flag!r}")
    ids = []
    for p in items:
      if isinstance(p, str):
        ids += faces.prompts(self.tokenizer, p, chat=chat)
      else:
        ids += faces.prompts(self.tokenizer, ids=[p], chat=chat)
    cfg = self.with_cache(cache, temperature=temperature, top_k=top_k, top_p=top_p)
    raw = faces.report(cfg, self.params, self.tokenizer, self.source, ids,
                       max_new_tokens, seed=seed, stop=stop, chat=chat)
    inputs.refuse_non_finite("generate", raw)
    text = raw.get("text")
    one = (lambda x: x) if batch else (lambda x: x[0])  # noqa: E731
    return GenerateResult.of(raw, text=None if text is None else one(text),
                             tokens=one(raw["tokens"]))

  def evaluate(self, text: str | None = None, cache=None, tokens: int = 512, seqs: int = 4,
               chunk: int = 1, progress: bool = False, *, path: str | Path | None = None,
               corpus: str | None = None, ref=None) -> EvalResult:
    """Quality through the cache against a reference on the same tokens, as `kvjax eval`:
    `seqs` windows of `tokens` tokens fed `chunk` tokens at a time (1: pure decode), of
    `text` (the text itself), of the file or folder at `path`, or of a named `corpus`
    (`stdlib`, Python's own sources: the default); at most one of the three. `ref` is what
    the cache is held to (`kvjax eval --ref`, kvjax.lab.compare): None for the fp32 cache, a
    cache (a codec name, dict or CacheConfig) of this model, another loaded `Model`, or a
    model source (`checkpoint:DIR`) on the same tokenizer."""
    return self.compare({"": cache}, ref, text, tokens, seqs, chunk, progress, path=path,
                        corpus=corpus)[""]

  def compare(self, caches, ref=None, text: str | None = None, tokens: int = 512,
              seqs: int = 1, chunk: int = 1, progress: bool = False, *,
              path: str | Path | None = None, corpus: str | None = None) -> dict:
    """`evaluate` of several caches against one reference, whose log-probabilities are
    computed once and reused: `caches` maps a name to a cache (or is a list of codec
    names); returns {name: EvalResult}, each a paired comparison (Δppl, KL(ref || cache),
    agreement, with 95 % intervals) on the same tokens. `compare(["int4"], ref="bf16")` is
    int4 against bf16 as one paired figure."""
    from kvjax.lab import evaluate

    kind, value = inputs.eval_source(text, path, corpus)
    inputs.windows(tokens, seqs, chunk)
    if kind == "text":
      text_source, label = value, f"text ({len(value)} characters)"
    else:
      label = f"./{value}" if kind == "path" and value == "stdlib" else value  # a file
      text_source = evaluate.eval_inputs(label, tokens, seqs, chunk)
    evaluate.check_tokens(tokens, self.config.model.max_seq_len)
    if isinstance(caches, (list, tuple)):
      caches = {str(c): c for c in caches}
    if not isinstance(caches, dict) or not caches:
      raise KvjaxError("caches= expects a dict of name -> cache or a list of codec names, got "
                       f"{type(caches).__name__}")
    cfgs = {str(name): self.with_cache(c) for name, c in caches.items()}
    raw = evaluate.eval_settings(cfgs, self.params, self.tokenizer, self.source, label,
                                 tokens, seqs, chunk, progress, text_source,
                                 self.reference(ref, text_source))
    out = {}
    for name, r in raw.items():
      inputs.refuse_non_finite("evaluate", r)
      for w in r.get("warnings", ()):
        warnings.warn(w, stacklevel=3)
      out[name] = EvalResult.of(r)
    return out

  def reference(self, ref=None, sample: str = ""):
    """The `kvjax.lab.evaluate.Reference` that `ref` names (see `evaluate`)."""
    from kvjax.lab import compare

    if ref is None:
      return None
    if isinstance(ref, Model):
      return compare.model_reference(self.config, self.tokenizer, ref.config, ref.params,
                                     ref.tokenizer, ref.name, sample)
    if isinstance(ref, str) and compare.kind_of(ref) == "model":
      return compare.reference(str(resolve_source(ref)), self.config, self.params,
                               self.tokenizer, sample)
    items = {"cache.codec": ref} if isinstance(ref, str) and "=" not in ref else \
        compare.cache_items(ref) if isinstance(ref, str) else cache_items(ref)
    return compare.cache_reference(self.config, self.params, items=items,
                                   label=ref if isinstance(ref, str) else None)

  def size(self, cache=None, seq_len: int = 4096, batch: int = 1,
           budget: str | None = None) -> SizeResult:
    """Closed-form cache bytes at `seq_len` for `batch` sequences, as `kvjax size` (a bf16
    cache when `cache` names no codec); with `budget` ("80GiB", "80GB"), how many
    sequences fit after the weights, per codec. (`kvjax.size` answers the same without
    loading the weights.)"""
    return _size(self.source, {**self.overrides, **cache_items(cache)}, seq_len, batch, budget)


def _size(src, items: dict, seq_len, batch, budget) -> SizeResult:
  """`kvjax size`'s result for a model source through the lab's sizing (`kvjax.lab.sizing`),
  as the CLI gets it: its config read without its weights, `items` (dotted keys) over it,
  DEFAULT_CODEC when neither they nor the model's own config file name a codec."""
  from kvjax.lab import sizing

  cfg, param_dtype, file_items = sizing.of_source(src)
  named = src.kind != "config" or bool(src.ref)  # a file or folder (a packaged shape too)
  for name, value in (("seq_len", seq_len), ("batch", batch)):  # named as keywords here
    as_arg(name, inputs.count, value)
  notes = []
  if not sizing.names_codec(items, file_items):
    items = {**items, "cache.codec": sizing.DEFAULT_CODEC}
    notes.append(f"no codec given: {sizing.DEFAULT_CODEC} cache assumed; cache= to change")
  cfg = config_lib.apply_overrides(cfg, items)
  raw = sizing.report(cfg, seq_len, batch, named=named, notes=notes, param_dtype=param_dtype,
                      budget=None if budget is None else str(budget))
  for w in raw.get("warnings", ()):
    warnings.warn(w, stacklevel=3)
  b = raw.get("budget") or {}
  return SizeResult.of(raw, max_sequences=b.get("max_sequences"),
                       max_sequences_by_codec=b.get("max_sequences_by_codec"),
                       batch_fits=b.get("batch_fits"))


def size(source: str = "smollm2-135m", cache=None, seq_len: int = 4096, batch: int = 1,
         budget: str | None = None, overrides: dict | None = None) -> SizeResult:
  """Closed-form cache bytes of a model named by shape or source (`llama3-8b`,
  `smollm2-135m`, `gguf:FILE`, `hf:DIR`, `checkpoint:DIR`, `config:FILE.yaml`) without
  loading its weights, as `kvjax size` does: bytes per token held at `seq_len`, the total
  for `batch` sequences (a bf16 cache unless `cache` names a codec), and with `budget`
  ("80GiB"), how many sequences fit after the weights, per codec. `overrides` are dotted
  config keys (`{"model.n_kv_heads": 1}`)."""
  envcheck.check()
  src = resolve_source(source)
  if overrides is not None and not isinstance(overrides, dict):
    raise KvjaxError(f"overrides= expects a dict of dotted keys, got {type(overrides).__name__}")
  return _size(src, {**(overrides or {}), **cache_items(cache)}, seq_len, batch, budget)


def run(config: str | Path, out: str | Path | None = None,
        overrides: dict | list[str] | None = None, shard: str | None = None,
        dry_run: bool = False, quiet: bool = False) -> RunReport:
  """Run an experiment config's grid, as `kvjax run` (rows appended to `out`, default
  results/<name>; finished cells skipped; the summary table printed unless `quiet`);
  `dry_run` lists the cells and runs nothing."""
  from kvjax.lab import runner

  with _quiet(quiet):
    if dry_run:
      raw = runner.dry_run(config, overrides=overrides, out_dir=out, shard=shard)
    else:
      raw = runner.run_file(config, overrides=overrides, out_dir=out, progress=not quiet,
                            shard=shard)
  return RunReport.of(raw)


def _quiet(quiet: bool):
  """stdout and stderr to nowhere while a `quiet` call runs."""
  import contextlib
  import io

  if not quiet:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
  stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
  return stack


def results(path: str | Path, experiment: str | None = None) -> list[dict]:
  """The rows under a results folder or file as flat records (what `kvjax results --format
  csv` writes: variant and workload fields, then every metric, raw units)."""
  from kvjax.lab.runner import results as results_lib
  return results_lib.records(results_lib.load(path, experiment))


def plot(results_dir: str | Path, out: str | Path = "plots", quiet: bool = False) -> list[Path]:
  """Redraw every plot the rows under `results_dir` support, into `out` (PNG and SVG), as
  `kvjax plot RESULTS_DIR --out OUT` does (kvjax.lab.plots); the paths written. What it drew
  and skipped is printed unless `quiet`; no folder or no rows raises `KvjaxError`."""
  from kvjax.lab import plots

  with _quiet(quiet):
    return plots.plot_all(results_dir, out)

"""The Python API: what a notebook uses, over the same code the command line runs.

    import kvjax
    m = kvjax.load("smollm2-135m")                 # the real model (GGUF), by name
    c = kvjax.CacheConfig(codec="int4", k_axis="channel", group_size=32, residual=128)
    out = m.generate("The capital of France is", cache=c, max_new_tokens=16)
    r = m.evaluate(cache=c, tokens=256)            # ppl, kl, agreement, bytes_per_token
    s = m.size(cache=c, seq_len=32768, batch=8, budget="80GiB")
    kvjax.run("configs/quickstart.yaml", out="results/q"); kvjax.plot("results/q", out="plots")

`generate` is `kvjax generate` (kvjax.generation), `evaluate` is `kvjax eval`
(kvjax.evaluate), `size` is `kvjax size` (the CLI's own command on the same flags), `run`
is `kvjax run` (kvjax.runner), `plot` is `kvjax plot` (kvjax.plots). The weights are read once, by
`load`; each call applies its cache settings to the loaded model's config, validated as
`--set` validates them, so a bad value raises `KvjaxError` with the CLI's one-line message.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

from kvjax import config as config_lib
from kvjax import envcheck, inputs
from kvjax import registries  # noqa: F401  (config.validate then knows every registry's names)
from kvjax.api_types import (CacheConfig, EvalResult, GenerateResult, RunReport, SizeResult,
                             cache_items)
from kvjax.errors import KvjaxError

__all__ = ["CacheConfig", "EvalResult", "GenerateResult", "Model", "RunReport", "SizeResult",
           "load", "plot", "results", "run"]

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
    from kvjax import generation
    return generation.prompts(self.tokenizer, text, chat=chat)[0]

  def generate(self, prompt: Prompt | list[Prompt], cache=None, max_new_tokens: int = 16,
               chat: bool = False, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               stop: bool = True) -> GenerateResult:
    """Prefill + decode through the cache, as `kvjax generate`. `prompt`: a text, a list
    of ids, or a list of either (a ragged batch). `chat` renders a text prompt as one
    user turn through the model's own template; generation stops at the model's stop
    tokens (EOS, end of turn) unless `stop=False`. Greedy unless `temperature` > 0."""
    from kvjax import generation

    items, batch = inputs.prompts(prompt)  # (kvjax.inputs: the checks the CLI's flags get)
    inputs.integer("--max-new-tokens", max_new_tokens)
    inputs.seed(seed)
    for name, flag in (("chat", chat), ("stop", stop)):
      if not isinstance(flag, bool):
        raise KvjaxError(f"{name} must be True or False, got {flag!r}")
    ids = []
    for p in items:
      if isinstance(p, str):
        ids += generation.prompts(self.tokenizer, p, chat=chat)
      else:
        ids += generation.prompts(self.tokenizer, ids=[p], chat=chat)
    cfg = self.with_cache(cache, temperature=temperature, top_k=top_k, top_p=top_p)
    raw = generation.report(cfg, self.params, self.tokenizer, self.source, ids,
                            max_new_tokens, seed=seed, stop=stop, chat=chat)
    inputs.refuse_non_finite("generate", raw)
    text = raw.get("text")
    one = (lambda x: x) if batch else (lambda x: x[0])  # noqa: E731
    return GenerateResult.of(raw, text=None if text is None else one(text),
                             tokens=one(raw["tokens"]))

  def evaluate(self, text: str | None = None, cache=None, tokens: int = 512, seqs: int = 1,
               chunk: int = 1, progress: bool = False, *, path: str | Path | None = None,
               corpus: str | None = None) -> EvalResult:
    """Quality through the cache against an fp32 cache on the same tokens, as `kvjax eval`:
    `seqs` windows of `tokens` tokens fed `chunk` tokens at a time (1: pure decode), of
    `text` (the text itself), of the file or folder at `path`, or of a named `corpus`
    (`stdlib`, Python's own sources: the default); at most one of the three."""
    from kvjax import evaluate

    kind, value = inputs.eval_source(text, path, corpus)
    inputs.windows(tokens, seqs, chunk)
    if kind == "text":
      text_source, label = value, f"text ({len(value)} characters)"
    else:
      label = f"./{value}" if kind == "path" and value == "stdlib" else value  # a file
      text_source = evaluate.eval_inputs(label, tokens, seqs, chunk)
    evaluate.check_tokens(tokens, self.config.model.max_seq_len)
    raw = evaluate.eval_loaded(self.with_cache(cache), self.params, self.tokenizer,
                               self.source, label, tokens, seqs, chunk, progress, text_source)
    inputs.refuse_non_finite("evaluate", raw)
    for w in raw.get("warnings", ()):
      warnings.warn(w, stacklevel=2)
    return EvalResult.of(raw)

  def size(self, cache=None, seq_len: int = 4096, batch: int = 1,
           budget: str | None = None) -> SizeResult:
    """Closed-form cache bytes at `seq_len` for `batch` sequences, as `kvjax size` (a bf16
    cache when `cache` names no codec); with `budget` ("80GiB", "80GB"), how many
    sequences fit after the weights, per codec."""
    from kvjax import cli
    from kvjax.cli import commands

    argv = ["size", *self.size_flags(), "--seq-len", str(seq_len), "--batch", str(batch)]
    argv += ["--budget", str(budget)] if budget is not None else []
    for key, value in {**self.overrides, **cache_items(cache)}.items():
      value = str(value).lower() if isinstance(value, bool) else value
      argv += ["--set", f"{key}={value}"]
    raw = commands.cmd_size(cli.parse_args(argv))
    for w in raw.get("warnings", ()):
      warnings.warn(w, stacklevel=2)
    b = raw.get("budget") or {}
    return SizeResult.of(raw, max_sequences=b.get("max_sequences"),
                         max_sequences_by_codec=b.get("max_sequences_by_codec"),
                         batch_fits=b.get("batch_fits"))

  def size_flags(self) -> list[str]:
    """The `kvjax size` flags that name this model."""
    kind, ref = self.source.kind, self.source.ref
    if kind in ("gguf", "hf") or (kind == "config" and ref):
      return [f"--{kind}", ref]
    m = self.config.model  # a checkpoint or the default config: its shape
    return ["--layers", str(m.n_layers), "--heads", str(m.n_heads), "--kv-heads",
            str(m.n_kv_heads), "--head-dim", str(m.D)]


def run(config: str | Path, out: str | Path | None = None,
        overrides: dict | list[str] | None = None, shard: str | None = None,
        dry_run: bool = False, quiet: bool = False) -> RunReport:
  """Run an experiment config's grid, as `kvjax run` (rows appended to `out`, default
  results/<name>; finished cells skipped; the summary table printed unless `quiet`);
  `dry_run` lists the cells and runs nothing."""
  from kvjax import runner

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
  from kvjax.runner import results as results_lib
  return results_lib.records(results_lib.load(path, experiment))


def plot(results_dir: str | Path, out: str | Path = "plots", quiet: bool = False) -> list[Path]:
  """Redraw every plot the rows under `results_dir` support, into `out` (PNG and SVG), as
  `kvjax plot RESULTS_DIR --out OUT` does (kvjax.plots); the paths written. What it drew
  and skipped is printed unless `quiet`; no folder or no rows raises `KvjaxError`."""
  from kvjax import plots

  with _quiet(quiet):
    return plots.plot_all(results_dir, out)

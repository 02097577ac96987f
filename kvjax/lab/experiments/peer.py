"""peer: kvjax vs Hugging Face `transformers` (torch) decoding the same weights.

One cell = one model shape x batch. A random Llama checkpoint of the config's shape is
built with transformers, saved as safetensors to a temporary folder and imported into
kvjax with `kvjax.io.hf.load`, so both sides run the very same weights (the import path is
part of what is measured). With `params.gguf: FILE` both sides load that file's real
weights instead (kvjax.io.gguf and transformers' GGUF reader, float32). Peers, timed
interleaved in one process (round-robin repeats, medians; `kvjax.lab.metrics.bench_interleaved`):

  kvjax       compiled prefill + `lax.scan` decode, contiguous cache (`cache.codec`), the
              default program: layers as one scan over per-layer weights, no weight
              copied per step (`model.switched_layers`);
  kvjax_nnscan  the same with `model.layer_loop = scan`: nn.scan over stacked params, the default
              before, which copies every weight matrix out of the stack each step;
  kvjax_unrolled  the same with `model.scan_unroll = n_layers`: a Python layer loop over
              weights split per layer once (compile time grows with depth;
              docs/methods.md, "The layer loop");
  kvjax_bf16w the default program with the weights cast to bfloat16
              (`model.param_dtype`: half the weight bytes a step reads; activations and
              the cache as the others);
  dynamic     `model.generate` with transformers' DynamicCache (its default);
  static      `generate` with a preallocated StaticCache (reset outside the timed region);
  quanto      `generate` with QuantizedCache(backend="quanto", int4, residual 128), when
              optimum-quanto is installed (transformers' KIVI-style quantized cache).

In cells whose `workload.prompt_len` is at least `params.fill_from` (the long-context rows;
0 = never) no prompt is run: every peer starts from a cache that already holds
`workload.prompt_len` tokens per sequence (zeros: speed does not
depend on values; kvjax sets the cache's lengths as `kvjax/lab/experiments/roofline.py` does,
transformers' DynamicCache/StaticCache get zero K/V through their `update`), and each peer
decodes `gen_len - 1` greedy tokens from there. A prefill of 8 x 4k tokens would take
minutes a repeat on a CPU. TTFT is then not measured (NaN), and quanto is left out of such
cells (its cache cannot be filled that way).

TTFT is the prefill plus the first greedy token; TPOT is the rest of the `gen_len` tokens
divided by `gen_len - 1`. For transformers both come from one `generate` call: a
StoppingCriteria records when the first token exists. Compilation (XLA for kvjax) and
first-call costs are excluded by a warm-up repeat. Both frameworks get the same number
of threads (`params.threads`, default all cores this process may use): torch through
`set_num_threads`, XLA by pinning the process to that many cores. Greedy tokens of every
transformers peer are compared with kvjax's (`agreement`), so a speed row is also a
check that the same function was computed.

Before each timed repeat the process measures its memory bandwidth and dot throughputs
(`roofline.Bandwidth`, `roofline.DotProbe`, as the roofline rows do); every row carries
their medians, and each kvjax row both roofs of its step (`roofline.roofs`: bytes or
FLOPs, which binds, the fraction reached). `tpot_vs_kvjax` is the median of per-repeat
ratios to the default kvjax program, with `tpot_vs_kvjax_ci95` (a bootstrap over repeats).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from kvjax import config as config_lib
from kvjax.decode import generate, step
from kvjax.errors import KvjaxError
from kvjax.lab import experiments as ex
from kvjax.lab import intervals, metrics, timers
from kvjax.lab.experiments import _hf_peers as hf_peers
from kvjax.lab.experiments import roofline

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"fill_from", "gguf", "peers", "threads"})

PEERS = ("kvjax", "kvjax_nnscan", "kvjax_unrolled", "kvjax_bf16w", "dynamic", "static",
         "quanto")


def _peers(cfg: config_lib.Config) -> list[str]:
  peers = list(cfg.param("peers", PEERS))
  bad = [p for p in peers if p not in PEERS]
  if bad:
    raise KvjaxError(f"unknown peer '{bad[0]}' in params.peers; known: {', '.join(PEERS)}")
  return [p for p in peers if not (p == "quanto" and _filled(cfg))]  # no way to fill it


def _filled(cfg: config_lib.Config) -> bool:
  """Start from a cache already holding the prompt's length of tokens (no prefill)?"""
  fill_from = cfg.param_int("fill_from", 0)
  return 0 < fill_from <= cfg.workload.prompt_len


def check(cfg: config_lib.Config) -> None:
  w = cfg.workload
  ex.check_context(cfg, w.prompt_len + w.gen_len)
  if w.gen_len < 2 or w.temperature != 0:
    raise KvjaxError("peer compares greedy decoding: set workload.gen_len >= 2, temperature 0")
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    raise KvjaxError("the peer experiment needs torch and transformers: "
                     "pip install -e '.[test]'") from None
  if "quanto" in _peers(cfg):
    try:
      import optimum.quanto  # noqa: F401
    except ImportError:
      raise KvjaxError("peer 'quanto' needs optimum-quanto: pip install optimum-quanto, "
                       "or drop it from params.peers") from None


# -- the shared weights ------------------------------------------------------------------
def _models(cfg: config_lib.Config, folder: str):
  """(transformers model, kvjax config, kvjax params): the real weights of `params.gguf`
  when given, else a random checkpoint of cfg.model's shape (`_hf_peers.build_checkpoint`)."""
  path = cfg.param("gguf", "")
  if not path:
    hf_model = hf_peers.build_checkpoint(cfg, folder)
    return (hf_model, *_kvjax_config(cfg, folder))
  loaded, params, hf_model = hf_peers.gguf_models(str(Path(path).expanduser()))
  return hf_model, _with_model(cfg, loaded.model), params


def _with_model(cfg: config_lib.Config, loaded: config_lib.ModelConfig) -> config_lib.Config:
  """The experiment's config with an imported model's shape (its compute settings kept)."""
  model = dataclasses.replace(loaded, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                              scan_unroll=cfg.model.scan_unroll)
  return config_lib.validate(dataclasses.replace(cfg, model=model))


def _kvjax_config(cfg: config_lib.Config, folder: str) -> tuple[config_lib.Config, dict]:
  """The imported model under the experiment's cache/workload settings."""
  from kvjax.io import hf

  loaded, params = hf.load(folder)
  return _with_model(cfg, loaded.model), params


# -- kvjax timers: one `kvjax.decode.generate.Compiled` each -------------------------------------------
class KvjaxTimer(timers.DecodeTimer):
  """DecodeTimer that also hands back one run's greedy tokens, from the program it already
  compiled (a second `generate.generate` would compile it again)."""

  def greedy_tokens(self) -> np.ndarray:
    return self.compiled.run().tokens()


class KvjaxFilledTimer:
  """Decode of `steps` greedy tokens from a cache already holding `context` tokens per
  sequence (a program of prompt width 0, as roofline.FilledDecode), with the `once()`
  interface: (nan, tpot_s). Its tokens start with the input token 0."""

  def __init__(self, cfg, params, batch: int, context: int, steps: int):
    t0 = time.perf_counter()
    shape = generate.Shape(batch, 0, context + steps + 1, steps, context=context)
    self.compiled = generate.Compiled(cfg, params, shape).compile()
    self.compile_s = time.perf_counter() - t0
    self.steps, self.cache_bytes = steps, None

  def once(self) -> tuple[float, float]:
    return float("nan"), self.compiled.run().decode_s / self.steps

  def greedy_tokens(self) -> np.ndarray:
    return self.compiled.run().tokens()


# -- the cell ----------------------------------------------------------------------------------
def run_cell(cfg: config_lib.Config) -> list[dict]:
  w = cfg.workload
  peers = _peers(cfg)
  tokens, lengths = ex.prompts(cfg, w.batch, w.prompt_len)
  threads = cfg.param_int("threads", 0)
  with tempfile.TemporaryDirectory() as folder, hf_peers.same_threads(threads) as n:
    hf_model, kcfg, params = _models(cfg, folder)
    clocks, cfgs = {}, {}
    filled = _filled(cfg)
    for peer in peers:
      if peer.startswith("kvjax"):
        cfgs[peer] = pcfg = _kvjax_config_of(peer, kcfg)
        clocks[peer] = (KvjaxFilledTimer(pcfg, params, w.batch, w.prompt_len, w.gen_len - 1)
                        if filled else
                        KvjaxTimer(pcfg, params, tokens, lengths, steps=w.gen_len - 1,
                                   capacity=w.prompt_len + w.gen_len))
      elif filled:
        clocks[peer] = hf_peers.HFFilledTimer(hf_model, w.batch, w.prompt_len, w.gen_len - 1,
                                              peer)
      else:
        clocks[peer] = hf_peers.HFTimer(hf_model, tokens, w.gen_len, peer)
    meter, probe, bws, dots = roofline.Bandwidth(512), roofline.DotProbe(), [], []
    results = metrics.bench_interleaved(
        clocks, repeats=w.repeats, samples=True,
        before_repeat=lambda: (bws.append(meter.measure()), dots.append(probe.measure())))
    del meter, probe
    bw = float(np.median(bws))
    rate = {k: float(np.median([d[k] for d in dots])) for k in roofline.DotProbe.TYPES}
    ours = (clocks["kvjax"] if "kvjax" in clocks else
            KvjaxFilledTimer(kcfg, params, w.batch, w.prompt_len, w.gen_len - 1) if filled else
            KvjaxTimer(kcfg, params, tokens, lengths, steps=w.gen_len - 1)).greedy_tokens()
    theirs = {p: (t.greedy_tokens() if p.startswith("kvjax") else t.tokens)
              for p, t in clocks.items() if p != "kvjax"}
    torch_threads = hf_peers.hf_model_threads()

  base = results.get("kvjax", {}).get("tpot_s_samples")
  rows = []
  for peer in peers:
    m = dict(results[peer])
    m["tokens_per_s"] = w.batch / m["tpot_s"]
    m.update(bandwidth_Bps=bw, dot_Fps=rate)
    if peer in cfgs:
      m.update(roofline.roofs(cfgs[peer], params, w.batch, w.prompt_len, w.gen_len - 1,
                              m["tpot_s"], bw, rate))
    if base:
      m["tpot_vs_kvjax"], m["tpot_vs_kvjax_ci95"] = intervals.paired_ratio(
          m["tpot_s_samples"], base)
      m["ttft_vs_kvjax"] = m["ttft_s"] / results["kvjax"]["ttft_s"]  # NaN when filled
    if peer != "kvjax":
      m["agreement"] = float(np.mean(theirs[peer] == ours))
      m["first_mismatch"] = _first_mismatch(theirs[peer], ours)
    rows.append({
        "variant": ex.variant(cfgs.get(peer, kcfg), peer=peer, cache_kind=_cache_kind(peer, kcfg),
                              **_impl(cfgs.get(peer))),
        "workload": {"batch": w.batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                     "context": w.prompt_len + w.gen_len, "threads": n, "filled": filled,
                     "torch_threads": torch_threads,
                     "params_m": hf_peers.param_count(hf_model) / 1e6},
        "metrics": m,
    })
  return rows


def _kvjax_config_of(peer: str, cfg: config_lib.Config) -> config_lib.Config:
  """The config a kvjax peer runs: the default's, nn.scan over stacked params, unrolled, or
  with bf16 weights (the step casts the shared params to `model.param_dtype`,
  `step.prepare_params`)."""
  if peer == "kvjax_nnscan":
    return config_lib.replace(cfg, **{"model.layer_loop": "scan"})
  if peer == "kvjax_unrolled":
    return config_lib.replace(cfg, **{"model.scan_unroll": cfg.model.n_layers})
  if peer == "kvjax_bf16w":
    return config_lib.replace(cfg, **{"model.param_dtype": "bfloat16"})
  return cfg


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
  """Index of the first generated token where any sequence differs (gen_len if none)."""
  diff = np.nonzero((a != b).any(axis=0))[0]
  return int(diff[0]) if diff.size else int(a.shape[1])


def _impl(kvjax_cfg: config_lib.Config | None) -> dict:
  """Which framework ran a row, and for kvjax how its layers ran (`step.layer_loop`): the
  switched scan (the default), nn.scan over stacked params, or unrolled."""
  if kvjax_cfg is None:
    return {"impl": "transformers"}
  loop = step.layer_loop(kvjax_cfg.model)
  return {"impl": "kvjax", "layers": {"scan": "nn.scan", "switch": "switched"}.get(loop, loop)}


def _cache_kind(peer: str, cfg: config_lib.Config) -> str:
  if peer.startswith("kvjax"):
    return f"contiguous-{cfg.cache.k_codec}"
  return {"dynamic": "DynamicCache-fp32", "static": "StaticCache-fp32",
          "quanto": "QuantizedCache-quanto-int4"}[peer]


def summary(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    out.append({"peer": v["peer"], "variant": v["variant"], "vocab": r.get("config", {}).get(
        "model", {}).get("vocab_size"), "batch": w["batch"], "threads": w["threads"],
        "ttft_s": m["ttft_s"], "tpot_s": m["tpot_s"], "tpot_iqr_s": m["tpot_s_iqr"],
        "tokens_per_s": m["tokens_per_s"], "tpot_vs_kvjax": m.get("tpot_vs_kvjax"),
        "vs_kvjax_ci95": "[{:.2f}, {:.2f}]".format(*m["tpot_vs_kvjax_ci95"])
        if m.get("tpot_vs_kvjax_ci95") else "", "bound": m.get("bound", ""),
        "roof_fraction": m.get("roof_fraction"), "agreement": m.get("agreement")})
  return out

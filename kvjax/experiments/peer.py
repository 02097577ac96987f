"""peer: kvjax vs Hugging Face `transformers` (torch) decoding the same weights.

One cell = one model shape x batch. A random Llama checkpoint of the config's shape is
built with transformers, saved as safetensors to a temporary folder and imported into
kvjax with `kvjax.io.hf.load`, so both sides run the very same weights (the import path is
part of what is measured). With `params.gguf: FILE` both sides load that file's real
weights instead (kvjax.io.gguf and transformers' GGUF reader, float32). Peers, timed
interleaved in one process (round-robin repeats, medians; `kvjax.metrics.bench_interleaved`):

  kvjax       compiled prefill + `lax.scan` decode, contiguous cache (`cache.codec`), the
              default program: layers as one scan over per-layer weights, no weight
              copied per step (`model.switched_layers`);
  kvjax_nnscan  the same on stacked params: the nn.scan program that was the default
              before, which copies every weight matrix out of the stack each step;
  kvjax_unrolled  the same with `model.scan_unroll = n_layers`: a Python layer loop over
              weights split per layer once (compile time grows with depth;
              docs/architecture.md);
  dynamic     `model.generate` with transformers' DynamicCache (its default);
  static      `generate` with a preallocated StaticCache (reset outside the timed region);
  quanto      `generate` with QuantizedCache(backend="quanto", int4, residual 128), when
              optimum-quanto is installed (transformers' KIVI-style quantized cache).

In cells whose `workload.prompt_len` is at least `params.fill_from` (the long-context rows;
0 = never) no prompt is run: every peer starts from a cache that already holds
`workload.prompt_len` tokens per sequence (zeros: speed does not
depend on values; kvjax sets the cache's lengths as `kvjax/experiments/roofline.py` does,
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
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import experiments as ex
from kvjax import config as config_lib
from kvjax import metrics
from kvjax import model as model_lib
from kvjax.errors import KvjaxError

PEERS = ("kvjax", "kvjax_nnscan", "kvjax_unrolled", "dynamic", "static", "quanto")


def _peers(cfg: config_lib.Config) -> list[str]:
  peers = list(cfg.param("peers", PEERS))
  bad = [p for p in peers if p not in PEERS]
  if bad:
    raise KvjaxError(f"unknown peer '{bad[0]}' in params.peers; known: {', '.join(PEERS)}")
  return [p for p in peers if not (p == "quanto" and _filled(cfg))]  # no way to fill it


def _filled(cfg: config_lib.Config) -> bool:
  """Start from a cache already holding the prompt's length of tokens (no prefill)?"""
  fill_from = int(cfg.param("fill_from", 0))
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


# -- the shared checkpoint ------------------------------------------------------------------
def build_checkpoint(cfg: config_lib.Config, folder: str):
  """A random Llama of cfg.model's shape, saved as safetensors; returns the torch model.

  Weights are normal(0, 1.6 / sqrt(d_model)) rather than HF's 0.02 so that logits are
  spread out and greedy decoding does not sit on near-ties (agreement is then meaningful).
  """
  import torch
  import transformers

  m = cfg.model
  hf_cfg = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.F,
      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
      num_key_value_heads=m.n_kv_heads, head_dim=m.D, rms_norm_eps=m.norm_eps,
      max_position_embeddings=m.max_seq_len, tie_word_embeddings=m.tie_embeddings,
      rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  torch.manual_seed(cfg.seed)
  model = transformers.LlamaForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim > 1:
        p.normal_(0.0, 1.6 / m.d_model ** 0.5)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  model.save_pretrained(folder)
  return model


@functools.lru_cache(maxsize=1)
def _gguf_models(path: str):
  """A GGUF file's weights on both sides, loaded once per process (cells share them):
  kvjax through `kvjax.io.gguf.load`, transformers through its own GGUF reader
  (`from_pretrained(gguf_file=)`), each dequantizing to float32."""
  import transformers

  from kvjax.io import gguf

  loaded, params = gguf.load(path)
  p = Path(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name)
  model.eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return loaded, params, model


def _models(cfg: config_lib.Config, folder: str):
  """(transformers model, kvjax config, kvjax params): the real weights of `params.gguf`
  when given, else a random checkpoint of cfg.model's shape (`build_checkpoint`)."""
  path = cfg.param("gguf", "")
  if not path:
    hf_model = build_checkpoint(cfg, folder)
    return (hf_model, *_kvjax_config(cfg, folder))
  loaded, params, hf_model = _gguf_models(str(Path(path).expanduser()))
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


# -- timers ---------------------------------------------------------------------------------
class KvjaxTimer(metrics.DecodeTimer):
  """DecodeTimer that also hands back one run's greedy tokens, from the programs it
  already compiled (a second `decode.generate` would compile them again)."""

  def greedy_tokens(self) -> np.ndarray:
    params, tokens_BT, lengths_B = self._args
    tok, _, c = self._pre(params, tokens_BT, lengths_B, self._fresh(), self._key)
    rest, _ = self._dec(params, c, tok, self._key)
    return np.concatenate([np.asarray(tok)[:, None], np.asarray(rest)], axis=1)


# -- transformers timers ----------------------------------------------------------------------
class HFTimer:
  """`model.generate` for one cache implementation, with the same `once()` interface as
  `kvjax.metrics.DecodeTimer`: returns (ttft_s, tpot_s)."""

  def __init__(self, model, tokens_BT: np.ndarray, gen_len: int, kind: str):
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    self.model, self.kind, self.gen_len = model, kind, gen_len
    self.steps = gen_len - 1
    self.ids = torch.tensor(tokens_BT, dtype=torch.long)
    self.mask = torch.ones_like(self.ids)
    timer = self

    class FirstToken(StoppingCriteria):
      def __call__(self, input_ids, scores, **kwargs):
        if timer._t_first is None:
          timer._t_first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    self._stop = StoppingCriteriaList([FirstToken()])
    self._t_first = None
    self._static = None
    self.cache_bytes = None
    self.tokens = None
    t0 = time.perf_counter()
    self.once()  # first call: lazy initialisation (and the static cache's allocation)
    self.compile_s = time.perf_counter() - t0

  def _kwargs(self) -> dict:
    if self.kind == "dynamic":
      return {"cache_implementation": "dynamic"}
    if self.kind == "static":
      from transformers import StaticCache
      if self._static is None:
        self._static = StaticCache(config=self.model.config,
                                   max_cache_len=self.ids.shape[1] + self.gen_len)
      else:
        self._static.reset()
      return {"cache": self._static}
    return {"cache_implementation": "quantized",
            "cache_config": {"backend": "quanto", "nbits": 4, "q_group_size": 32,
                             "residual_length": 128}}

  def once(self) -> tuple[float, float]:
    import torch

    with torch.inference_mode():
      kwargs = self._kwargs()  # outside the timed region (static: reset of the cache)
      self._t_first = None
      t0 = time.perf_counter()
      out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=self.gen_len,
                                min_new_tokens=self.gen_len, do_sample=False,
                                stopping_criteria=self._stop, return_dict_in_generate=True,
                                **kwargs)
      t2 = time.perf_counter()
    self.tokens = out.sequences[:, self.ids.shape[1]:].numpy()
    self.cache_bytes = _torch_cache_bytes(out.cache)
    return self._t_first - t0, (t2 - self._t_first) / self.steps


def _torch_cache_bytes(cache) -> int | None:
  """Bytes of the plain tensors a transformers cache holds (None for quantized layers)."""
  total = 0
  for layer in getattr(cache, "layers", []):
    if hasattr(layer, "_quantized_keys"):
      return None
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
      if t is not None and hasattr(t, "element_size"):
        total += t.numel() * t.element_size()
  return total or None


class KvjaxFilledTimer:
  """Decode of `steps` greedy tokens from a cache already holding `context` tokens per
  sequence (roofline.FilledDecode), with the `once()` interface: (nan, tpot_s)."""

  def __init__(self, cfg, params, batch: int, context: int, steps: int, prepare: bool = True):
    from kvjax.experiments import roofline

    t0 = time.perf_counter()
    self._dec = roofline.FilledDecode(cfg, params, batch, context, steps, context + steps + 1,
                                      prepare=prepare)
    self.compile_s = time.perf_counter() - t0
    self.cache_bytes = None

  def once(self) -> tuple[float, float]:
    return float("nan"), self._dec.once()

  def greedy_tokens(self) -> np.ndarray:
    d = self._dec
    toks, _ = d._dec(d.params, d._fresh(), d._tok, d._key)
    return np.concatenate([np.zeros((d.B, 1), np.int32), np.asarray(toks)], axis=1)


class HFFilledTimer:
  """transformers' decode loop (`model(...)` with `past_key_values`, greedy, one token a
  step, as `generate` runs it) from a DynamicCache or StaticCache already holding `context`
  zero tokens per sequence: (nan, tpot_s). The first input token is 0, as kvjax's."""

  def __init__(self, model, batch: int, context: int, steps: int, kind: str):
    import torch
    from transformers import DynamicCache, StaticCache

    self.model, self.B, self.context, self.steps, self.kind = model, batch, context, steps, kind
    c = model.config
    self._kv = torch.zeros(batch, c.num_key_value_heads, context, c.head_dim)
    if kind == "dynamic":
      self.cache = DynamicCache(config=c)
    else:
      self.cache = StaticCache(config=c, max_cache_len=context + steps + 1)
    self._fill()
    self.cache_bytes = None
    self.tokens = None
    t0 = time.perf_counter()
    self.once()
    self.compile_s = time.perf_counter() - t0

  def _fill(self):
    for layer in range(self.model.config.num_hidden_layers):
      self.cache.update(self._kv, self._kv, layer)

  def once(self) -> tuple[float, float]:
    import torch

    # Back to the filled context, outside the timed region.
    extra = self.cache.get_seq_length() - self.context
    if self.kind == "dynamic" and extra > 0:
      self.cache.crop(-extra)
    elif extra > 0:
      self.cache.reset()
      self._fill()
    tok = torch.zeros(self.B, 1, dtype=torch.long)
    out = [tok]
    with torch.inference_mode():
      t0 = time.perf_counter()
      for i in range(self.steps):
        pos = torch.tensor([self.context + i])
        logits = self.model(tok, past_key_values=self.cache, cache_position=pos,
                            use_cache=True).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
      t1 = time.perf_counter()
    self.tokens = torch.cat(out, 1).numpy()
    return float("nan"), (t1 - t0) / self.steps


# -- threads ---------------------------------------------------------------------------------
@contextmanager
def same_threads(n: int):
  """Give torch and XLA the same `n` cores: torch by thread count, XLA (whose pool is
  sized at start-up) by pinning the process to n cores. 0 = all cores we may use."""
  import torch

  old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
  cores = sorted(old_aff)
  n = min(n or len(cores), len(cores))
  os.sched_setaffinity(0, cores[:n])
  torch.set_num_threads(n)
  try:
    yield n
  finally:
    os.sched_setaffinity(0, old_aff)
    torch.set_num_threads(old_threads)


# -- the cell ----------------------------------------------------------------------------------
def run_cell(cfg: config_lib.Config) -> list[dict]:
  w = cfg.workload
  peers = _peers(cfg)
  tokens, lengths = ex.prompts(cfg, w.batch, w.prompt_len)
  with tempfile.TemporaryDirectory() as folder, same_threads(int(cfg.param("threads", 0))) as n:
    hf_model, kcfg, params = _models(cfg, folder)
    timers, cfgs = {}, {}
    filled = _filled(cfg)
    for peer in peers:
      if peer.startswith("kvjax"):
        pcfg = kcfg if peer != "kvjax_unrolled" else config_lib.replace(
            kcfg, **{"model.scan_unroll": kcfg.model.n_layers})
        cfgs[peer] = pcfg
        prepare = peer != "kvjax_nnscan"  # stacked params run the nn.scan program
        timers[peer] = (KvjaxFilledTimer(pcfg, params, w.batch, w.prompt_len, w.gen_len - 1,
                                         prepare=prepare)
                        if filled else
                        KvjaxTimer(pcfg, params, tokens, lengths, steps=w.gen_len - 1,
                                   capacity=w.prompt_len + w.gen_len, prepare=prepare))
      elif filled:
        timers[peer] = HFFilledTimer(hf_model, w.batch, w.prompt_len, w.gen_len - 1, peer)
      else:
        timers[peer] = HFTimer(hf_model, tokens, w.gen_len, peer)
    results = metrics.bench_interleaved(timers, repeats=w.repeats)
    ours = (timers["kvjax"] if "kvjax" in timers else
            KvjaxFilledTimer(kcfg, params, w.batch, w.prompt_len, w.gen_len - 1) if filled else
            KvjaxTimer(kcfg, params, tokens, lengths, steps=w.gen_len - 1)).greedy_tokens()
    theirs = {p: (t.greedy_tokens() if p.startswith("kvjax") else t.tokens)
              for p, t in timers.items() if p != "kvjax"}
    torch_threads = hf_model_threads()

  base = results.get("kvjax", {}).get("tpot_s")
  rows = []
  for peer in peers:
    m = dict(results[peer])
    m["tokens_per_s"] = w.batch / m["tpot_s"]
    if base:
      m["tpot_vs_kvjax"] = m["tpot_s"] / base
      m["ttft_vs_kvjax"] = m["ttft_s"] / results["kvjax"]["ttft_s"]  # NaN when filled
    if peer != "kvjax":
      m["agreement"] = float(np.mean(theirs[peer] == ours))
      m["first_mismatch"] = _first_mismatch(theirs[peer], ours)
    rows.append({
        "variant": ex.variant(cfgs.get(peer, kcfg), peer=peer, cache_kind=_cache_kind(peer, kcfg),
                              **_impl(cfgs.get(peer), peer == "kvjax_nnscan")),
        "workload": {"batch": w.batch, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                     "context": w.prompt_len + w.gen_len, "threads": n, "filled": filled,
                     "torch_threads": torch_threads, "params_m": _param_count(hf_model) / 1e6},
        "metrics": m,
    })
  return rows


def hf_model_threads() -> int:
  import torch
  return torch.get_num_threads()


def _param_count(model) -> int:
  return sum(p.numel() for p in model.parameters())


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int:
  """Index of the first generated token where any sequence differs (gen_len if none)."""
  diff = np.nonzero((a != b).any(axis=0))[0]
  return int(diff[0]) if diff.size else int(a.shape[1])


def _impl(kvjax_cfg: config_lib.Config | None, nnscan: bool = False) -> dict:
  """Which framework ran a row, and for kvjax how its layers ran: the switched scan (the
  default), nn.scan over stacked params, or unrolled."""
  if kvjax_cfg is None:
    return {"impl": "transformers"}
  if model_lib.unrolled(kvjax_cfg.model):
    return {"impl": "kvjax", "layers": "unrolled"}
  return {"impl": "kvjax", "layers": "nn.scan" if nnscan else "switched"}


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
        "agreement": m.get("agreement")})
  return out

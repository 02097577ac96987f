"""position: how a cache setting's error grows with the distance between a query and the
keys it reads, on one long document per text, up to each model's context.

A cell is one text on every model of `params.models`, through every cache of
`params.caches` (name -> cache overrides; without it, the cell's own cache, named by its
`params.setting`). A cache whose policy evicts (snapkv, h2o, tova, knorm, window, sinks at
a ratio or budget) is read by bucket: the prefix before a bucket is prefilled once in one
call (shared by every policy), compacted by the policy, and the bucket's tokens are
streamed through what it kept (window and sinks rings keep evicting as they go); its rows
say `protocol: compacted at the bucket's start`, and its first bucket has no prefix to
compact (the codec alone). The first `params.tokens` tokens of the named text (`params.text`:
`shakespeare` prose, `stdlib` code; its validation documents joined) are streamed
`params.chunk` tokens a call through each cache and, side by side, segment by segment,
through the same model's fp32 cache, which every cache of the cell shares; each segment's
per-position NLL, KL and argmax agreement are kept (never a [M, V]
reference: at 32k tokens one would be tens of gigabytes), and the positions are cut into
the buckets `params.buckets` (token boundaries; default 0, 1k, 4k, 8k, 16k, 32k). A row per
bucket: Δppl, KL and agreement over the predictions made at those positions, each with its
95 % interval (`kvjax.lab.intervals`, a paired bootstrap over 32-token blocks of the one
document: it covers the tokens' noise, not another document's).

A model whose context (`model.max_seq_len`) is shorter than `params.tokens` reads as many
tokens as its context holds; buckets past them are left out. A cell of N caches costs N + 1
long prefills (the reference streamed once beside them all); one cell per cache costs 2N.
Every `lockstep.PIECE` tokens the streams' caches and terms are saved in the runner's
scratch folder for the cell: a run killed mid-document resumes from the last piece saved.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvjax import config as config_lib
from kvjax import memory, policies
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.lab import data, evaluate, intervals, lockstep
from kvjax.lab import experiments as ex
from kvjax.lab.experiments import quality

PARAMS = frozenset({"buckets", "caches", "chunk", "models", "text", "tokens"})
BUCKETS = (0, 1024, 4096, 8192, 16384, 32768)


def buckets(cfg) -> tuple[int, ...]:
  """`params.buckets`: increasing token boundaries from 0."""
  raw = cfg.param("buckets", BUCKETS)
  b = tuple(raw) if isinstance(raw, (list, tuple)) else (raw,)
  if len(b) < 2 or any(not isinstance(x, int) or isinstance(x, bool) for x in b) or b[0] != 0 \
      or any(y <= x for x, y in zip(b, b[1:])):
    raise KvjaxError(f"params.buckets must be increasing token counts from 0 (e.g. "
                     f"{list(BUCKETS)}), got {list(b) if isinstance(raw, (list, tuple)) else raw!r}")
  return b


def check(cfg) -> None:
  """Host-side, before any weight is read: the numbers, the buckets, the models, the text."""
  ex.check_int_params(cfg, {"tokens": (32768, 2), "chunk": (512, 1)})
  buckets(cfg)
  data.eval_text(str(cfg.param("text", "shakespeare")), what="params.text")
  chunk = cfg.param_int("chunk", 512)
  for name, over in _caches(cfg).items():
    c = config_lib.apply_overrides(cfg, over)  # a bad key or value: one line, before weights
    if not policies.evicts(c.cache):
      continue
    if any(b % chunk for b in buckets(cfg)):
      raise KvjaxError(f"params.caches.{name} evicts ({c.cache.policy}): it is compacted at "
                       f"each bucket's start, so every params.buckets edge must be a multiple "
                       f"of params.chunk={chunk}")
    # each prefix it compacts holds enough to keep its window
    policies.check_lengths(c.cache, [b for b in buckets(cfg)[1:]
                                     if b < cfg.param_int("tokens", 32768)])
  quality.check(cfg)  # every model exists


def _caches(cfg) -> dict[str, dict]:
  """name -> cache overrides: `params.caches`, or the cell's own cache under its setting."""
  if cfg.param("caches", None) is None:
    return {str(cfg.param("setting", "")): {}}
  return ex.caches(cfg, "{int8: {cache.codec: int8}, int4: {cache.codec: int4}}")


def share_key(cfg) -> str:
  """Cells on one text share its tokenization (and the model's weights)."""
  return str(cfg.param("text", "shakespeare"))


def _ids(tok, text: str, M: int) -> np.ndarray:
  """The text's first M tokens [1, M]."""
  return evaluate.text_windows(tok, data.eval_text(text, what="params.text"), M, 1,
                               ("params.tokens", "params.seqs", "params.text"))


def estimate(cfgs) -> str | None:
  """The hours the cells `cfgs` will take here: per cell and model, one stream of the
  model's context per cache and one for the fp32 reference, each a prefill's arithmetic
  (`ruler.prefill_flops`), and where a cache evicts, the one-call prefill of each bucket's
  prefix, all at half the probed f32 matmul rate."""
  from kvjax.lab.experiments import roofline, ruler

  if not cfgs:
    return None
  flops_s = roofline.DotProbe().measure()["f32"] * 0.5
  total = 0.0
  for cfg in cfgs:
    for src in quality.models(cfg):
      m = quality.load_model(src)[0].model
      n = min(cfg.param_int("tokens", 32768), m.max_seq_len)
      total += (1 + len(_caches(cfg))) * ruler.prefill_flops(m, n) / flops_s
      if any(policies.evicts(config_lib.apply_overrides(cfg, over).cache)
             for over in _caches(cfg).values()):
        total += sum(ruler.prefill_flops(m, lo) for lo in _edges(cfg, n)[1:-1]) / flops_s
  return (f"about {total / 3600:.1f} hours on this machine for {len(cfgs)} cells (a rough "
          "estimate from a matmul probe: within 2x)")


def run_cell(cfg, scratch=None) -> list[dict]:
  """The cell's rows; with `scratch` (the runner's folder for this cell), the streams' state
  is saved every `lockstep.PIECE` tokens, and a killed cell resumes from it."""
  from tqdm import tqdm

  rows = []
  chunk, want = cfg.param_int("chunk", 512), cfg.param_int("tokens", 32768)
  text = str(cfg.param("text", "shakespeare"))
  for src in quality.models(cfg):
    mcfg, params, tok = quality.load_model(src)
    if tok is None:
      raise KvjaxError(f"{src} has no tokenizer to read params.text with")
    M = min(want, mcfg.model.max_seq_len)
    params = step.prepare_params(mcfg, params)  # the one copy every stream reads
    base = quality.cell_config(cfg, mcfg)
    tcfgs = {name: config_lib.validate(config_lib.apply_overrides(base, over))
             for name, over in _caches(cfg).items()}
    ref_cfg = evaluate.reference_config(base)
    parts = {  # each cache twice: a step's input and output
        "caches": 2 * sum(memory.cache_bytes(c, 1, M) for c in (ref_cfg, *tcfgs.values())),
        "temporaries": memory.temp_bytes(ref_cfg, 1, chunk, M)}
    lo = _edges(cfg, M)[-2]  # the last bucket's start: the longest prefix compacted
    if lo and any(policies.evicts(c.cache) for c in tcfgs.values()):
      m = ref_cfg.model  # the longest prefix prefilled in one call, its queries kept
      parts["the longest prefix's prefill"] = (
          memory.temp_bytes(ref_cfg, 1, lo, lo) + memory.cache_bytes(ref_cfg, 1, lo)
          + 4 * m.n_layers * lo * m.n_heads * m.head_dim)
    memory.check_parts(parts, "this cell")
    tokens = _ids(tok, text, M)
    with tqdm(total=(1 + len(tcfgs)) * M, desc=f"position {src.name}", unit="tok",
              leave=False) as bar:
      store = lockstep.Store(Path(scratch) / src.name) if scratch else None
      got = lockstep.terms(tcfgs, ref_cfg, params, tokens, chunk, bar, edges=_edges(cfg, M),
                           store=store)
    for name, tcfg in tcfgs.items():
      c = tcfg.cache
      evicting = dict(policy=c.policy, ratio=c.ratio, budget=c.budget, window=c.window,
                      sinks=c.sinks) if policies.evicts(c) else {}
      var = ex.variant(tcfg, setting=name, model=src.name, **evicting)
      rows += _rows(cfg, tcfg, var, got[name], M, text, chunk)
  return rows


def _edges(cfg, M: int) -> list[int]:
  """The bucket boundaries up to M tokens."""
  return [b for b in buckets(cfg) if b < M] + [M]


def _rows(cfg, tcfg, var: dict, got: tuple, M: int, text: str, chunk: int) -> list[dict]:
  """A row per position bucket of one cache's per-position terms."""
  nll, nll_ref, kl, agree = got
  rows = []
  evicts = policies.evicts(tcfg.cache)
  edges = _edges(cfg, M)
  for lo, hi in zip(edges, edges[1:]):
    # prediction at position t (reading t + 1 tokens) scores token t + 1
    sl = slice(lo, min(hi, nll.shape[1]))
    metrics = evaluate.metrics_of(nll[:, sl], nll_ref[:, sl], kl[:, sl], agree[:, sl])
    rough = intervals.few_blocks(sl.stop - sl.start)
    if rough:
      print(f"kvjax: warning: positions {lo}-{hi} of {var['model']} ({var['setting']}): "
            f"{rough}", file=sys.stderr)
    rows.append({"variant": var,
                 "workload": {"task": "text_by_position", "data": text, "context": M,
                              "chunk": chunk, "bucket": [lo, hi], "batch": 1,
                              "reference": "fp32 cache",
                              "protocol": "compacted at the bucket's start" if evicts
                              else "streamed"},
                 "metrics": {**metrics, "positions": sl.stop - sl.start}})
  return rows


def summary(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    v, w, m = r["variant"], r["workload"], r["metrics"]
    out.append({"model": v.get("model"), "setting": v.get("setting"), "text": w["data"],
                "positions": f"{w['bucket'][0]}-{w['bucket'][1]}",
                "dppl_%": 100 * m["dppl_rel"],
                "dppl_%_ci95": intervals.text(m.get("dppl_rel_ci95"), "{:+.3f}", 100),
                "kl": m["kl"], "kl_ci95": intervals.text(m.get("kl_ci95")),
                "agreement": m["agreement"]})
  return out

"""position: how a cache setting's error grows with the distance between a query and the
keys it reads, on one long document per text, up to each model's context.

A cell is one cache setting (`params.setting`) on every model of `params.models`. The first
`params.tokens` tokens of the named text (`params.text`: `shakespeare` prose, `stdlib` code;
its validation documents joined) are streamed `params.chunk` tokens a call through the
setting's cache and, side by side, segment by segment, through the same model's fp32
cache; each segment's per-position NLL, KL and argmax agreement are kept (never a [M, V]
reference: at 32k tokens one would be tens of gigabytes), and the positions are cut into
the buckets `params.buckets` (token boundaries; default 0, 1k, 4k, 8k, 16k, 32k). A row per
bucket: Δppl, KL and agreement over the predictions made at those positions, each with its
95 % interval (`kvjax.lab.intervals`, a paired bootstrap over 32-token blocks of the one
document: it covers the tokens' noise, not another document's).

A model whose context (`model.max_seq_len`) is shorter than `params.tokens` reads as many
tokens as its context holds; buckets past them are left out. Each cell streams the
reference again (twice a setting's arithmetic), so a cell's time is two long prefills'.
"""

from __future__ import annotations

import sys

import numpy as np

from kvjax import memory
from kvjax.errors import KvjaxError
from kvjax.lab import data, evaluate, intervals
from kvjax.lab import experiments as ex
from kvjax.lab.experiments import quality

PARAMS = frozenset({"buckets", "chunk", "models", "text", "tokens"})
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
  quality.check(cfg)  # every model exists


def share_key(cfg) -> str:
  """Cells on one text share its tokenization (and the model's weights)."""
  return str(cfg.param("text", "shakespeare"))


def _ids(tok, text: str, M: int) -> np.ndarray:
  """The text's first M tokens [1, M]."""
  return evaluate.text_windows(tok, data.eval_text(text, what="params.text"), M, 1,
                               ("params.tokens", "params.seqs", "params.text"))


def terms(tcfg, ref_cfg, params, tokens_BM, chunk: int, progress=None) -> tuple:
  """Per-position (NLL, NLL of the reference, KL, argmax agreement) [B, M - 1] of `tcfg`'s
  cache against `ref_cfg`'s, both streamed segment by segment in lockstep."""
  parts = []
  streams = zip(evaluate.stream_segments(ref_cfg, params, tokens_BM, chunk, progress=progress),
                evaluate.stream_segments(tcfg, params, tokens_BM, chunk, progress=progress))
  tokens_BM = np.asarray(tokens_BM)
  for (start, ref_lp), (_, lp) in streams:
    if start is None:
      break
    m = lp.shape[1]
    nxt = tokens_BM[:, start + 1:start + m + 1]
    parts.append(evaluate.token_terms(lp, ref_lp, nxt))
  nll, nll_ref, kl, agree = (np.concatenate(x, axis=1) for x in zip(*parts))
  n = nll.shape[1]  # the last position has no target
  return nll, nll_ref, kl[:, :n], agree[:, :n]


def estimate(cfgs) -> str | None:
  """The hours the cells `cfgs` will take here: per cell and model, two streams of the
  model's context (the setting's and the fp32 reference's), each a prefill's arithmetic
  (`ruler.prefill_flops`) at half the probed f32 matmul rate."""
  from kvjax.lab.experiments import roofline, ruler

  if not cfgs:
    return None
  flops_s = roofline.DotProbe().measure()["f32"] * 0.5
  total = 0.0
  for cfg in cfgs:
    for src in quality.models(cfg):
      m = quality.load_model(src)[0].model
      total += 2 * ruler.prefill_flops(m, min(cfg.param_int("tokens", 32768), m.max_seq_len)) \
          / flops_s
  return (f"about {total / 3600:.1f} hours on this machine for {len(cfgs)} cells (a rough "
          "estimate from a matmul probe: within 2x)")


def run_cell(cfg) -> list[dict]:
  from tqdm import tqdm

  rows = []
  chunk, want = cfg.param_int("chunk", 512), cfg.param_int("tokens", 32768)
  text = str(cfg.param("text", "shakespeare"))
  for src in quality.models(cfg):
    mcfg, params, tok = quality.load_model(src)
    if tok is None:
      raise KvjaxError(f"{src} has no tokenizer to read params.text with")
    M = min(want, mcfg.model.max_seq_len)
    tcfg = quality.cell_config(cfg, mcfg)
    ref_cfg = evaluate.reference_config(tcfg)
    for c in (tcfg, ref_cfg):
      memory.check(c, 1, M, chunk, what="this cell")
    tokens = _ids(tok, text, M)
    with tqdm(total=2 * M, desc=f"position {src.name}", unit="tok", leave=False) as bar:
      nll, nll_ref, kl, agree = terms(tcfg, ref_cfg, params, tokens, chunk, bar)
    var = ex.variant(tcfg, setting=cfg.param("setting", ""), model=src.name)
    edges = [b for b in buckets(cfg) if b < M] + [M]
    for lo, hi in zip(edges, edges[1:]):
      # prediction at position t (reading t + 1 tokens) scores token t + 1
      sl = slice(lo, min(hi, nll.shape[1]))
      metrics = evaluate.metrics_of(nll[:, sl], nll_ref[:, sl], kl[:, sl], agree[:, sl])
      rough = intervals.few_blocks(sl.stop - sl.start)
      if rough:
        print(f"kvjax: warning: positions {lo}-{hi} of {src.name}: {rough}", file=sys.stderr)
      rows.append({"variant": var,
                   "workload": {"task": "text_by_position", "data": text, "context": M,
                                "chunk": chunk, "bucket": [lo, hi], "batch": 1,
                                "reference": "fp32 cache", "protocol": "streamed"},
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

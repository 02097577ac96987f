"""ruler: the RULER-style suite (kvjax.lab.tasks.ruler) at long contexts, every cache
setting on the same prompts, eviction question-blind and question-aware.

A cell is one context length (`params.context`), one task (`params.task`: a name of
`kvjax.lab.tasks.ruler.TASKS`) and one prompt (`params.sample`, an index: the example's
seed), for every model of `params.models`. The prompt's context is prefilled ONCE, in one
call of `params.context` tokens through an fp32 cache with its queries kept
(`tasks.prefill_queries`), and that one prefill serves every cache of `params.caches`
(name -> cache overrides), every question of the prompt and both protocols:

  a cache without eviction (a codec, a rotation):
      the context's fp32 K/V stored through the codec, then the question fed as its own
      call and the answer decoded greedily, every token reading the context through the
      codec (protocol `blind`: the cache was built without the question; there is
      nothing to choose, so the aware protocol is the same and is not run again);
  an evicting cache (`cache.policy`), per protocol of `params.protocols`:
      `blind`  the context compacted to the budget (a `cache.ratio` of the context) before
               the question, which then reads the compacted cache (kvpress's default);
      `aware`  the question fed through the context's fp32 cache with its queries kept,
               the policy scoring [context; question] with them (snapkv's window is the
               question's last tokens) and compacting the whole prompt to its budget (a
               ratio of context + question); the first answer token comes from the
               uncompacted prompt's logits, the rest read the compacted cache (SnapKV's
               and kvpress's question-aware protocol: compression after the prefill).
               A policy that scores without queries (window, sinks, knorm) has no aware
               form: asked for one, the run stops before any prefill.

A row per (question, cache, protocol): `score` (the share of the question's expected
strings in the answer, `ruler.score`), the answer, the expected strings, the task and its
family, the fact's depth and token, and the bytes the cache holds per prompt token
(`kvjax.footprint`, with the policy's kept tokens and state; `held_tokens`, `kept` on
evicting rows). The summary scores each (model, context, family or task, cache, protocol)
with the Wilson 95 % interval over questions (`kvjax.lab.intervals.shares`), and marks a
(model, context, task) whose fp32 cache scores below `CALIBRATED` "beyond the model"; a
family is scored over the tasks the model answers (`calibration.family_rows`).

`params.text` names the prose a prose haystack is cut from (default `shakespeare`);
`params.template` how each model is prompted (plain, base, chatml, gemma, or `model`: its
own chat template); `params.tail_pad` the tokens a question is padded to (one program per
cache serves every question). Before a run starts, `estimate` prints the hours the cells
left will take on this machine (a matmul and a bandwidth probe, the prefill's and decode's
arithmetic and bytes).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvjax import config as config_lib
from kvjax import footprint, memory, policies
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.lab import data, evaluate, intervals, tasks
from kvjax.lab import experiments as ex
from kvjax.lab.experiments import long_context
from kvjax.lab.tasks import calibration, ruler

PARAMS = frozenset({"caches", "context", "models", "protocols", "sample", "tail_pad", "task",
                    "template", "text"})
PROTOCOLS = ("blind", "aware")
CALIBRATED = calibration.CALIBRATED


def _caches(cfg) -> dict:
  """`params.caches`: name -> {cache key: value}; an fp32 cache named `fp32` first when
  the table has none (every cell's calibration)."""
  out = ex.caches(cfg, "{fp32: {cache.codec: fp32}, snapkv_25: {cache.policy: snapkv, "
                       "cache.ratio: 0.25}}")
  return out if any(not o or o == {"cache.codec": "fp32"} for o in out.values()) \
      else {"fp32": {}, **out}


def _protocols(cfg) -> tuple[str, ...]:
  raw = cfg.param("protocols", PROTOCOLS)
  names = (raw,) if isinstance(raw, str) else tuple(raw)
  bad = [p for p in names if p not in PROTOCOLS]
  if bad or not names:
    raise KvjaxError(f"unknown params.protocols entry '{bad[0] if bad else ''}'; use "
                     f"{' and/or '.join(PROTOCOLS)}")
  return names


def _task(cfg) -> str:
  name = cfg.param("task", None)
  if name is None:
    raise KvjaxError(f"ruler needs params.task (a grid axis of task names: {', '.join(ruler.TASKS)})")
  ruler.check(str(name), 1)
  return str(name)


def _context(cfg) -> int:
  n = cfg.param("context", None)
  if n is None:
    raise KvjaxError("ruler needs params.context: the prompt length in tokens (a grid axis, "
                     "e.g. [4096, 8192, 16384, 32768])")
  ex.check_int_params(cfg, {"context": (n, 256), "sample": (0, 0), "tail_pad": (96, 8)})
  return cfg.param_int("context")


def _model_cfgs(cfg, mcfg) -> dict:
  """name -> the model with that cache (validated: an impossible cache is one line)."""
  base = dataclasses.replace(mcfg, seed=cfg.seed)
  return {name: config_lib.apply_overrides(base, over) if over else
          evaluate.reference_config(base) for name, over in _caches(cfg).items()}


def check(cfg) -> None:
  """Host-side, before any prefill: names, lengths, protocols, each cache on each model,
  and memory for the one-call prefill."""
  _task(cfg)
  n, protocols = _context(cfg), _protocols(cfg)
  if cfg.param("template", "plain") not in (*tasks.TEMPLATES, tasks.OWN):
    raise KvjaxError(f"unknown params.template '{cfg.param('template')}'; use one of "
                     f"{', '.join(tasks.TEMPLATES)} or {tasks.OWN} (the model's own)")
  text = str(cfg.param("text", "shakespeare"))
  data.eval_text(text, what="params.text")
  for spec in long_context.models(cfg):
    _, mcfg, _, _ = long_context.load(spec)
    ex.check_context(mcfg, n)
    for name, c in _model_cfgs(cfg, mcfg).items():
      pol = policies.get(c.cache.policy)
      if policies.evicts(c.cache):
        if protocols == ("aware",) and not pol.needs_queries:
          raise KvjaxError(f"params.caches.{name}: {c.cache.policy} scores without queries, "
                           "so it has no question-aware form; add blind to params.protocols "
                           "or drop this cache")
        policies.check_lengths(c.cache, [n // 2])
    _example(cfg, spec)  # a context too short for its question, a question over tail_pad
    ref = evaluate.reference_config(mcfg)
    m = mcfg.model
    parts = memory.estimate(ref, 1, n + cfg.param_int("tail_pad", 96)
                            + max(ruler.GEN_LEN.values()), n, params=True)
    # the prefill's rotated queries, every layer's, kept for the policies (twice: the
    # aware protocol places the question's beside them)
    parts["queries x2"] = 2 * m.n_layers * n * m.n_heads * m.D * 4
    memory.check_parts(parts, "this cell's one-call prefill", "shorten params.context or "
                       "choose a smaller model")


def share_key(cfg) -> int:
  """Cells of one context share compiled programs (one shape per context)."""
  return _context(cfg)


@functools.lru_cache(maxsize=4)
def _prose(text: str) -> str:
  return data.eval_text(text, what="params.text")


def _example(cfg, spec: str) -> ruler.Suite:
  """The cell's prompt for model `spec`, its questions checked against `params.tail_pad`."""
  return _made(spec, _task(cfg), _context(cfg), 1000 * cfg.seed + cfg.param_int("sample", 0),
               str(cfg.param("template", "plain")), str(cfg.param("text", "shakespeare")),
               cfg.param_int("tail_pad", 96))


@functools.lru_cache(maxsize=64)
def _made(spec: str, task: str, context: int, seed: int, template: str, text: str,
          tail_pad: int) -> ruler.Suite:
  tok = long_context.load(spec)[3]
  form = tasks.own_template(tok) if template == tasks.OWN else tasks.TEMPLATES[template]
  e = ruler.make(task, tok.encode, context - ruler.GEN_LEN[task], seed=seed, template=form,
                 prose=_prose(text))
  longest = max(len(tok.encode(q.tail)) for q in e.asks)
  if longest > tail_pad:
    raise KvjaxError(f"a {task} question takes {longest} tokens, more than "
                     f"params.tail_pad={tail_pad}; raise params.tail_pad")
  return e


def run_cell(cfg) -> list[dict]:
  rows = []
  tail_pad, protocols = cfg.param_int("tail_pad", 96), _protocols(cfg)
  for spec in long_context.models(cfg):
    src, mcfg, raw, tok = long_context.load(spec)
    params = step.prepare_params(mcfg, raw)
    del raw  # the prepared copy is the one every call reads: one copy of the weights held
    caches = _model_cfgs(cfg, mcfg)  # validated once, read by every question
    e = _example(cfg, spec)
    width = _context(cfg)
    ref = evaluate.reference_config(dataclasses.replace(mcfg, seed=cfg.seed))
    prefix = tasks.prefill_queries(ref, params, tok.encode(e.context), width)
    blind: dict = {}  # name -> the cache each question reads under the blind protocol: one
    #                   per cache, every question of the prompt (a question never consumes it)
    for ask in e.asks:
      tail = tok.encode(ask.tail)
      n_prompt = e.context_tokens + len(tail)
      shared: dict = {}  # the aware protocol's prompt, made once per question
      for name, tcfg in caches.items():
        evicts = policies.evicts(tcfg.cache)
        for protocol in (protocols if evicts else ("blind",)):
          if protocol == "aware" and not policies.get(tcfg.cache.policy).needs_queries:
            continue
          if protocol == "aware" and "prompt" not in shared:
            shared["prompt"] = tasks.question_prompt(ref, params, prefix, tail, tail_pad)
          if protocol == "blind" and name not in blind:
            blind[name] = _blind_cache(tcfg, prefix, tail_pad + ask.gen_len)
          row = _answer(tcfg, ref, params, tok, prefix, tail, ask, tail_pad, protocol,
                        e.context_tokens, n_prompt, shared.get("prompt"), blind.get(name))
          c = tcfg.cache
          extra = dict(policy=c.policy, budget=c.budget, ratio=c.ratio, window=c.window,
                       sinks=c.sinks) if evicts else {}
          var = ex.variant(tcfg, k_axis=c.k_axis, group_size=c.group_size,
                           residual=c.residual, setting=name, model=src.name,
                           protocol=protocol, **extra)
          rows.append({"variant": var,
                       "workload": {"task": e.task, "family": e.family,
                                    "haystack": e.haystack, "context": width,
                                    "prompt_tokens": n_prompt,
                                    "context_tokens": e.context_tokens,
                                    "sample": cfg.param_int("sample", 0), "seed": e.seed,
                                    "depth": ask.depth, "fact_token": ask.fact_token,
                                    "key": ask.key, "questions": len(e.asks),
                                    "template": cfg.param("template", "plain"),
                                    "gen_len": ask.gen_len, "protocol": protocol},
                       "metrics": row})
  return rows


def _blind_cache(tcfg, prefix, room: int):
  """The cache the question reads under the blind protocol: the context stored through the
  codec (`room` slots after the context's width for the question and the answer), or
  compacted by the policy before the question."""
  if not policies.evicts(tcfg.cache):
    return tasks.encode_prefix(tcfg, prefix.kv, prefix.width + room)
  return tasks.evict_prefix(tcfg, prefix, room)


def _answer(tcfg, ref, params, tok, prefix, tail, ask, tail_pad: int, protocol: str,
            n_context: int, n_prompt: int, prompt=None, blind=None) -> dict:
  """One question through one cache: the row's metrics. `blind`: the cache of
  `_blind_cache`, made once for every question of the prompt (the blind protocol's);
  `prompt`: `tasks.question_prompt`, made once for every cache (the aware protocol's)."""
  steps = ask.gen_len
  held = {}
  if not policies.evicts(tcfg.cache):
    ids = tasks.answer_through_cache(tcfg, params, blind, tail, steps, tail_pad)
    sized = footprint.count(tcfg, n_prompt)
    per_token, asym = sized.per_token, sized.asymptotic
  else:
    if protocol == "blind":
      cache, n_sel = blind, n_context
    else:
      last, cache = tasks.aware(tcfg, ref, params, prefix, tail, tail_pad, steps, prompt)
      n_sel = n_prompt
    n_held = int(np.asarray(cache.held)[0]) if cache.head_held is None else \
        float(np.asarray(cache.head_held)[:, 0].mean())  # per-head budgets: their mean
    sized = footprint.count(tcfg, n_sel)
    per_token, asym = sized.per_token, sized.asymptotic
    held = {"held_tokens": n_held, "kept": n_held / n_sel, "selected_from": n_sel}
    if protocol == "blind":
      ids = tasks.answer_through_cache(tcfg, params, cache, tail, steps, tail_pad)
    else:
      ids = tasks.continue_greedy(tcfg, params, cache, int(np.argmax(np.asarray(last)[0])),
                                  steps)
  out = tok.decode(ids)
  found = sum(s.lower() in out.lower() for s in ask.expected)
  return {"score": ruler.score(out, ask.expected), "found": found,
          "expected_n": len(ask.expected), "expected": list(ask.expected), "output": out,
          "bytes_per_token": per_token, "bytes_per_token_asymptotic": asym, **held}


def _scores(rows: list[dict], level: str, what: str, calibrated) -> list[dict]:
  """One record per (cache, protocol) of rows of one model, context and task or family."""
  acc: dict = {}
  for r in rows:
    acc.setdefault((r["variant"].get("setting"), r["variant"].get("protocol")), []).append(r)
  recs = []
  for (setting, protocol), rs in sorted(acc.items(), key=str):
    t = intervals.shares([r["metrics"]["score"] for r in rs])
    v, w = rs[0]["variant"], rs[0]["workload"]
    recs.append({"model": v.get("model"), "context": w["context"], level: what,
                 "cache": setting, "protocol": protocol, "score": t["score"],
                 "score_ci95": intervals.text(t["score_ci95"], "{:.2f}"), "n": t["n"],
                 "bytes_per_token": float(np.mean([r["metrics"]["bytes_per_token"]
                                                   for r in rs])),
                 "calibrated": calibrated,
                 **({"tasks": len({r["workload"]["task"] for r in rs})}
                    if level == "family" else {})})
  return recs


def summary(rows: list[dict]) -> dict:
  """Per (model, context, family, cache, protocol) and per task: the mean share with its
  Wilson interval over questions. A task is `calibrated` where its fp32 cache scores at
  least CALIBRATED (None without fp32 rows); a family is scored over its calibrated tasks
  (`tasks` counts them) and is uncalibrated only where none is (`calibration.family_rows`)."""
  cal = calibration.calibration(rows)
  groups: dict = {}
  for r in rows:
    v, w = r["variant"], r["workload"]
    groups.setdefault((v.get("model"), w["context"]), []).append(r)
  by_task, by_family = [], []
  for (m, n), mine in sorted(groups.items(), key=str):
    for task in dict.fromkeys(r["workload"]["task"] for r in mine):
      ref = cal.get((m, n, task))
      by_task += _scores([r for r in mine if r["workload"]["task"] == task], "task", task,
                         None if ref is None else bool(ref >= CALIBRATED))
    for fam in dict.fromkeys(r["workload"]["family"] for r in mine):
      here = [r for r in mine if r["workload"]["family"] == fam]
      used, ok = calibration.family_rows(here, cal)
      by_family += _scores(used, "family", fam, ok)
  return {"by family": by_family, "by task": by_task}


def estimate(cfgs) -> str | None:
  """The hours the cells `cfgs` will take here: per cell a one-call prefill (its matmul
  and attention arithmetic at half the probed f32 matmul rate) and, per question, cache
  and protocol, a question call and `gen_len` decode steps (the weights read once a step at
  the probed bandwidth); each cell's model, context and task from its config."""
  from kvjax.lab.experiments import roofline

  if not cfgs:
    return None
  flops_s = roofline.DotProbe().measure()["f32"] * 0.5
  bw = roofline.Bandwidth(256).measure()
  total = 0.0
  for cfg in cfgs:
    n, task = _context(cfg), _task(cfg)
    n_caches = len(_caches(cfg))
    for spec in long_context.models(cfg):
      m = long_context.load(spec)[1].model
      p = footprint.param_count(m)
      total += prefill_flops(m, n) / flops_s
      asks = 4 if task.startswith("niah_multikey") else 1
      calls = asks * n_caches * len(_protocols(cfg))
      step_s = 4 * p / bw + 4 * m.n_layers * m.n_kv_heads * m.D * 2 * n / bw
      total += calls * (ruler.GEN_LEN[task] * step_s
                        + prefill_flops(m, cfg.param_int("tail_pad", 96), n) / flops_s)
  return (f"about {total / 3600:.1f} hours on this machine for {len(cfgs)} cells (a rough "
          "estimate from a matmul and a bandwidth probe: within 2x)")


def prefill_flops(m, tokens: int, before: int = 0) -> float:
  """FLOPs (2 per multiply-add) of `tokens` prompt tokens after `before` held ones: every
  weight once per token, and the attention's logits and values over the keys each query
  sees (a windowed layer's last W)."""
  p = footprint.param_count(m)
  W = m.sliding_window
  local = sum(1 for i in range(m.n_layers) if m.window_of(i))
  seen = before * tokens + tokens * tokens / 2  # keys summed over the new queries
  full = (m.n_layers - local) * 4 * m.n_heads * m.D * seen
  windowed = local * 4 * m.n_heads * m.D * tokens * min(W, before + tokens)
  return 2 * p * tokens + full + windowed

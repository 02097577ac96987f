"""long_context: retrieval accuracy vs context length, depth and cache setting.

A cell is one context length (`params.context`, tokens) and one cache setting
(`params.setting`, a name from `params.settings`: a mapping of cache overrides). For each
model in `params.models` (any source `kvjax.io.sources.parse` takes: `gguf:smollm2-135m`,
`checkpoint:DIR`, `hf:DIR`, `config:FILE.yaml`) and each task in `params.tasks`
(kvjax.lab.tasks: passkey, niah, vt) it generates `params.seeds` examples whose prompt and
`params.gen_len` answer tokens fit that context length (and the model's window), facts at
`params.depths` (passkey: one example per depth; niah and vt: one example holding a fact
per depth, each queried in turn) and returns one row per query:
`accuracy` (1.0 or 0.0, `tasks.score`), the greedy continuation, the depth and token
position of the fact, and `bytes_per_token`: what the setting's cache holds for the prefix
per prefix token (`kvjax.footprint`: window, scales and lengths in), with
`bytes_per_token_asymptotic` (the long-context cost per stored token) beside it. The
summary gives each setting, task and context the number right (`correct`), the number
asked (`n`) and a Wilson 95 % interval of the accuracy (`accuracy_ci95`, kvjax.lab.intervals).

How a query is answered (see kvjax/lab/tasks/): the prefix (instructions + haystack) is
prefilled once through an fp32 cache, `params.chunk` tokens per call; its K/V are stored
through the cell's codec and layout (the write a prefill with that cache makes), then the
question tail is fed as its own call and `params.gen_len` tokens are decoded greedily, so
every question and answer token reads the haystack through the codec. The fp32 prefill is
shared by every setting of a context (kept while the cells of that context run: list
`params.context` before `params.setting` in the grid so the settings of a context are
consecutive cells).

Through an eviction policy (a setting with `cache.policy` other than `full`, with
`cache.ratio` or `cache.budget`, and `cache.window`/`cache.sinks` where the policy has
them; a codec may come with it): the prefix is prefilled in ONE call of `params.context`
tokens (padded) through an fp32 cache with its queries kept (`params.chunk` does not apply:
snapkv, h2o and tova score by the attention of prefix queries, all of which one call has),
its K/V are stored through the setting's codec and compacted to the budget
(`kvjax.decode.evict.compress_filled`, the cache `kvjax.decode.evict.prefill` makes), and the question and the
answer read the compacted cache. The question is not in the prefix, so the selection never
sees it (no policy is query-aware here). That prefill is shared by every policy setting of
a context, like the fp32 one of the codec settings. Such rows also carry `held_tokens`
(prefix tokens the cache keeps), `kept` (= held / prefix tokens), `cache_bytes` (the
compacted cache as allocated, question and answer room included) and `bytes_per_token` =
what the compacted cache holds for the prefix (the kept tokens' codec bytes + what the
policy itself keeps per held token: h2o's score and position, 8 bytes per layer and KV
head; `kvjax.footprint`) per prefix token, on the same axis as the codec settings. A `ratio` is
a fraction of the prefix.

A setting may also set `params.kv_heads`: the model's K/V projections are then mean-pooled
into that many heads (`kvjax.lab.convert.mean_pool`, no uptraining: GQA-3 -> MQA for
SmolLM2), or for a multiple of the model's heads copied exactly (`convert.expand`: the MHA
twin), and its prefixes are prefilled through that model (list such settings last
among a context's settings: the prefills kept are one model's).
"""

from __future__ import annotations

import dataclasses
import functools

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import footprint
from kvjax import policies
from kvjax.decode import step
from kvjax.errors import KvjaxError
from kvjax.io import sources
from kvjax.lab import convert, evaluate, intervals, tasks
from kvjax.lab import experiments as ex

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"capacity", "chunk", "context", "depths", "gen_len", "kv_heads", "models",
                    "seeds", "tail_pad", "tasks", "template", "vt_hops"})

_KV: dict = {}  # (model, context) -> {example key: (Example, fp32 K/V)}
_Q: dict = {}   # (model, context) -> {example key: (Example, tasks.Prefix)}: policy settings


def _settings(cfg) -> dict:
  return {k: dict(v) for k, v in dict(cfg.param("settings", None) or {}).items()}


def models(cfg) -> list[str]:
  models = cfg.param("models", ())
  if isinstance(models, str):
    models = (models,)
  if not models:
    raise KvjaxError("long_context needs params.models: a list of model sources, "
                     "e.g. [gguf:smollm2-135m]")
  return list(models)


def _task_list(cfg) -> list[str]:
  names = cfg.param("tasks", tasks.TASKS)
  return [names] if isinstance(names, str) else list(names)


def _context(cfg) -> int:
  n = cfg.param("context", None)
  if n is None:
    raise KvjaxError("long_context needs params.context: the context length in tokens "
                     "(a grid axis, e.g. params.context: [1024, 2048, 4096, 8192])")
  return cfg.param_int("context")


def share_key(cfg) -> int:
  """Cells with one key share work, so `kvjax run --shard` keeps them in one part: every
  setting of a context reads that context's prefills (`_prefixes`, `_query_prefixes`)."""
  return _context(cfg)


def check(cfg) -> None:
  name = cfg.param("setting", "")
  settings = _settings(cfg)
  if name and settings and name not in settings:
    raise KvjaxError(f"unknown params.setting '{name}'; known: {', '.join(settings)}")
  depths = list(cfg.param("depths", (0.5,)))
  n = _context(cfg) - cfg.param_int("gen_len", 12)
  for task in _task_list(cfg):
    tasks.check_args(task, n, depths[:1] if task == "passkey" else depths)
  if cfg.param("template", "plain") not in (*tasks.TEMPLATES, tasks.OWN):
    raise KvjaxError(f"unknown params.template '{cfg.param('template')}'; use one of "
                     f"{', '.join(tasks.TEMPLATES)} or {tasks.OWN} (the model's own)")
  for spec in models(cfg):
    _, mcfg, _, tok = load(spec)
    ex.check_context(mcfg, _context(cfg))
    if _kv_heads(cfg):
      convert.check_target(mcfg.model, _kv_heads(cfg))
    made = _examples(cfg, tok)  # a context too short for the question fails here
    tcfg = cell_config(cfg, mcfg)  # the setting's cache (a policy the layout cannot do)
    if policies.evicts(tcfg.cache):  # a ratio whose budget does not exceed its window
      policies.check_lengths(tcfg.cache, [e.prefix_tokens for _, e in made])


@functools.lru_cache(maxsize=2)
def load(spec: str):
  src = sources.parse(spec)
  mcfg, params, tok = sources.load(src)
  if tok is None:
    raise KvjaxError(f"model {spec} has no tokenizer; long_context needs text in and out")
  return src, mcfg, params, tok


def _kv_heads(cfg) -> int:
  """`params.kv_heads` of the cell, or of its setting when the runner left the settings
  table to the experiment."""
  over = _settings(cfg).get(cfg.param("setting", ""), {})
  return int(over.get("params.kv_heads", cfg.param("kv_heads", 0)))


def _model(spec: str, cfg):
  """`_load`, with the K/V heads mean-pooled (or expanded exactly, to a multiple) to
  `params.kv_heads` when the setting asks, the
  params prepared as every step through a cache takes them (`kvjax.decode.step.prepare_params`)."""
  src, mcfg, params, tok = load(spec)
  kv = _kv_heads(cfg)
  if kv and kv != mcfg.model.n_kv_heads:
    mcfg, params = _pooled(spec, kv)
  return src, mcfg, step.prepare_params(mcfg, params), tok


@functools.lru_cache(maxsize=1)
def _pooled(spec: str, kv_heads: int):
  _, mcfg, params, _ = load(spec)
  grow = kv_heads > mcfg.model.n_kv_heads  # a multiple: the exact twin (more cache, same outputs)
  return (convert.expand if grow else convert.mean_pool)(mcfg, params, kv_heads)


def cell_config(cfg, model_cfg: config_lib.Config) -> config_lib.Config:
  """The model with this cell's cache and seed, plus the setting's overrides when the
  runner left them to the experiment (`params.settings` still in the cell's params)."""
  merged = dataclasses.replace(model_cfg, cache=cfg.cache, seed=cfg.seed)
  over = {k: v for k, v in _settings(cfg).get(cfg.param("setting", ""), {}).items()
          if not str(k).startswith("params.")}  # experiment options: read where used
  return config_lib.apply_overrides(merged, over) if over else \
      config_lib.validate(config_lib.resolve(merged))


_EX: dict = {}


def _examples(cfg, tok) -> list[tuple[tuple, tasks.Example]]:
  """The prompts fill the context but for the `gen_len` answer tokens (memoized: `check`
  and `run_cell` both ask)."""
  key = (id(tok), _context(cfg), tuple(cfg.param("depths", (0.5,))), tuple(_task_list(cfg)),
         cfg.param_int("seeds", 1), cfg.param("template", "plain"), cfg.seed,
         cfg.param_int("vt_hops", 1), cfg.param_int("gen_len", 12))
  if key not in _EX:
    _EX[key] = _make_examples(cfg, tok)
  return _EX[key]


def _make_examples(cfg, tok) -> list[tuple[tuple, tasks.Example]]:
  n = _context(cfg) - cfg.param_int("gen_len", 12)
  depths = [float(d) for d in cfg.param("depths", (0.5,))]
  name = cfg.param("template", "plain")
  template = tasks.own_template(tok) if name == tasks.OWN else tasks.TEMPLATES[name]
  out = []
  for task in _task_list(cfg):
    for s in range(cfg.param_int("seeds", 1)):
      groups = [[d] for d in depths] if task == "passkey" else [depths]
      for ds in groups:
        e = tasks.generate(task, tok.encode, n, ds, seed=cfg.seed + s, template=template,
                           hops=cfg.param_int("vt_hops", 1))
        out.append(((task, s, tuple(ds), template.name), e))
  return out


def _capacity(cfg, mcfg) -> int:
  """Cache slots: the model's whole window unless `params.capacity` says otherwise, the same
  for every context so each setting's programs compile once (attention reads only the
  live length)."""
  return max(cfg.param_int("capacity", 0) or mcfg.model.max_seq_len, _context(cfg))


def _prefixes(spec: str, cfg, mcfg, params, tok):
  """Examples of this context with their prefix's fp32 K/V, computed once per context."""
  key = (spec, _context(cfg), tuple(cfg.param("depths", (0.5,))), tuple(_task_list(cfg)),
         cfg.param_int("seeds", 1), cfg.param("template", "plain"), cfg.seed,
         cfg.param_int("chunk", 512), cfg.param_int("vt_hops", 1), _kv_heads(cfg))
  if key not in _KV:
    _KV.clear()  # one context's prefixes at a time (about 0.4 GB per 8k prefix of SmolLM2)
    ref = evaluate.reference_config(dataclasses.replace(mcfg, seed=cfg.seed))
    made = {}
    for k, e in _examples(cfg, tok):
      c = tasks.prefill(ref, params, tok.encode(e.prefix), _capacity(cfg, mcfg),
                        cfg.param_int("chunk", 512))
      made[k] = (e, tasks.prefix_kv(c))
    _KV[key] = made
  return _KV[key]


def _query_prefixes(spec: str, cfg, mcfg, params, tok):
  """Examples of this context with their prefix prefilled in one call through an fp32
  cache, queries kept (`tasks.prefill_queries`), computed once per context for every
  policy setting."""
  key = (spec, _context(cfg), tuple(cfg.param("depths", (0.5,))), tuple(_task_list(cfg)),
         cfg.param_int("seeds", 1), cfg.param("template", "plain"), cfg.seed,
         cfg.param_int("vt_hops", 1), _kv_heads(cfg))
  if key not in _Q:
    _Q.clear()  # one context at a time (K/V and queries: about 0.25 GB per 2k prefix)
    ref = evaluate.reference_config(dataclasses.replace(mcfg, seed=cfg.seed))
    _Q[key] = {k: (e, tasks.prefill_queries(ref, params, tok.encode(e.prefix), _context(cfg)))
               for k, e in _examples(cfg, tok)}
  return _Q[key]


def run_cell(cfg) -> list[dict]:
  rows = []
  gen_len, tail_pad = cfg.param_int("gen_len", 12), cfg.param_int("tail_pad", 64)
  for spec in models(cfg):
    src, mcfg, params, tok = _model(spec, cfg)
    tcfg = cell_config(cfg, mcfg)
    c = tcfg.cache
    evicts = policies.evicts(c)
    extra = dict(policy=c.policy, budget=c.budget, ratio=c.ratio, window=c.window,
                 sinks=c.sinks) if evicts else {}
    var = ex.variant(tcfg, k_axis=c.k_axis, group_size=c.group_size, residual=c.residual,
                     setting=cfg.param("setting", ""), model=src.name, **extra)
    bpt = ex.bytes_per_token(tcfg)  # the codecs' bytes per stored token (policy rows show it)
    prefixes = (_query_prefixes if evicts else _prefixes)(spec, cfg, mcfg, params, tok)
    for (task, s, _, template), (e, kv) in prefixes.items():
      # What the cache holds for this prefix (kvjax.footprint: the policy's kept tokens with their
      # state, a window, scales), per prefix token, so every row sits on one bytes axis.
      sized = footprint.count(tcfg, e.prefix_tokens)
      held = {}
      if evicts:  # compacted to the budget; room for the padded question and the answer
        cache = tasks.evict_prefix(tcfg, kv, tail_pad + gen_len)
        n_held = int(cache.held[0])
        held = {"held_tokens": n_held, "kept": n_held / e.prefix_tokens,
                "codec_bytes_per_token": bpt, "cache_bytes": cache_lib.tree_bytes(cache)}
      else:
        cache = tasks.encode_prefix(tcfg, kv, _capacity(cfg, mcfg))
      for q in e.queries:
        tail = tok.encode(q.tail)
        if len(tail) > tail_pad:
          raise KvjaxError(f"a {task} question takes {len(tail)} tokens, more than "
                           f"params.tail_pad={tail_pad}; raise params.tail_pad")
        out = tok.decode(tasks.answer_through_cache(tcfg, params, cache, tail, gen_len,
                                                    tail_pad))
        rows.append({"variant": var,
                     "workload": {"task": task, "context": _context(cfg),
                                  "prompt_tokens": e.n_tokens,
                                  "prefix_tokens": e.prefix_tokens,
                                  "depth": q.depth,
                                  "fact_depth": q.fact_token / e.prefix_tokens,
                                  "fact_token": q.fact_token, "seed": e.seed, "key": q.key,
                                  "n_facts": len(e.queries), "template": template,
                                  "gen_len": gen_len},
                     "metrics": {"accuracy": tasks.score(out, q.answer),
                                 "bytes_per_token": sized.per_token,
                                 "bytes_per_token_asymptotic": sized.asymptotic,
                                 "answer": q.answer, "output": out, **held}})
  return rows


def summary(rows: list[dict]) -> list[dict]:
  """Accuracy per setting and context, over tasks, depths and seeds: the number right, the
  number asked and the Wilson 95 % interval (`kvjax.lab.intervals.tally`)."""
  acc: dict = {}
  for r in rows:
    v, w = r["variant"], r["workload"]
    k = (v.get("model"), v.get("setting") or v["codec"], w["task"], w["context"])
    acc.setdefault(k, ([], []))[0].append(r["metrics"]["accuracy"])
    acc[k][1].append(r["metrics"]["bytes_per_token"])  # a policy's kept fraction varies a little
  out = [{"model": m, "setting": s, "task": t, "context": n, **intervals.tally(a),
          "bytes_per_token": sum(b) / len(b)} for (m, s, t, n), (a, b) in acc.items()]
  return [{**o, "accuracy_ci95": intervals.text(o["accuracy_ci95"], "{:.2f}")} for o in out]

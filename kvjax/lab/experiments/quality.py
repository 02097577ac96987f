"""quality: what each cache setting costs in output quality, measured through the cache.

A cell is one cache setting (`params.setting`, a name from `params.settings`: a mapping
of cache overrides such as codec, k_axis, group_size, residual) on one layout. Models come
from `params.models`, a list of sources (`gguf:smollm2-135m`, `hf:DIR`, `checkpoint:DIR`,
or a bare path; see kvjax.io.sources), or `params.checkpoints` (kvjax checkpoint folders: the
trained MHA, GQA, MQA comparison models). A setting may also set `params.kv_heads`: the
model's K/V projections are then mean-pooled into that many heads (kvjax.lab.convert, no
uptraining) and measured against the unconverted model's fp32 cache; or
`params.converted: DIR`, a checkpoint `kvjax convert` made from the run's model (aligned,
fitted, ...), measured the same way, its method and recipe in the row's variant
(`conversion`, `recipe`).
For each model:

  - a `task: text` row: validation text streamed token by token (`params.chunk`) through
    the cache; `ppl`, `ppl_ref` (same model, fp32 cache), `dppl_rel`, `kl`, `agreement`
    (teacher-forced greedy tokens vs the fp32 cache), each of the last three with its 95 %
    interval (`dppl_rel_ci95`, `kl_ci95`, `agreement_ci95`: kvjax.lab.intervals, a t
    interval over the windows' paired sums), `gen_agreement` (free-running greedy
    decode of `workload.gen_len` tokens after `workload.prompt_len`), `cache_bytes` (the
    cache tree after the windows), `bytes_per_token` (what it held per token, window and
    scales in: `kvjax.footprint`), `bytes_per_token_asymptotic` (the long-context cost) and
    `bits_per_element` (all-in: held bits / (layers x 2 x KV heads x head_dim)); a window
    holding over a quarter of the tokens is warned about on stderr;
  - `task: recall` rows, one per context in `params.recall_contexts`: associative-recall
    accuracy through this cache (`recall`) and through the fp32 cache (`recall_ref`).

Text: byte-level models read windows of their training corpus' validation split
(`train.data`); models with their own tokenizer read `params.text` (default `stdlib`: the
validation documents of Python's own sources and docs, kvjax.lab.data.eval_text), tokenized
and cut into `eval_seqs` evenly spaced windows of `eval_tokens`.

Peers: a setting with `params.peer: quanto_int4` (or `quanto_int2`) measures transformers'
`QuantizedCache` instead of a kvjax cache (quanto backend, that many bits, residual
`params.peer_residual`, its other options at their defaults) on the same model
(transformers' own GGUF loader), the same tokens and the same chunking, with transformers'
unquantized dynamic cache as that row's reference (computed once per run).

Reference: `params.reference` (a codec name, `KEY=VALUE,...` as `kvjax eval --ref` takes, or
a mapping of cache keys) holds every setting to that cache of the same model instead of the
fp32 cache: `ppl_ref`, `dppl_rel`, `kl`, `agreement` (and recall_ref, gen_agreement) are then
paired against it on the same tokens, with the same intervals; `workload.reference` names
it in every text row (`fp32 cache` by default), and the summary and plots say it.

The cell's own `model:` section is ignored: each model brings its config.
References are computed once per model and reused by every cell of a run.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

from kvjax.lab import experiments as ex
import numpy as np

from kvjax import config as config_lib
from kvjax import footprint
from kvjax.errors import KvjaxError
from kvjax.io import sources
from kvjax.lab import convert
from kvjax.lab import data, evaluate, intervals

# The params.NAME options this experiment reads (`setting` and `settings` are every
# experiment's); `kvjax run` refuses any other, which would be accepted and ignored.
PARAMS = frozenset({"checkpoints", "chunk", "converted", "eval_seqs", "eval_tokens", "gen_prompts",
                    "kv_heads", "models", "peer", "peer_residual", "recall_contexts",
                    "recall_seqs", "reference", "text"})

_REF: dict = {}


def models(cfg) -> list[sources.Source]:
  """`params.models` (any source) followed by `params.checkpoints` (kvjax folders)."""
  names, paths = cfg.param("models", ()), cfg.param("checkpoints", ())
  names = (names,) if isinstance(names, str) else tuple(names)
  paths = (paths,) if isinstance(paths, str) else tuple(paths)
  out = [sources.parse(m) for m in names] + [sources.Source("checkpoint", p) for p in paths]
  if not out:
    raise KvjaxError("quality needs params.models (e.g. [gguf:smollm2-135m]) or "
                     "params.checkpoints (folders written by `kvjax train ... --out DIR`)")
  return out


_NAMES = ("params.eval_tokens", "params.eval_seqs", "params.text")


def check(cfg) -> None:
  """Host-side: the experiment's own numbers first, then that every model exists (nothing
  is loaded here)."""
  ex.check_int_params(cfg, {"eval_tokens": (512, 2), "eval_seqs": (4, 1), "chunk": (1, 1),
                            "recall_seqs": (32, 1)})
  for src in models(cfg):
    if src.kind == "checkpoint" and not (Path(src.ref) / "config.yaml").is_file():
      raise KvjaxError(f"checkpoint {src.ref} not found; train it first, e.g. "
                       f"`kvjax train configs/train_mha.yaml --out {src.ref}`")
    if src.kind == "gguf":
      from kvjax.io import zoo
      zoo.resolve_gguf(src.ref)
  conv = str(cfg.param("converted", "") or "").removeprefix("checkpoint:")
  if conv and not (Path(conv) / "config.yaml").is_file():
    raise KvjaxError(f"params.converted {conv} not found; make it first with `kvjax convert "
                     f"... --out {conv}` (the config's header says how)")
  reference_items(cfg)  # a malformed params.reference refused before any cell runs
  peer = cfg.param("peer", "")
  if peer and (not peer.startswith("quanto_int") or peer[len("quanto_int"):] not in ("2", "4")):
    raise KvjaxError(f"unknown params.peer '{peer}'; use quanto_int4 or quanto_int2")


@functools.lru_cache(maxsize=4)
def load_model(src: sources.Source):
  """(config, params, tokenizer) of a model source, read afresh (not cached: a cell holds
  its model only while it runs); shared by the experiments that read the same models."""
  return sources.load(src)


def cell_config(cfg, model_cfg: config_lib.Config) -> config_lib.Config:
  """The model and data with this cell's cache and workload (the runner has
  already applied the cell's `params.setting`)."""
  merged = dataclasses.replace(model_cfg, cache=cfg.cache, workload=cfg.workload, seed=cfg.seed)
  return config_lib.validate(config_lib.resolve(merged))


def _windows(cfg, model_cfg: config_lib.Config, tok):
  """(token windows [B, M], byte corpus or None) for this model."""
  n, seqs = cfg.param_int("eval_tokens", 512), cfg.param_int("eval_seqs", 4)
  if tok is None or model_cfg.tokenizer == "bytes":
    corpus = data.load_corpus(model_cfg.train.data)
    if len(corpus.validation) < n:
      raise KvjaxError(f"the validation split of {model_cfg.train.data} holds "
                       f"{len(corpus.validation)} tokens, fewer than params.eval_tokens={n}; "
                       "lower params.eval_tokens or train on more text")
    return data.eval_windows(corpus.validation, seqs, n - 1), corpus
  text = data.eval_text(str(cfg.param("text", "stdlib")), what="params.text")
  return evaluate.text_windows(tok, text, n, seqs, _NAMES), None


def reference_items(cfg) -> dict:
  """`cache.*` overrides of `params.reference` (a codec name, `KEY=VALUE,...` as `kvjax eval
  --ref` takes, or a mapping of cache keys), applied to the fp32 contiguous cache; {} for
  the default, the fp32 cache itself."""
  from kvjax.lab import compare
  ref = cfg.param("reference", None)
  if ref in (None, "", "fp32"):
    return {}
  if isinstance(ref, dict):
    items = {str(k) if str(k).startswith("cache.") else f"cache.{k}": v for k, v in ref.items()}
  elif isinstance(ref, str) and compare.kind_of(ref) == "cache":
    items = compare.cache_items(ref)
  else:
    raise KvjaxError(f"params.reference must be a cache setting (bf16, codec=int4,group_size=32 "
                     f"or a mapping of cache keys), got {ref!r}; hold a model to another with "
                     "`kvjax eval --ref MODEL`")
  if any(not k.startswith("cache.") for k in items):
    raise KvjaxError(f"params.reference sets {', '.join(items)}; only cache.* keys")
  return items


def reference_name(cfg) -> str:
  """How rows and plots name the reference: `fp32 cache` or the setting's text."""
  items = reference_items(cfg)
  if not items:
    return "fp32 cache"
  return ",".join(f"{k.removeprefix('cache.')}={v}" for k, v in items.items()) \
      if list(items) != ["cache.codec"] else f"{items['cache.codec']} cache"


def _reference(src: sources.Source, cfg, mcfg, params, tok) -> dict:
  key = (str(src), repr(reference_items(cfg)), cfg.param("eval_tokens", 512), cfg.param("eval_seqs", 4),
         cfg.param("chunk", 1), cfg.param("text", "stdlib"),
         tuple(cfg.param("recall_contexts", ())), cfg.param("recall_seqs", 32), cfg.seed,
         cfg.workload.prompt_len, cfg.workload.gen_len)
  if key not in _REF:
    for k in [k for k in _REF if k[0] != "hf"]:  # one model's reference at a time: a real
      del _REF[k]                                # model's is gigabytes
    ref_cfg = evaluate.reference_config(cell_config(cfg, mcfg))
    if reference_items(cfg):  # params.reference: held to that cache instead of fp32
      ref_cfg = config_lib.apply_overrides(ref_cfg, reference_items(cfg))
    tokens, corpus = _windows(cfg, mcfg, tok)
    lp = evaluate.host_logprobs(ref_cfg, params, tokens, cfg.param_int("chunk", 1))
    nbytes = footprint.cache_bytes(ref_cfg, *tokens.shape, layout="contiguous")
    recall = {}
    for L in (cfg.param("recall_contexts", ()) if corpus is not None else ()):
      seqs, mask = evaluate.recall_set(cfg.seed, cfg.param_int("recall_seqs", 32), int(L),
                                       mcfg.train.recall_pairs, corpus.validation)
      recall[int(L)] = (seqs, mask, evaluate.recall_accuracy(ref_cfg, params, seqs, mask,
                                                             cfg.param_int("chunk", 1)))
    gen = None
    n_gen, P = cfg.param_int("gen_prompts", 4), cfg.workload.prompt_len
    if n_gen and cfg.workload.gen_len:
      prompts = [list(map(int, t[:P])) for t in tokens[:n_gen]]
      gen = (prompts, evaluate.greedy_tokens(ref_cfg, params, prompts, cfg.workload.gen_len))
    _REF[key] = {"tokens": tokens, "lp": lp, "bytes": nbytes, "recall": recall, "gen": gen}
  return _REF[key]


def run_cell(cfg) -> list[dict]:
  rows = []
  chunk = cfg.param_int("chunk", 1)
  for src in models(cfg):
    mcfg, params, tok = load_model(src)
    tcfg = cell_config(cfg, mcfg)
    ref = _reference(src, cfg, mcfg, params, tok)
    if cfg.param("peer", ""):
      text = str(cfg.param("text", "stdlib"))
      rows.append(_peer_row(cfg, src, cfg.param("peer"), ref["tokens"], chunk, text))
      continue
    kv_heads = cfg.param_int("kv_heads", 0)
    if kv_heads and kv_heads != mcfg.model.n_kv_heads:  # fewer KV heads, mean-pooled
      pooled_cfg, params = convert.mean_pool(mcfg, params, kv_heads)
      tcfg = cell_config(cfg, pooled_cfg)
    conversion = {}
    if cfg.param("converted", ""):  # a converted checkpoint of this model
      conv_cfg, params, conversion = converted(cfg.param("converted"), src, mcfg)
      tcfg = cell_config(cfg, conv_cfg)
    c = tcfg.cache
    var = ex.variant(tcfg, k_axis=c.k_axis, group_size=c.group_size, residual=c.residual,
                     setting=cfg.param("setting", ""), model=src.name, **conversion)
    B, M = ref["tokens"].shape
    warning = footprint.window_warning(tcfg, M)
    if warning:
      print(f"kvjax: warning: setting {cfg.param('setting', '')}: {warning}", file=sys.stderr)
    metrics, nbytes = evaluate.compare_streamed(tcfg, params, ref["tokens"], ref["lp"], chunk)
    # bytes_per_token: what this cache held for the windows (kvjax.footprint, = nbytes / (B M)),
    # window and scales in; the long-context cost and the all-in bits beside it
    metrics.update(cache_bytes=nbytes, cache_bytes_ref=ref["bytes"],
                   cache_bytes_per_token=nbytes / (B * M),
                   **footprint.count(tcfg, M, batch=B).fields())
    if ref["gen"] is not None:
      prompts, ref_gen = ref["gen"]
      got = evaluate.greedy_tokens(tcfg, params, prompts, tcfg.workload.gen_len)
      metrics["gen_agreement"] = evaluate.generation_agreement(got, ref_gen)
    text = mcfg.train.data if mcfg.tokenizer == "bytes" else str(cfg.param("text", "stdlib"))
    rows.append({"variant": var, "workload": {"task": "text", "batch": B, "context": M,
                                              "chunk": chunk, "data": text,
                                              "reference": reference_name(cfg)},
                 "metrics": metrics})
    for L, (seqs, mask, acc_ref) in ref["recall"].items():
      acc = evaluate.recall_accuracy(tcfg, params, seqs, mask, chunk)
      rows.append({"variant": var, "workload": {"task": "recall", "context": L,
                                                "batch": len(seqs), "chunk": chunk,
                                                "n_pairs": mcfg.train.recall_pairs},
                   "metrics": {"recall": acc, "recall_ref": acc_ref}})
  return rows


def converted(path: str, src: sources.Source, mcfg) -> tuple:
  """(config, params, recipe) of `params.converted`, a checkpoint converted from `src`: its
  vocabulary and tokenizer must be the source's, so it reads the reference's tokens."""
  from kvjax.io import checkpoint
  path = str(path).removeprefix("checkpoint:")
  ccfg, params = checkpoint.load(path)
  meta = checkpoint.read_meta(path)
  if (ccfg.tokenizer, ccfg.model.vocab_size) != (mcfg.tokenizer, mcfg.model.vocab_size):
    raise KvjaxError(f"params.converted {path} reads another tokenizer than {src} "
                     f"({ccfg.tokenizer}); convert it from {src}")
  recipe = dict(meta.get("recipe") or {"method": meta.get("method", "unknown")})
  method = recipe.pop("method")
  recipe.pop("source", None)
  return ccfg, params, {"conversion": method,
                        "recipe": ",".join(f"{k}={v}" for k, v in sorted(recipe.items()))}


# -- transformers' quantized cache on the same model and tokens ------------------------------
@functools.lru_cache(maxsize=1)
def _hf_model(src: sources.Source):
  """The same weights in transformers: its own GGUF loader, or the HF folder."""
  from transformers import AutoModelForCausalLM
  if src.kind == "gguf":
    from kvjax.io import zoo
    path = zoo.resolve_gguf(src.ref)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype="float32").eval()
  if src.kind == "hf":
    return AutoModelForCausalLM.from_pretrained(src.ref, dtype="float32").eval()
  raise KvjaxError(f"params.peers needs a gguf: or hf: model, not {src}")


def _hf_logprobs(model, tokens_BM, chunk: int, cache):
  """Log-probabilities [B, M, V] fed `chunk` tokens per forward through `cache`."""
  import torch
  ids = torch.tensor(np.asarray(tokens_BM), dtype=torch.long)
  out = []
  with torch.inference_mode():
    for s in range(0, ids.shape[1], chunk):
      logits = model(ids[:, s:s + chunk], past_key_values=cache, use_cache=True).logits
      out.append(torch.log_softmax(logits.float(), -1).numpy())
  return np.concatenate(out, axis=1)


def _quanto_bytes(cache) -> int:
  """Bytes the quantized cache holds: every tensor in its layers (codes, scales, shifts,
  the full-precision residual)."""
  import torch
  seen, total = set(), 0

  def walk(obj):
    nonlocal total
    if isinstance(obj, torch.Tensor):
      if id(obj) not in seen:
        seen.add(id(obj))
        inner = getattr(obj, "__tensor_flatten__", None)
        if inner is not None:  # a quanto tensor subclass: count its parts
          for name in inner()[0]:
            walk(getattr(obj, name))
        else:
          total += obj.numel() * obj.element_size()
    elif isinstance(obj, (list, tuple)):
      for x in obj:
        walk(x)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
      for x in vars(obj).values():
        walk(x)
  walk(cache.layers)
  return total


def _peer_row(cfg, src, peer: str, tokens_BM, chunk: int, text: str) -> dict:
  from transformers import DynamicCache, QuantizedCache
  model = _hf_model(src)
  bits, residual = int(peer[len("quanto_int"):]), cfg.param_int("peer_residual", 128)
  key = ("hf", str(src), np.asarray(tokens_BM).tobytes(), chunk)
  if key not in _REF:
    _REF[key] = _hf_logprobs(model, tokens_BM, chunk, DynamicCache(config=model.config))
  ref = _REF[key]
  cache = QuantizedCache(backend="quanto", config=model.config, nbits=bits,
                         residual_length=residual)
  lp = _hf_logprobs(model, tokens_BM, chunk, cache)
  metrics = evaluate.compare(lp, ref, tokens_BM)
  B, M = np.asarray(tokens_BM).shape
  nbytes = _quanto_bytes(cache)
  m = model.config
  elements = m.num_hidden_layers * 2 * m.num_key_value_heads * (
      getattr(m, "head_dim", None) or m.hidden_size // m.num_attention_heads)
  # held at this context (its window in); no long-context figure: quanto's layout is its own
  metrics.update(cache_bytes=nbytes, cache_bytes_per_token=nbytes / (B * M),
                 bytes_per_token=nbytes / (B * M), held_bytes=nbytes / B,
                 bits_per_element=8 * nbytes / (B * M) / elements)
  var = {"variant": "transformers", "peer": "quanto", "codec": f"quanto-int{bits}",
         "k_codec": f"quanto-int{bits}", "v_codec": f"quanto-int{bits}", "residual": residual,
         "setting": peer, "model": src.name, "kv_heads": m.num_key_value_heads,
         "heads": m.num_attention_heads, "layout": "QuantizedCache"}
  return {"variant": var, "workload": {"task": "text", "batch": B, "context": M,
                                       "chunk": chunk, "data": text,
                                       "reference": "transformers' unquantized cache"},
          "metrics": metrics}


def summary(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    if r["workload"].get("task") == "text":
      v, m = r["variant"], r["metrics"]
      out.append({"model": v.get("variant"), "setting": v.get("setting"),
                  "reference": r["workload"].get("reference", "fp32 cache"),
                  "ppl": m["ppl"], "ppl_ref": m["ppl_ref"], "dppl_%": 100 * m["dppl_rel"],
                  "dppl_%_ci95": intervals.text(m.get("dppl_rel_ci95"), "{:+.3f}", 100),
                  "kl": m["kl"], "kl_ci95": intervals.text(m.get("kl_ci95")),
                  "agreement": m["agreement"],
                  "bytes_per_token": m.get("bytes_per_token"),
                  "bytes_per_token_asymptotic": m.get("bytes_per_token_asymptotic"),
                  "bits_per_element": m.get("bits_per_element")})
  return out

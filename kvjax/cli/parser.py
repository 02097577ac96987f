"""The `kvjax` argument parser: every subcommand, its flags and help, each bound to its
`cmd_*` function (kvjax.cli.commands). A parse error is a one-line KvjaxError.
"""

from __future__ import annotations

import argparse

from kvjax.cli.commands import (DEFAULT_CODEC, cmd_convert, cmd_eval, cmd_generate, cmd_models,
                                cmd_plot, cmd_results, cmd_run, cmd_size, cmd_train,
                                codec_names, layout_names)
from kvjax.errors import KvjaxError


NUMBER_FLAGS: set[str] = set()  # every flag `_number` types (kvjax.cli attaches their values)


def _number(flag: str, key: str | tuple, integer: bool = True):
  """An argparse `type` for a numeric flag: parsed, then held to the range of its config key
  (or to the range given) by the check the key itself gets, the message naming the flag."""
  from kvjax.config import check_number, range_of

  NUMBER_FLAGS.add(flag)

  def parse(text: str):
    try:
      value = int(text) if integer else float(text)
    except ValueError:
      raise KvjaxError(f"{flag} expects {'an integer' if integer else 'a number'}, got "
                       f"{text!r}") from None
    rng = range_of(key) if isinstance(key, str) else key
    try:
      check_number(flag, value, rng, integer)
    except KvjaxError as e:
      where = f" (config key {key} has the same range)" if isinstance(key, str) else ""
      raise KvjaxError(f"{e}{where}") from None
    return value
  parse.__name__ = "int" if integer else "float"
  return parse


_I32 = 2**31 - 1
_POS, _NONNEG = (0, False, _I32, True), (0, True, _I32, True)


class Listed:
  """A help text naming what a registry holds, written out only when help is printed: the
  registries import JAX, which parsing a command line must not wait for. `{codecs}`,
  `{layouts}` in `text` become the registered names (`codec_names`, `layout_names`)."""

  def __init__(self, text: str):
    self.text = text

  def __str__(self) -> str:
    return self.text.format(codecs=", ".join(codec_names()), layouts=", ".join(layout_names()))


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, not the usage block
    raise KvjaxError(f"{message} (see {self.prog} --help)")

  def format_help(self) -> str:
    """Help with every `Listed` text written out from the registries."""
    if isinstance(self.description, Listed):
      self.description = str(self.description)
    if isinstance(self.epilog, Listed):
      self.epilog = str(self.epilog)
    for action in self._actions:
      if isinstance(action.help, Listed):
        action.help = str(action.help).replace("%", "%%")
    return super().format_help()


def _add_distributed(p):
  d = p.add_argument_group("multi-host (jax.distributed; or KVJAX_COORDINATOR, "
                           "KVJAX_NUM_PROCESSES, KVJAX_PROCESS_ID, KVJAX_DISTRIBUTED=1, "
                           "KVJAX_DISTRIBUTED_TIMEOUT)")
  d.add_argument("--distributed", action="store_true",
                 help="jax.distributed.initialize() with cluster auto-detection (TPU, SLURM, MPI)")
  d.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
  d.add_argument("--num-processes", type=_number("--num-processes", _POS))
  d.add_argument("--process-id", type=_number("--process-id", _NONNEG))
  d.add_argument("--distributed-timeout", metavar="SECONDS",
                 type=_number("--distributed-timeout", (1, True, 86400, True)),
                 help="how long to wait for every process to join, and for a silent one "
                 "before the run stops (default: JAX's 300 and 100)")


def _add_set(p):
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a config key, e.g. --set model.n_kv_heads=2 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="kvjax", description="Compare KV-cache variants: memory, speed, quality.",
              epilog=Listed("Cache codecs (cache.codec, --codec): {codecs}. Layouts "
                            "(cache.layout): {layouts}."))
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

  s = sub.add_parser(
      "size", help="closed-form KV-cache bytes for a model shape, and what fits a budget",
      description=Listed(
          "Closed-form KV-cache bytes (per token, and for --batch x --seq-len) of a model "
          "given by its shape flags, a kvjax config, a Hugging Face folder or a GGUF file; "
          "with --budget, how many sequences fit after the weights. The cache is bf16 unless "
          "a codec is given, whichever way the model is named. Codecs: {codecs}. Layouts "
          "(--set cache.layout=): {layouts} (none is sized as contiguous)."))
  s.add_argument("--layers", type=_number("--layers", "model.n_layers"),
                 help="decoder layers (shape-only form)")
  s.add_argument("--heads", type=_number("--heads", "model.n_heads"),
                 help="query heads (shape-only form)")
  s.add_argument("--kv-heads", type=_number("--kv-heads", "model.n_kv_heads"),
                 help="KV heads: = heads for MHA, 1 for MQA")
  s.add_argument("--head-dim", type=_number("--head-dim", _POS), help="dimension of one head")
  s.add_argument("--hf", metavar="DIR", help="read the shape from a Hugging Face config.json "
                 "(parameters counted in its torch_dtype)")
  s.add_argument("--gguf", metavar="FILE|NAME", help="read the shape from a GGUF file's "
                 "metadata, or a model `kvjax models` lists (parameters dequantized to fp32)")
  s.add_argument("--config", metavar="FILE.yaml", help="read the shape from a kvjax config, "
                 "or a packaged model shape by name, e.g. llama3-8b (parameters in model.param_dtype)")
  s.add_argument("--seq-len", type=_number("--seq-len", _POS), required=True,
                 help="tokens per sequence")
  s.add_argument("--batch", type=_number("--batch", "workload.batch"), default=1,
                 help="sequences (default 1)")
  s.add_argument("--dtype", help="float32 | bfloat16 | float16: the same as --codec "
                 "fp32/bf16/fp16")
  s.add_argument("--codec", help=Listed(f"cache codec for K and V (default {DEFAULT_CODEC}): "
                                        "{codecs}"))
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
  pr.add_argument("--prompt-file", metavar="FILE", help="the prompt as UTF-8 text in a file "
                  "(a long document)")
  g.add_argument("--max-new-tokens", type=_number("--max-new-tokens", _POS), default=16)
  g.add_argument("--warmup", action="store_true", help="run the program once untimed, then "
                 "the timed run, so ttft_s and tpot_s exclude first-execution costs (a long "
                 "prompt is then prefilled twice); default: one run, whose timings include "
                 "them")
  g.add_argument("--no-warmup", action="store_true", help="one run (the default)")
  g.add_argument("--chat", action="store_true", help="render --prompt as one user turn "
                 "through the model's own chat template (GGUF/Hugging Face metadata)")
  g.add_argument("--no-stop", action="store_true", help="generate --max-new-tokens tokens "
                 "even past the model's stop tokens (EOS, end of turn)")
  g.add_argument("--codec", help=Listed("cache codec for K and V: {codecs}"))
  g.add_argument("--k-codec", help="cache codec for K only (e.g. int8 with --v-codec int4)")
  g.add_argument("--v-codec", help="cache codec for V only")
  g.add_argument("--greedy", action="store_true")
  g.add_argument("--temperature", type=_number("--temperature", "workload.temperature", False))
  g.add_argument("--top-k", type=_number("--top-k", "workload.top_k"))
  g.add_argument("--top-p", type=_number("--top-p", "workload.top_p", False))
  g.add_argument("--seed", type=_number("--seed", "seed"),
                 help="sampling seed (the weights keep the config's seed)")
  g.add_argument("--json", action="store_true")
  _add_set(g)
  _add_distributed(g)
  g.set_defaults(func=cmd_generate)

  r = sub.add_parser("run", help="run an experiment config's grid, appending results rows")
  r.add_argument("file", metavar="FILE.yaml")
  r.add_argument("--out", metavar="DIR", help="results folder (default results/<name>)")
  r.add_argument("--dry-run", action="store_true",
                 help="list the cells and their resolved cache settings; run nothing")
  r.add_argument("--shard", metavar="I/N",
                 help="run the I-th (1-based) of N disjoint parts of the grid into its own "
                 "file in --out (a job array); readers merge the parts")
  _add_set(r)
  _add_distributed(r)
  r.set_defaults(func=cmd_run)

  rs = sub.add_parser("results", help="results rows as a CSV or markdown table",
                      description="Flatten the rows of a results file, or of every *.jsonl "
                      "under a folder, into one table (variant and workload fields, then the "
                      "metrics): CSV in raw units (seconds, bytes) with every column, markdown as printed "
                      "by run, with a compact set of columns unless --columns says.")
  rs.add_argument("path", metavar="DIR_OR_FILE", help="a results folder or .jsonl file")
  rs.add_argument("--format", default="markdown", choices=("csv", "markdown"),
                  help="csv (one table, raw values) or markdown (one table per experiment)")
  rs.add_argument("--experiment", metavar="NAME", help="only the rows of this experiment")
  rs.add_argument("--columns", metavar="A,B,...", help="the columns to show (names as in the "
                  "header, or all); markdown defaults to the fields that tell the rows apart "
                  "and the headline metrics, csv to every column")
  rs.set_defaults(func=cmd_results)

  t = sub.add_parser("train", help="train a model from a config, with orbax checkpoints")
  t.add_argument("file", metavar="FILE.yaml")
  t.add_argument("--out", metavar="DIR", required=True)
  _add_set(t)
  t.set_defaults(func=cmd_train)

  c = sub.add_parser("convert", help="pool a model's K/V heads into fewer (GQA/MQA: mean-pooled, "
                     "aligned, or fitted on calibration text), expand them exactly, or factor "
                     "K/V to a rank-R latent (--latent-rank)")
  csrc = c.add_mutually_exclusive_group(required=True)
  csrc.add_argument("--checkpoint", metavar="DIR")
  csrc.add_argument("--hf", metavar="DIR")
  csrc.add_argument("--gguf", metavar="FILE|NAME")
  c.add_argument("--kv-heads", type=_number("--kv-heads", "model.n_kv_heads"))
  c.add_argument("--latent-rank", type=_number("--latent-rank", _POS), metavar="R",
                 help="factor K/V projections to rank R for the latent (MLA-style) cache "
                 "(--method pool: the weights' SVD; fit: the calibration keys and values, "
                 "then each layer fitted)")
  c.add_argument("--rope-pairs", type=_number("--rope-pairs", (0, True, 1 << 16, True)),
                 default=0, metavar="r",
                 help="with --latent-rank: each KV head keeps r frequency pairs rotated, cached "
                 "beside the latent, and stops rotating the rest, which the latent compresses "
                 "with the values (MLA's decoupled RoPE: the decode reads the latent absorbed); "
                 "--rope-choice says which pairs")
  c.add_argument("--rope-choice", default="high", metavar="high|qk",
                 help="which pairs --rope-pairs keeps rotated: high (the default: the highest "
                 "frequencies, the pairs whose rotation matters over a long context) or qk "
                 "(those with the most |q||k|: pool by the weights, fit on the calibration "
                 "text)")
  c.add_argument("--judge-context", type=_number("--judge-context", (0, True, 1 << 20, True)),
                 default=None, metavar="N",
                 help="after converting, ask the converted model 10 passkeys and 10 needles "
                 "of N tokens through its own cache, recorded in the checkpoint's meta "
                 "(default 1024 where the model has the positions and a tokenizer; 0: skip)")
  c.add_argument("--method", default=None, metavar="pool|align|fit|distill",
                 help="how fewer KV heads are made: pool (mean of each group), align (each "
                 "group's heads rotated onto its first, exactly, then pooled; the default for "
                 "fewer heads where the model has a tokenizer), fit (aligned, "
                 "pooled, then each layer's q/k/v fitted to the original's attention); "
                 "expanding to more heads and --latent-rank default to pool; "
                 "distill trains a converted checkpoint's q/k/v/o end to end toward --teacher's "
                 "next-token distributions (KL on the calibration text)")
  c.add_argument("--teacher", metavar="SOURCE",
                 help="distill's teacher (gguf:NAME, hf:DIR, checkpoint:DIR); default: the "
                 "model the --checkpoint was converted from, as its meta records")
  c.add_argument("--calib", default="stdlib", metavar="TEXT",
                 help="calibration text for align/fit/distill: a named corpus (its training "
                 "documents, never the split eval reads), a file or a folder; several, "
                 "comma-separated, share the tokens equally (stdlib,shakespeare)")
  c.add_argument("--calib-tokens", type=_number("--calib-tokens", (1024, True, 1 << 22, True)),
                 default=16384, metavar="N", help="calibration tokens (windows of --calib-len)")
  c.add_argument("--calib-len", type=_number("--calib-len", (16, True, 1 << 17, True)),
                 default=512, metavar="N", help="tokens per calibration window (default 512, "
                 "or the model's max_seq_len if shorter): a distillation sees no position "
                 "beyond it")
  c.add_argument("--minutes", type=_number("--minutes", (0, False, 10_000, True), integer=False),
                 default=30.0, metavar="M", help="fit's time budget, shared over the layers "
                 "(distill's: the whole run's, resumed runs included)")
  c.add_argument("--steps", type=_number("--steps", _POS), default=2000, metavar="N",
                 help="fit's Adam steps per layer at most (the budget may allow fewer): a "
                 "fixed count makes a fit repeatable on a busy machine; distill's steps in all")
  c.add_argument("--lr", type=_number("--lr", (0, False, 1, True), integer=False), default=None,
                 metavar="LR", help="Adam's peak learning rate (fit: 3e-3, distill: 1e-4); "
                 "lower it to fine-tune a conversion that starts close to the original")
  c.add_argument("--fit-inputs", default="converted", choices=("converted", "original"),
                 help="fit each layer on the converted model's own stream (the inputs it "
                 "will see, carrying the earlier layers' error) or on the original's")
  c.add_argument("--out", metavar="DIR", required=True)
  _add_set(c)
  c.set_defaults(func=cmd_convert)

  e = sub.add_parser("eval", help="perplexity and KL through the cache vs an fp32 cache, or "
                     "vs any reference (--ref)")
  esrc = e.add_mutually_exclusive_group(required=True)
  esrc.add_argument("--config", metavar="FILE.yaml")
  esrc.add_argument("--checkpoint", metavar="DIR")
  esrc.add_argument("--hf", metavar="DIR")
  esrc.add_argument("--gguf", metavar="FILE|NAME")
  e.add_argument("--text", default="stdlib",
                 help="a text file or folder, or a named text: `stdlib` (Python's own sources "
                      "and docs; the default), `shakespeare` (prose and verse; `kvjax models "
                      "fetch shakespeare`), `retrieval` (generated haystacks with their "
                      "questions)")
  e.add_argument("--tokens", type=_number("--tokens", _POS), default=512,
                 help="tokens per window (M)")
  e.add_argument("--seqs", type=_number("--seqs", _POS), default=4,
                 help="windows (B), evenly spaced over the text (the default 4: fewer "
                      "give intervals that may not cover other text); 1 = the first M tokens")
  e.add_argument("--chunk", type=_number("--chunk", _POS), default=1,
                 help="tokens per step (1 = pure decode)")
  e.add_argument("--codec", help=Listed("cache codec for K and V: {codecs}"))
  e.add_argument("--k-codec")
  e.add_argument("--v-codec")
  e.add_argument("--ref", metavar="SETTING|MODEL",
                 help="what the cache is held to (default fp32, the fp32 cache): a codec "
                 "(bf16), cache keys (codec=int4,group_size=32), or another model or "
                 "checkpoint on the same tokenizer (checkpoint:DIR, hf:DIR, gguf:NAME); "
                 "paired Δppl, KL and agreement on the same tokens, with 95 %% intervals")
  e.add_argument("--json", action="store_true", help="print one JSON object")
  _add_set(e)
  e.set_defaults(func=cmd_eval)

  mo = sub.add_parser("models", help="list or fetch the real models kvjax knows by name")
  mo.add_argument("action", nargs="?", choices=("list", "fetch"), default="list")
  mo.add_argument("names", nargs="*", metavar="NAME")
  mo.set_defaults(func=cmd_models)

  pl = sub.add_parser("plot", help="redraw every plot a results folder supports (PNG + SVG)",
                      description="Read every *.jsonl under RESULTS_DIR (results rows of "
                      "`kvjax run`), group the rows by experiment and draw each experiment's "
                      "plots (kvjax/lab/plots/EXPERIMENT.py) into --out; what is not drawn is "
                      "said on stderr, one line each.")
  pl.add_argument("results_dir", metavar="RESULTS_DIR", help="a results folder")
  pl.add_argument("--out", metavar="DIR", default="plots", help="where the files go "
                  "(default plots)")
  pl.set_defaults(func=cmd_plot)
  return p

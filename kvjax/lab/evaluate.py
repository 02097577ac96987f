"""Quality measured *through* the cache.

`stream_logprobs` feeds a sequence chunk by chunk (chunk=1: token by token, exactly like
decode) into a cache of the configured layout and codec; each chunk's positions continue
from `cache.lengths`, so every earlier token is read back from the encoded cache and only
the chunk's own tokens are fresh. With the fp32 cache this equals the teacher-forced full
forward pass (tests/lab/test_quality.py holds the harness to that), so any difference under
another codec is the codec's.

Metrics against a reference on the same tokens (`Reference`: by default the same model with
an fp32 cache; `kvjax eval --ref` and kvjax.lab.compare choose another cache setting or another
model on the same tokenizer, read once per window and reused by every setting,
`eval_settings`):
  ppl        exp(mean next-token NLL) through the tested cache; ppl_ref through fp32
  kl         mean KL(p_ref || p_codec) of the next-token distributions (nats)
  agreement  fraction of positions whose argmax token matches the reference's, along a
             fixed (teacher-forced) continuation, so one early flip spoils nothing after
  recall     accuracy on associative-recall answers (kvjax.lab.data) at a given context
dppl_rel, kl and agreement each come with a 95 % interval (`*_ci95`, [lo, hi]): a t
interval over the windows' paired sums, or with one window a paired bootstrap over its
blocks of 32 contiguous tokens (kvjax.lab.intervals; `ci_method` says which).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax import footprint, inputs, memory, policies
from kvjax.config import Config
from kvjax.decode import generate, step
from kvjax.errors import KvjaxError
from kvjax.lab import data, intervals
from kvjax.model import Transformer


def reference_config(cfg: Config) -> Config:
  """The same model with a plain fp32 contiguous cache: the baseline every codec is held to."""
  ref = dataclasses.replace(cfg, cache=config_lib.CacheConfig(layout="contiguous",
                                                              capacity=cfg.cache.capacity))
  return config_lib.validate(config_lib.resolve(ref))


@functools.partial(jax.jit, static_argnames=("static", "chunk"))
def _stream(params, tokens_BM, valid_BM, cache, *, static, chunk: int):
  """Compiled per config and chunk: `chunk` tokens a step (`kvjax.decode.step.run`) in one scan."""
  B, M = tokens_BM.shape
  toks = tokens_BM.reshape(B, M // chunk, chunk).swapaxes(0, 1)
  valid = valid_BM.reshape(B, M // chunk, chunk).swapaxes(0, 1)
  offs = jnp.arange(chunk, dtype=jnp.int32)

  def one(c, xs):
    tok_BT, valid_BT = xs
    positions = jnp.where(valid_BT, c.lengths[:, None] + offs, -1)
    out = step.run(static, params, tok_BT, positions, c)
    return out.cache, jax.nn.log_softmax(out.logits, axis=-1)

  c, lp = jax.lax.scan(one, cache, (toks, valid))
  return lp.swapaxes(0, 1).reshape(B, M, -1), c


def stream_segments(cfg: Config, params, tokens_BM, chunk: int = 1, segment: int = 256,
                    progress=None, cache=None, keep: bool = False):
  """Yield (start, log-probabilities [B, m, V]) of consecutive segments of the sequence,
  computed through one cache that persists across segments; then (None, cache bytes), or
  (None, the cache itself) with `keep`.

  Each segment is one compiled `lax.scan` over `segment // chunk` steps (the same program
  for every segment), so long windows show progress (`progress` is a tqdm bar or None)
  and the caller never holds more than one segment of test log-probabilities.
  Sequences are right-padded with position -1 (never stored, never attended). `cache`:
  continue that cache (its tokens come before these, positions from its lengths), with
  room for these tokens; else a fresh one.
  """
  tokens_BM = np.asarray(tokens_BM, np.int32)
  B, M = tokens_BM.shape
  if chunk <= 0:
    raise KvjaxError(f"chunk must be positive, got {chunk}")
  if policies.evicts(cfg.cache) and cache is None:
    raise KvjaxError(f"streaming evaluation keeps every token; cache.policy={cfg.cache.policy} "
                     "acts after a prefill: its perplexity is measured by `kvjax run "
                     "configs/frontier_smollm2.yaml` (a compacted context, then scored "
                     "tokens), its retrieval by configs/ruler_qwen.yaml; set "
                     "cache.policy=full here")
  if M > cfg.model.max_seq_len:
    raise KvjaxError(f"{M} tokens exceed model.max_seq_len={cfg.model.max_seq_len}; "
                     "evaluate a shorter context")
  seg = chunk * -(-min(segment, M) // chunk)  # a multiple of chunk covering the segment
  total = seg * -(-M // seg)
  tok = np.pad(tokens_BM, ((0, 0), (0, total - M)))
  valid = np.arange(total)[None, :].repeat(B, 0) < M
  c = cache_lib.init_cache(cfg, B, max(cfg.cache.capacity, M)) if cache is None else cache
  params, kw = step.prepare_params(cfg, params), step.statics(cfg, chunk=chunk)
  for start in range(0, total, seg):
    lp, c = _stream(params, tok[:, start:start + seg], valid[:, start:start + seg], c, **kw)
    if progress is not None:
      progress.update(min(seg, M - start) * B)
    yield start, lp[:, :max(0, min(seg, M - start))]
  yield None, c if keep else cache_lib.tree_bytes(c)


def stream_logprobs(cfg: Config, params, tokens_BM, chunk: int = 1):
  """Log-probabilities [B, M, V] of each next token, computed through the cache.

  Returns (logprobs, cache bytes of the filled cache); see `stream_segments`.
  """
  parts, nbytes = [], 0
  for start, out in stream_segments(cfg, params, tokens_BM, chunk, segment=1 << 30):
    if start is None:
      nbytes = out
    else:
      parts.append(out)
  return jnp.concatenate(parts, axis=1), nbytes


def token_terms(lp_BmV, ref_BmV, nxt_Bn) -> tuple:
  """Per-position numbers of m positions: NLL through the cache and the reference of the
  n <= m next tokens `nxt_Bn` ([B, n]), KL(ref || cache) and argmax matches ([B, m])."""
  return tuple(np.asarray(x, np.float64) for x in _token_terms(lp_BmV, ref_BmV, nxt_Bn))


@jax.jit
def _token_terms(lp_BmV, ref_BmV, nxt_Bn):  # one program: no full-vocabulary temporary
  idx = nxt_Bn[..., None]
  n = idx.shape[1]
  nll = -jnp.take_along_axis(lp_BmV[:, :n], idx, -1)[..., 0]
  nll_ref = -jnp.take_along_axis(ref_BmV[:, :n], idx, -1)[..., 0]
  kl = jnp.sum(jnp.exp(ref_BmV) * (ref_BmV - lp_BmV), -1)
  agree = jnp.argmax(lp_BmV, -1) == jnp.argmax(ref_BmV, -1)
  return nll, nll_ref, kl, agree


def metrics_of(nll_Bm, nll_ref_Bm, kl_BM, agree_BM) -> dict:
  """ppl, ppl_ref, dppl_rel, kl, agreement of per-position numbers (`token_terms`), each
  with its 95 % interval (`kvjax.lab.intervals`, `ci_method`)."""
  ppl, ppl_ref = float(np.exp(np.mean(nll_Bm))), float(np.exp(np.mean(nll_ref_Bm)))
  return {"ppl": ppl, "ppl_ref": ppl_ref, "dppl_rel": ppl / ppl_ref - 1.0,
          "kl": max(float(np.mean(kl_BM)), 0.0), "agreement": float(np.mean(agree_BM)),
          **intervals.quality_ci(nll_Bm, nll_ref_Bm, kl_BM, agree_BM)}


class Comparison:
  """`compare` accumulated segment by segment against a stored fp32-cache reference, so a
  long evaluation never holds the test log-probabilities whole (only per-position
  numbers, for the intervals)."""

  def __init__(self, ref_BMV, tokens_BM):
    self.ref, self.tokens = ref_BMV, np.asarray(tokens_BM)
    self.parts: list = []

  def add(self, start: int, lp_BmV) -> None:
    """One segment: the log-probabilities of m of the M positions, from `start`."""
    m = lp_BmV.shape[1]
    ref = jnp.asarray(self.ref[:, start:start + m])
    nxt = self.tokens[:, start + 1:start + m + 1]  # targets; the window's last position has none
    self.parts.append(token_terms(lp_BmV, ref, nxt))

  def result(self) -> dict:
    return metrics_of(*(np.concatenate(x, axis=1) for x in zip(*self.parts)))


def compare_streamed(cfg: Config, params, tokens_BM, ref_BMV, chunk: int = 1,
                     progress=None) -> tuple[dict, int]:
  """(`compare` metrics, cache bytes) of `cfg`'s cache against stored reference logprobs."""
  acc, nbytes = Comparison(ref_BMV, tokens_BM), 0
  for start, out in stream_segments(cfg, params, tokens_BM, chunk, progress=progress):
    if start is None:
      nbytes = out
    else:
      acc.add(start, out)
  return acc.result(), nbytes


def reference_logprobs(cfg: Config, params, tokens_BM, chunk: int = 1, progress=None):
  """Log-probabilities through the fp32 contiguous cache, as a host array [B, M, V]."""
  return host_logprobs(reference_config(cfg), params, tokens_BM, chunk, progress)


def host_logprobs(cfg: Config, params, tokens_BM, chunk: int = 1, progress=None):
  """Log-probabilities through `cfg`'s own cache (a reference), as a host array [B, M, V]."""
  parts = [np.asarray(out) for start, out in stream_segments(
      cfg, params, tokens_BM, chunk, progress=progress) if start is not None]
  return np.concatenate(parts, axis=1)


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def full_logprobs(params, tokens_BM, *, model_cfg):
  """Teacher-forced full forward pass (no cache): the exactness reference."""
  B, M = tokens_BM.shape
  pos = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
  logits, _ = Transformer(model_cfg).apply({"params": params}, tokens_BM, pos, None)
  return jax.nn.log_softmax(logits, axis=-1)


def nll(logprobs_BMV, tokens_BM) -> float:
  """Mean next-token NLL: prediction at t scores token t+1."""
  lp = jnp.take_along_axis(logprobs_BMV[:, :-1], jnp.asarray(tokens_BM)[:, 1:, None], axis=-1)
  return float(-jnp.mean(lp))


def compare(lp_BMV, ref_BMV, tokens_BM) -> dict:
  """ppl, ppl_ref, kl (mean KL(ref || test)), agreement, and the relative Δppl, each with
  its 95 % interval (`metrics_of`)."""
  return metrics_of(*token_terms(lp_BMV, ref_BMV, np.asarray(tokens_BM)[:, 1:]))


def recall_accuracy(cfg: Config, params, batch_BM, mask_BM, chunk: int = 1) -> float:
  """Fraction of recall answers the model predicts (argmax) reading the cache."""
  lp, _ = stream_logprobs(cfg, params, batch_BM, chunk)
  pred = np.asarray(jnp.argmax(lp[:, :-1], -1))
  hit = pred == np.asarray(batch_BM)[:, 1:]
  m = np.asarray(mask_BM)[:, 1:]
  return float(hit[m].mean())


def recall_set(seed: int, n: int, context: int, n_pairs: int, filler: np.ndarray):
  """A fixed recall evaluation set (same seed, same sequences for every codec)."""
  rng = np.random.default_rng([seed, context, n_pairs])
  return data.recall_batch(rng, n, context, n_pairs, n_pairs, filler)


def greedy_tokens(cfg: Config, params, prompts: list[list[int]], gen_len: int) -> list:
  """Free-running greedy decode through `cfg`'s cache (no eos: fixed length)."""

  greedy = config_lib.apply_overrides(cfg, {"workload.temperature": 0.0, "workload.eos_id": -1})
  return generate.generate(greedy, params, prompts, gen_len, timed=False)["tokens"]


def generation_agreement(tokens: list, ref_tokens: list) -> float:
  """Fraction of generated tokens equal, position by position, to the fp32 cache's."""
  same = [np.mean(np.array(a) == np.array(b)) for a, b in zip(tokens, ref_tokens)]
  return float(np.mean(same))


# -- kvjax eval ---------------------------------------------------------------------------
EVAL_FLAGS = ("--tokens", "--seqs", "--text")


def text_windows(tok, text: str, n_tokens: int, seqs: int,
                 names: tuple = EVAL_FLAGS) -> np.ndarray:
  """[seqs, n_tokens] token windows of `text`: the first n_tokens when seqs == 1, else
  `seqs` evenly spaced windows (the same every call). `names` are the flags or keys that
  set n_tokens, seqs and the text (messages name what the user wrote)."""
  if n_tokens < 2:
    raise KvjaxError(f"{names[0]} must be >= 2 (a token and the next one), got {n_tokens}")
  if seqs < 1:
    raise KvjaxError(f"{names[1]} must be >= 1, got {seqs}")
  # tokenize only as much text as the windows need (BPE runs about 4 characters a token)
  need = n_tokens * seqs * 6 + 1024
  ids = np.asarray(tok.encode(text[:need] if seqs == 1 else text), np.int32)
  if len(ids) < n_tokens:
    ids = np.asarray(tok.encode(text), np.int32)
  if len(ids) < n_tokens:
    raise KvjaxError(f"the text holds {len(ids)} tokens, fewer than {names[0]} {n_tokens}; "
                     f"lower {names[0]} or pass a longer {names[2]}")
  if seqs == 1:
    return ids[None, :n_tokens]
  return data.eval_windows(ids, seqs, n_tokens - 1)


def eval_cli(src, overrides: dict, text: str = "stdlib", tokens: int = 512, seqs: int = 4,
             chunk: int = 1, progress: bool = True) -> dict:
  """`kvjax eval`: the configured cache against an fp32 contiguous cache, same tokens."""
  from kvjax.io import sources

  text_source = eval_inputs(text, tokens, seqs, chunk)  # before any weight loads
  check_tokens(tokens, sources.load_config(src, overrides).model.max_seq_len)  # (no weights)
  cfg, params, tok = sources.load(src, overrides)
  return eval_loaded(cfg, params, tok, src, text, tokens, seqs, chunk, progress, text_source)


def eval_inputs(text: str, tokens: int, seqs: int, chunk: int) -> str:
  """The eval text (a missing or empty --text refused) after the window flags' checks
  (kvjax.inputs, shared with the Python API)."""
  inputs.windows(tokens, seqs, chunk)
  return data.eval_text(text)


def check_tokens(tokens: int, max_len: int) -> None:
  if tokens > max_len:
    raise KvjaxError(f"--tokens {tokens} exceeds model.max_seq_len={max_len}; lower --tokens")


@dataclasses.dataclass(frozen=True)
class Reference:
  """What a cache is held to (`kvjax eval --ref`, `Model.evaluate(ref=...)`): a config and
  weights read on the same tokens (a cache setting of the same model, or another model or
  checkpoint on the same tokenizer), and how results name it (`ppl_ref` is its perplexity)."""

  cfg: Config
  params: object
  label: str = "fp32 cache"
  kind: str = "cache"  # "cache": a setting of the same model; "model": other weights


def fp32_reference(cfg: Config, params) -> Reference:
  """The default reference: the same model with a plain fp32 contiguous cache."""
  return Reference(reference_config(cfg), params)


def eval_loaded(cfg: Config, params, tok, src, text: str, tokens: int, seqs: int, chunk: int,
                progress: bool, text_source: str, ref: Reference | None = None) -> dict:
  """`kvjax eval` on a loaded model (the Python API's `Model.evaluate` calls it too)."""
  return eval_settings({"": cfg}, params, tok, src, text, tokens, seqs, chunk, progress,
                       text_source, ref)[""]


def eval_settings(cfgs: dict, params, tok, src, text: str, tokens: int, seqs: int, chunk: int,
                  progress: bool, text_source: str, ref: Reference | None = None) -> dict:
  """`eval_loaded` of several cache settings of one model (name -> config) against one
  reference (default: its fp32 cache), whose log-probabilities are computed once, on the
  same windows, and reused for every setting: {name: result}."""
  from tqdm import tqdm

  if tok is None:
    raise KvjaxError("this model has no tokenizer, so it cannot read --text; use a model "
                     "with one (--gguf, --hf, or a config with tokenizer: bytes)")
  windows = text_windows(tok, text_source, tokens, seqs)
  B, M = windows.shape
  first = next(iter(cfgs.values()))
  ref = ref or fp32_reference(first, params)
  for c in cfgs.values():
    memory.check(c, B, M, chunk, what="this eval")  # two caches of M slots, as generate's
  params = step.prepare_params(first, params)  # once for every pass (they reuse it as is)
  ref_params = params if ref.kind == "cache" else ref.params
  warnings = [w for w in (intervals.few_blocks(M, B), intervals.few_windows(B)) if w]
  out = {}
  with tqdm(total=(1 + len(cfgs)) * B * M, desc="eval", unit="tok",
            disable=None if progress else True, leave=False) as bar:
    ref_lp = host_logprobs(ref.cfg, ref_params, windows, chunk, progress=bar)
    for name, cfg in cfgs.items():
      metrics, nbytes = compare_streamed(cfg, params, windows, ref_lp, chunk, progress=bar)
      out[name] = _record(cfg, metrics, nbytes, src, text, B, M, chunk, ref, warnings)
  return out


def _record(cfg: Config, metrics: dict, nbytes: int, src, text: str, B: int, M: int,
            chunk: int, ref: Reference, warnings: list) -> dict:
  c, m = cfg.cache, cfg.model
  # what the cache held for these windows (= nbytes / B), and the long-context cost beside it
  sized = footprint.count(cfg, M, batch=B).fields()
  window = footprint.window_warning(cfg, M)
  return {**metrics, **sized, "cache_bytes": nbytes, "tokens": M,
          "seqs": B, "chunk": chunk, "text": text, "source": str(src),
          "ref": ref.label, "ref_kind": ref.kind,
          "variant": m.variant, "layout": c.layout, "k_codec": c.k_codec, "v_codec": c.v_codec,
          "k_axis": c.k_axis, "group_size": c.group_size, "residual": c.residual,
          "warnings": ([window] if window else []) + list(warnings)}

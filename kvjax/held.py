"""What a cache setting holds: the one count of cache bytes every report uses.

    h = held.count(cfg, context)            # one sequence after `context` tokens
    h.bytes, h.per_token, h.asymptotic, h.bits_per_element, h.fields()

`bytes` is what the cache pytree of that setting holds for one sequence (the sum of its
leaves, `cache.tree_bytes`, divided by the batch): the layout's `closed_form_bytes` at the
capacity the cache is built with, so everything the tree holds is in it: codes, scales and
zeros, the full-precision residual window (`cache.residual`, allocated whole even before it
fills), the quantized history rounded up to whole key blocks, pages rounded up to whole
pages (a configured `cache.num_pages` pool is shared out evenly), a policy's budget in
place of the context (`cache.policy`: the compacted layouts) with its per-token state
(h2o's scores, `Policy.state_bytes_per_token`), and the int32 lengths / block tables.

`per_token` = bytes / context: what a user sees as "bytes per token" at that context.
`asymptotic` is the cost of one more stored token in the limit of a long context (K + V
codes and scales over all layers, plus the policy's state): what `per_token` tends to as the
window, the rounding and the fixed metadata amortise away (for a policy, per *held* token).
`bits_per_element` = 8 x per_token / (layers x 2 x KV heads x head_dim): the all-in bits
of issue-28's targets.

A window holding more than a quarter of the tokens evaluated makes `per_token` far from
`asymptotic`; `window_warning` says so in one line.
"""

from __future__ import annotations

import dataclasses

from kvjax.config import Config

WINDOW_SHARE = 0.25  # a window holding more than this share of the tokens is warned about


@dataclasses.dataclass(frozen=True)
class Held:
  """Cache bytes of one sequence of a setting at one context (see the module docstring)."""

  context: int       # tokens the sequence has seen
  tokens: int        # tokens the cache keeps (a policy's budget, else the context)
  bytes: float       # what the cache tree holds for this sequence
  asymptotic: float  # bytes per stored token in the long-context limit
  elements: int      # K/V elements one token has across layers (L x 2 x K x D)
  layout: str        # the layout that holds the tokens

  @property
  def per_token(self) -> float:
    return self.bytes / self.context

  @property
  def bits_per_element(self) -> float:
    return 8 * self.per_token / self.elements

  def fields(self) -> dict:
    """The row / --json fields: `bytes_per_token` (held at this context),
    `bytes_per_token_asymptotic`, `bits_per_element` (all-in) and `held_bytes`."""
    return {"bytes_per_token": self.per_token, "bytes_per_token_asymptotic": self.asymptotic,
            "bits_per_element": self.bits_per_element, "held_bytes": self.bytes}


def layout_name(cfg: Config) -> str:
  """The layout that holds the tokens: a cache.policy's compacted one, else cache.layout."""
  if cfg.cache.policy != "full":
    return "paged_compacted" if cfg.cache.layout == "paged" else "compacted"
  return cfg.cache.layout


def asymptotic(cfg: Config) -> float:
  """Bytes one more stored token costs over all layers, long-context limit."""
  from kvjax import codecs, policies
  m, c = cfg.model, cfg.cache
  if c.layout == "none" and c.policy == "full":
    return 4.0  # the token id, recomputed into K/V at every step
  k, v = codecs.for_role(c.k_codec, c, "k"), codecs.for_role(c.v_codec, c, "v")
  if c.layout == "latent":
    return m.n_layers * k.bytes_per_token(1, m.latent_rank)
  state = policies.get(c.policy).state_bytes_per_token(m.n_kv_heads)
  return m.n_layers * (k.bytes_per_token(m.n_kv_heads, m.D)
                       + v.bytes_per_token(m.n_kv_heads, m.D) + state)


def count(cfg: Config, context: int, batch: int = 1, capacity: int = 0) -> Held:
  """What one of `batch` sequences holds after `context` tokens; the cache is built for
  `max(capacity, cache.capacity, context)` tokens (a policy: for the tokens it keeps)."""
  from kvjax import cache
  from kvjax.cache import compact
  if context <= 0:
    from kvjax.errors import KvjaxError
    raise KvjaxError(f"a context of {context} tokens holds nothing; use a positive context")
  kept = compact.held_tokens(cfg.cache, context)
  cap = kept if cfg.cache.policy != "full" else max(capacity, cfg.cache.capacity, context)
  name = layout_name(cfg)
  spec = cache.CacheSpec.from_config(cfg, batch, cap)
  m = cfg.model
  return Held(context=context, tokens=kept,
              bytes=cache.LAYOUTS[name].closed_form_bytes(spec) / batch,
              asymptotic=asymptotic(cfg), elements=m.n_layers * 2 * m.n_kv_heads * m.D,
              layout=name)


def window_warning(cfg: Config, tokens: int) -> str | None:
  """One line when the residual window holds more than a quarter of `tokens`, else None."""
  R = cfg.cache.residual
  if not R or R <= WINDOW_SHARE * tokens:
    return None
  h = count(cfg, tokens)
  return (f"cache.residual={R} keeps {min(R, tokens)} of the {tokens} tokens evaluated in full "
          f"precision: {h.per_token:,.0f} B/token held at this context against "
          f"{h.asymptotic:,.0f} B/token in the long-context limit; evaluate at least "
          f"{int(R / WINDOW_SHARE)} tokens to measure the quantized cache")

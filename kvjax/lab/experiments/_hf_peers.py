"""The transformers (torch) side of the peer experiment (kvjax/lab/experiments/peer.py): the
shared random checkpoint, a GGUF file's weights read by transformers, the `generate` and
filled-cache timers with `kvjax.lab.timers.DecodeTimer`'s `once()` interface, and the thread
pinning that gives torch and XLA the same cores. Not an experiment itself (the leading
underscore keeps it off `kvjax run`'s list)."""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvjax import config as config_lib


# -- the shared checkpoint ------------------------------------------------------------------
def build_checkpoint(cfg: config_lib.Config, folder: str):
  """A random Llama of cfg.model's shape, saved as safetensors; returns the torch model.

  Weights are normal(0, 1.6 / sqrt(d_model)) rather than HF's 0.02 so that logits are
  spread out and greedy decoding does not sit on near-ties (agreement is then meaningful).
  """
  import torch
  import transformers

  m = cfg.model
  hf_cfg = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.F,
      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
      num_key_value_heads=m.n_kv_heads, head_dim=m.D, rms_norm_eps=m.norm_eps,
      max_position_embeddings=m.max_seq_len, tie_word_embeddings=m.tie_embeddings,
      rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  torch.manual_seed(cfg.seed)
  model = transformers.LlamaForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim > 1:
        p.normal_(0.0, 1.6 / m.d_model ** 0.5)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  model.save_pretrained(folder)
  return model


@functools.lru_cache(maxsize=1)
def gguf_models(path: str):
  """A GGUF file's weights on both sides, loaded once per process (cells share them):
  kvjax through `kvjax.io.gguf.load`, transformers through its own GGUF reader
  (`from_pretrained(gguf_file=)`), each dequantizing to float32."""
  import transformers

  from kvjax.io import gguf

  loaded, params = gguf.load(path)
  p = Path(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name)
  model.eval()
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return loaded, params, model


# -- transformers timers ----------------------------------------------------------------------
class HFTimer:
  """`model.generate` for one cache implementation, with the same `once()` interface as
  `kvjax.lab.timers.DecodeTimer`: returns (ttft_s, tpot_s)."""

  def __init__(self, model, tokens_BT: np.ndarray, gen_len: int, kind: str):
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    self.model, self.kind, self.gen_len = model, kind, gen_len
    self.steps = gen_len - 1
    self.ids = torch.tensor(tokens_BT, dtype=torch.long)
    self.mask = torch.ones_like(self.ids)
    timer = self

    class FirstToken(StoppingCriteria):
      def __call__(self, input_ids, scores, **kwargs):
        if timer._t_first is None:
          timer._t_first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    self._stop = StoppingCriteriaList([FirstToken()])
    self._t_first = None
    self._static = None
    self.cache_bytes = None
    self.tokens = None
    t0 = time.perf_counter()
    self.once()  # first call: lazy initialisation (and the static cache's allocation)
    self.compile_s = time.perf_counter() - t0

  def _kwargs(self) -> dict:
    if self.kind == "dynamic":
      return {"cache_implementation": "dynamic"}
    if self.kind == "static":
      from transformers import StaticCache
      if self._static is None:
        self._static = StaticCache(config=self.model.config,
                                   max_cache_len=self.ids.shape[1] + self.gen_len)
      else:
        self._static.reset()
      return {"cache": self._static}
    return {"cache_implementation": "quantized",
            "cache_config": {"backend": "quanto", "nbits": 4, "q_group_size": 32,
                             "residual_length": 128}}

  def once(self) -> tuple[float, float]:
    import torch

    with torch.inference_mode():
      kwargs = self._kwargs()  # outside the timed region (static: reset of the cache)
      self._t_first = None
      t0 = time.perf_counter()
      out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=self.gen_len,
                                min_new_tokens=self.gen_len, do_sample=False,
                                stopping_criteria=self._stop, return_dict_in_generate=True,
                                **kwargs)
      t2 = time.perf_counter()
    self.tokens = out.sequences[:, self.ids.shape[1]:].numpy()
    # transformers 5.24 (here) names the returned cache `cache`; 5.17 (the GPU machine's)
    # `past_key_values`.
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    self.cache_bytes = _torch_cache_bytes(cache)
    return self._t_first - t0, (t2 - self._t_first) / self.steps


def _torch_cache_bytes(cache) -> int | None:
  """Bytes of the plain tensors a transformers cache holds (None for quantized layers)."""
  total = 0
  for layer in getattr(cache, "layers", []):
    if hasattr(layer, "_quantized_keys"):
      return None
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
      if t is not None and hasattr(t, "element_size"):
        total += t.numel() * t.element_size()
  return total or None


class HFFilledTimer:
  """transformers' decode loop (`model(...)` with `past_key_values`, greedy, one token a
  step, as `generate` runs it) from a DynamicCache or StaticCache already holding `context`
  zero tokens per sequence: (nan, tpot_s). The first input token is 0, as kvjax's."""

  def __init__(self, model, batch: int, context: int, steps: int, kind: str):
    import torch
    from transformers import DynamicCache, StaticCache

    self.model, self.B, self.context, self.steps, self.kind = model, batch, context, steps, kind
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    self._kv = torch.zeros(batch, c.num_key_value_heads, context, head_dim)
    # a model with sliding-window layers (Gemma 3) keeps no past beyond the window in
    # those layers, so its DynamicCache cannot be cropped back: it is made anew instead
    self._windowed = bool(getattr(c, "sliding_window", None)) and \
        "sliding_attention" in (getattr(c, "layer_types", None) or ())
    self._new = (lambda: DynamicCache(config=c)) if kind == "dynamic" else \
        (lambda: StaticCache(config=c, max_cache_len=context + steps + 1))
    self.cache = self._new()
    self._fill()
    self.cache_bytes = None
    self.tokens = None
    t0 = time.perf_counter()
    self.once()
    self.compile_s = time.perf_counter() - t0

  def _fill(self):
    for layer in range(self.model.config.num_hidden_layers):
      self.cache.update(self._kv, self._kv, layer)

  def once(self) -> tuple[float, float]:
    import torch

    # Back to the filled context, outside the timed region.
    extra = self.cache.get_seq_length() - self.context
    if self.kind == "dynamic" and extra > 0 and not self._windowed:
      self.cache.crop(-extra)
    elif self.kind == "dynamic" and extra > 0:
      self.cache = self._new()
      self._fill()
    elif extra > 0:
      self.cache.reset()
      self._fill()
    tok = torch.zeros(self.B, 1, dtype=torch.long)
    out = [tok]
    with torch.inference_mode():
      t0 = time.perf_counter()
      for i in range(self.steps):
        pos = torch.tensor([self.context + i])
        logits = self.model(tok, past_key_values=self.cache, cache_position=pos,
                            use_cache=True).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
      t1 = time.perf_counter()
    self.tokens = torch.cat(out, 1).numpy()
    return float("nan"), (t1 - t0) / self.steps


# -- threads ---------------------------------------------------------------------------------
@contextmanager
def same_threads(n: int):
  """Give torch and XLA the same `n` cores: torch by thread count, XLA (whose pool is
  sized at start-up) by pinning the process to n cores. 0 = all cores we may use."""
  import torch

  old_aff, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
  cores = sorted(old_aff)
  n = min(n or len(cores), len(cores))
  os.sched_setaffinity(0, cores[:n])
  torch.set_num_threads(n)
  try:
    yield n
  finally:
    os.sched_setaffinity(0, old_aff)
    torch.set_num_threads(old_threads)


def hf_model_threads() -> int:
  import torch
  return torch.get_num_threads()


def param_count(model) -> int:
  return sum(p.numel() for p in model.parameters())

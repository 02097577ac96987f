"""What the two faces share, kept out of the library: the command line (`kvjax generate`,
kvjax.cli.commands) and the Python API (`kvjax.Model.generate`) both read a prompt with
`prompts` (text or ids to token ids, through the model's chat template with `chat`) and
run it with `report` (the memory check, `kvjax.decode.generate.generate`, the result the
CLI prints as JSON and the API wraps), so a prompt, a check and a result are the same
whichever face asked. A bad argument is an `ArgError` naming the Python keyword; the CLI
says it with its flag. `parse_ids` and `read_prompt` read the command line's own prompt
flags (`--prompt-ids`, `--prompt-file`).
"""

from __future__ import annotations

from pathlib import Path

from kvjax import inputs
from kvjax.errors import ArgError, KvjaxError, as_arg


def parse_ids(items: list[str]) -> list[list[int]]:
  """`--prompt-ids 1,2,3` items as one id list each."""
  prompts = []
  for item in items:
    try:
      prompts.append([int(x) for x in item.replace(" ", "").split(",") if x])
    except ValueError:
      raise KvjaxError(f"--prompt-ids expects comma-separated integers, got '{item}'") from None
  return prompts


def read_prompt(path: str) -> str:
  """A `--prompt-file`'s text (UTF-8); a missing, unreadable or undecodable file is one line."""
  try:
    raw = Path(path).read_bytes()
  except OSError as e:
    raise KvjaxError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise KvjaxError(f"--prompt-file {path} is not UTF-8 text (byte {e.start}); convert it "
                     "or pass token ids with --prompt-ids") from None
  if not text:
    raise KvjaxError(f"--prompt-file {path} is empty; give it the prompt's text")
  return text


def prompts(tok, text: str | None = None, ids: list[list[int]] | None = None,
            chat: bool = False) -> list[list[int]]:
  """Token ids of one text prompt (rendered as one user turn by the model's chat template
  with `chat`) or of the id lists given."""
  if text is not None:
    as_arg("prompt", inputs.text, text)  # undecodable bytes: one line, not a traceback
    if tok is None:
      raise ArgError("prompt", "this model has no tokenizer; give token ids as {arg}, not text",
                     cli="this model has no tokenizer; pass --prompt-ids 1,2,3 instead of "
                         "--prompt")
    if not chat:
      return [tok.encode(text)]
    from kvjax.io import chat as chat_lib
    rendered = chat_lib.render(tok.chat, [{"role": "user", "content": text}])
    return [tok.encode(rendered, bos=False)]
  if ids:
    if chat:
      raise ArgError("chat", "{arg} renders a text prompt; give text, not token ids",
                     cli="--chat renders a text prompt; give --prompt TEXT, not --prompt-ids")
    return [list(map(int, p)) for p in ids]
  raise ArgError("prompt", "give a prompt: text or token ids as {arg}",
                 cli="give a prompt: --prompt TEXT or --prompt-ids 1,2,3")


def report(cfg, params, tok, src, prompt_ids: list[list[int]], max_new_tokens: int,
           seed: int | None = None, stop: bool = True, chat: bool = False,
           warm: bool = False) -> dict:
  """Generate and describe the run: tokens (and text), cache bytes, timings, the variant.
  `stop`: end each sequence at the model's first stop token (else `workload.eos_id` only).
  `warm`: a warm-up run before the timed one (False, the default: one run, its timings
  including first-execution costs, and a long prompt prefilled once)."""
  from kvjax import memory
  from kvjax.decode.generate import generate

  if prompt_ids and all(prompt_ids) and max_new_tokens > 0:  # else generate names the problem
    capacity = cfg.cache.capacity or max(map(len, prompt_ids)) + max_new_tokens
    memory.check(cfg, len(prompt_ids), capacity, max(map(len, prompt_ids)),
                 what="this generate")
  stops = sorted(getattr(tok, "stop_ids", ())) if stop and tok is not None else []
  # `seed` seeds sampling only; the weights of a config model come from its `seed` key.
  out = generate(cfg, params, prompt_ids, max_new_tokens, seed=seed, stop=stops, timed=warm)
  result = {"tokens": out["tokens"]}
  if tok is not None:
    result["text"] = [tok.decode(t) for t in out["tokens"]]
  result.update({k: out[k] for k in ("cache_bytes", "cache_bytes_per_device", "ttft_s", "tpot_s",
                                     "compile_s", "capacity")})
  result["warm"] = warm  # False: ttft_s and tpot_s include first-execution costs
  result["mesh"] = {"data": cfg.mesh.data, "model": cfg.mesh.model}
  result.update({"variant": cfg.model.variant, "layout": cfg.cache.layout,
                 "policy": cfg.cache.policy,
                 "k_codec": cfg.cache.k_codec, "v_codec": cfg.cache.v_codec,
                 "batch": len(prompt_ids), "source": str(src),
                 # only a config's model is initialised here; every other source read weights
                 "random_weights": src.kind == "config",
                 "chat": chat, "stop_ids": stops})
  return result

"""`kvjax generate` on a loaded model: prompts to ids (through the model's chat template with
`chat`), the memory check, `program.generate`, and the result the CLI prints as JSON.

The command line (`kvjax.cli.commands.cmd_generate`) and the Python API
(`kvjax.Model.generate`) both call `prompts` and `report`, so a prompt, a check and a
result are the same whichever face asked. Generation stops at the model's stop tokens (its
EOS and end-of-turn ids, kvjax.io.chat) unless `stop=False`.
"""

from __future__ import annotations

from kvjax import inputs
from kvjax.errors import KvjaxError


def parse_ids(items: list[str]) -> list[list[int]]:
  """`--prompt-ids 1,2,3` items as one id list each."""
  prompts = []
  for item in items:
    try:
      prompts.append([int(x) for x in item.replace(" ", "").split(",") if x])
    except ValueError:
      raise KvjaxError(f"--prompt-ids expects comma-separated integers, got '{item}'") from None
  return prompts


def prompts(tok, text: str | None = None, ids: list[list[int]] | None = None,
            chat: bool = False) -> list[list[int]]:
  """Token ids of one text prompt (rendered as one user turn by the model's chat template
  with `chat`) or of the id lists given."""
  if text is not None:
    inputs.text("--prompt", text)  # undecodable command-line bytes: one line, not a traceback
    if tok is None:
      raise KvjaxError("this model has no tokenizer; pass --prompt-ids 1,2,3 instead of --prompt")
    if not chat:
      return [tok.encode(text)]
    from kvjax.io import chat as chat_lib
    rendered = chat_lib.render(tok.chat, [{"role": "user", "content": text}])
    return [tok.encode(rendered, bos=False)]
  if ids:
    if chat:
      raise KvjaxError("--chat renders a text prompt; give --prompt TEXT, not --prompt-ids")
    return [list(map(int, p)) for p in ids]
  raise KvjaxError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")


def report(cfg, params, tok, src, prompt_ids: list[list[int]], max_new_tokens: int,
           seed: int | None = None, stop: bool = True, chat: bool = False) -> dict:
  """Generate and describe the run: tokens (and text), cache bytes, timings, the variant.
  `stop`: end each sequence at the model's first stop token (else `workload.eos_id` only)."""
  from kvjax import memory, program

  if prompt_ids and all(prompt_ids) and max_new_tokens > 0:  # else generate names the problem
    capacity = cfg.cache.capacity or max(map(len, prompt_ids)) + max_new_tokens
    memory.check(cfg, len(prompt_ids), capacity, max(map(len, prompt_ids)),
                 what="this generate")
  stops = sorted(getattr(tok, "stop_ids", ())) if stop and tok is not None else []
  # `seed` seeds sampling only; the weights of a config model come from its `seed` key.
  out = program.generate(cfg, params, prompt_ids, max_new_tokens, seed=seed, stop=stops)
  result = {"tokens": out["tokens"]}
  if tok is not None:
    result["text"] = [tok.decode(t) for t in out["tokens"]]
  result.update({k: out[k] for k in ("cache_bytes", "cache_bytes_per_device", "ttft_s", "tpot_s",
                                     "compile_s", "capacity")})
  result["mesh"] = {"data": cfg.mesh.data, "model": cfg.mesh.model}
  result.update({"variant": cfg.model.variant, "layout": cfg.cache.layout,
                 "policy": cfg.cache.policy,
                 "k_codec": cfg.cache.k_codec, "v_codec": cfg.cache.v_codec,
                 "batch": len(prompt_ids), "source": str(src),
                 # only a config's model is initialised here; every other source read weights
                 "random_weights": src.kind == "config",
                 "chat": chat, "stop_ids": stops})
  return result

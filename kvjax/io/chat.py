"""A model's own chat template and stop tokens, read from its metadata.

    info = chat.from_gguf(meta, tokens)     # `tokenizer.chat_template`, eos/eot/eom ids
    info = chat.from_hf(folder, tok)        # tokenizer_config.json, generation_config.json
    text = chat.render(info, [{"role": "user", "content": "Hi"}])

Templates are Jinja, as the model's authors wrote them; they are rendered in jinja2's
immutable sandbox (no attribute writes, no access to Python internals), with the
variables such templates expect: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, and the `raise_exception` function. A template that does not parse or fails
while rendering is one line naming the model and the first problem.

Stop tokens are a set: the end-of-sequence id and every end-of-turn id the metadata
names (GGUF `tokenizer.ggml.eos_token_id`, `eot_token_id`, `eom_token_id`; Hugging Face
`eos_token_id` in generation_config.json or config.json, an id or a list, and
tokenizer_config.json's `eos_token`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvjax.config import jsonfile
from kvjax.errors import KvjaxError

GGUF_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                  "tokenizer.ggml.eom_token_id")


@dataclasses.dataclass(frozen=True)
class ChatInfo:
  """What a model's metadata says about chat: its template (None: it has none), the ids
  that end a reply, and the BOS/EOS strings a template may print."""

  template: str | None = None
  stop_ids: frozenset = frozenset()
  bos_token: str = ""
  eos_token: str = ""
  origin: str = "the model"


def from_gguf(meta: dict, id_to_token, origin: str = "the GGUF file") -> ChatInfo:
  """Template and stop ids of a GGUF file's metadata; `id_to_token(int) -> str | None`
  (ids outside the vocabulary are dropped)."""
  def token(i) -> str:
    ok = isinstance(i, int) and not isinstance(i, bool) and i >= 0
    return (id_to_token(i) or "") if ok else ""
  stops = {meta[k] for k in GGUF_STOP_KEYS if token(meta.get(k))}
  template = meta.get("tokenizer.chat_template")
  return ChatInfo(template if isinstance(template, str) and template else None,
                  frozenset(stops), token(meta.get("tokenizer.ggml.bos_token_id")),
                  token(meta.get("tokenizer.ggml.eos_token_id")), origin)


def _read_json(path: Path) -> dict:
  if not path.exists():
    return {}
  data = jsonfile.read(path, "tokenizer file", "fix or remove it")
  return data if isinstance(data, dict) else {}


def _content(value) -> str:
  """tokenizer_config.json writes a token as a string or as {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else ""


def _ids(value) -> set[int]:
  items = value if isinstance(value, list) else [value]
  return {i for i in items if isinstance(i, int) and not isinstance(i, bool) and i >= 0}


def from_hf(folder: str | Path, token_to_id) -> ChatInfo:
  """Template and stop ids of a Hugging Face folder; `token_to_id(str) -> int | None`."""
  folder = Path(folder)
  tc = _read_json(folder / "tokenizer_config.json")
  template = tc.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  stops = set()
  for name in ("generation_config.json", "config.json"):
    stops |= _ids(_read_json(folder / name).get("eos_token_id"))
  eos, bos = _content(tc.get("eos_token")), _content(tc.get("bos_token"))
  if eos and token_to_id(eos) is not None:
    stops.add(token_to_id(eos))
  return ChatInfo(template if isinstance(template, str) and template else None,
                  frozenset(stops), bos, eos, str(folder))


def _raise(message):
  raise KvjaxError(f"the chat template refused the messages: {message}")


def render(info: ChatInfo | None, messages: list[dict],
           add_generation_prompt: bool = True) -> str:
  """The prompt text the model's template makes of `messages` ({role, content} dicts)."""
  import jinja2
  from jinja2 import sandbox

  if info is None or info.template is None:
    raise KvjaxError(f"{info.origin if info else 'this model'} has no chat template; drop "
                     "--chat (chat=False) and write the prompt yourself")
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = _raise
  try:
    template = env.from_string(info.template)
  except jinja2.TemplateSyntaxError as e:
    raise KvjaxError(f"the chat template of {info.origin} is malformed (line {e.lineno}: "
                     f"{e.message}); fix tokenizer.chat_template or drop --chat") from None
  try:
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=info.bos_token, eos_token=info.eos_token)
  except KvjaxError:
    raise
  except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
          AttributeError) as e:
    first = (str(e).splitlines() or [type(e).__name__])[0][:160]
    raise KvjaxError(f"the chat template of {info.origin} failed while rendering ({first}); "
                     "fix tokenizer.chat_template or drop --chat") from None

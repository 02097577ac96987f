"""A model's own chat template and stop tokens, read from its metadata.

    info = chat.from_gguf(meta, tokens)     # `tokenizer.chat_template`, eos/eot/eom ids
    info = chat.from_hf(folder, tok)        # tokenizer_config.json, generation_config.json
    text = chat.render(info, [{"role": "user", "content": "Hi"}])

Templates are Jinja, as the model's authors wrote them; they are rendered in jinja2's
immutable sandbox (no attribute writes, no access to Python internals), with the
variables such templates expect: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, and the `raise_exception` function. A template that does not parse or fails
while rendering is one line naming the model and the first problem; so is one that
recurses without end, builds a huge range, string or power, loops or prints without end
(a budget of steps and characters, `render`).

Stop tokens are a set: the end-of-sequence id and every end-of-turn id the metadata
names (GGUF `tokenizer.ggml.eos_token_id`, `eot_token_id`, `eom_token_id`; Hugging Face
`eos_token_id` in generation_config.json or config.json, an id or a list, and
tokenizer_config.json's `eos_token`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from jinja2 import sandbox

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


# What a chat template may spend: a real one loops over the messages and calls a few
# macros and filters; one that recurses without end, builds huge ranges or strings, or
# prints without end would otherwise hang, exhaust memory or escape as a RecursionError.
MAX_STEPS = 100_000       # loop iterations plus calls; and 100 per message, 8 per character
MAX_CHARS = 1 << 20       # characters of output or of any value made; and 4 per character
MAX_POWER_BITS = 1 << 16  # an integer `**` result's size
_SPECS = re.compile(r"%[-#0 +*]*\d*(?:\.\d*)?|\{[^{}]*\}")  # %-style and {}-style fields


class _Runaway(Exception):
  """A template over its budget (raised inside jinja, turned into a KvjaxError by render)."""


class _Sandbox(sandbox.ImmutableSandboxedEnvironment):
  """jinja2's immutable sandbox with a budget: every call and every `for` iteration spends
  a step (`render` routes each loop's iterable through `steps`); the integers given to calls
  and filters, what calls return, `*`, `**`, `%` and format widths are held to sizes a
  prompt can have."""

  intercepted_binops = frozenset({"*", "**", "%"})

  def __init__(self, steps: int, chars: int):
    super().__init__(trim_blocks=True, lstrip_blocks=True,
                     extensions=["jinja2.ext.loopcontrols"])
    self.left, self.chars = steps, chars
    self.globals["raise_exception"] = _raise
    self.globals[_LOOP] = self.steps
    self.filters = {name: self._bounded(f) for name, f in self.filters.items()}

  def spend(self) -> None:
    self.left -= 1
    if self.left < 0:
      raise _Runaway("runs away (more loop steps and calls than any chat needs)")

  def steps(self, iterable):
    for item in iterable:
      self.spend()
      yield item

  def _sizes(self, values) -> None:
    for v in values:
      if isinstance(v, int) and not isinstance(v, bool) and v > self.chars:
        raise _Runaway(f"asks for a size of {v}")

  def _made(self, value):
    if isinstance(value, (str, list, tuple)) and len(value) > self.chars:
      raise _Runaway(f"makes a value of {len(value)} items")
    return value

  def _format(self, fmt) -> None:
    if isinstance(fmt, str):
      self._sizes(int(d) for spec in _SPECS.findall(fmt) for d in re.findall(r"\d+", spec))

  def _bounded(self, f):
    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def filter_(*args, **kwargs):
      self._sizes([*args, *kwargs.values()])
      if f.__name__ == "do_format" and args:
        self._format(args[0])
      return self._made(f(*args, **kwargs))
    return filter_

  def call(self, context, obj, *args, **kwargs):  # every call in the template
    self.spend()
    self._sizes([*args, *kwargs.values()])
    return self._made(super().call(context, obj, *args, **kwargs))

  def wrap_str_format(self, value):  # `'{:>9}'.format`, as the template reads it
    if getattr(value, "__name__", "") in ("format", "format_map"):
      self._format(getattr(value, "__self__", None))
    return super().wrap_str_format(value)

  def call_binop(self, context, operator, left, right):
    if operator == "*":
      seq, n = (left, right) if isinstance(right, int) else (right, left)
      if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
          len(seq) * n > self.chars:
        raise _Runaway(f"builds a sequence of {len(seq) * n} items")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
        right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_POWER_BITS:
      raise _Runaway(f"computes a {right * abs(left).bit_length()}-bit power")
    if operator == "%":
      self._format(left)
    return self._made(super().call_binop(context, operator, left, right))


_LOOP = "__kvjax_loop_steps"


def _compile(env: _Sandbox, source: str):
  """The template with each `for` loop's iterable passed through `env.steps`."""
  from jinja2 import nodes

  ast = env.parse(source)
  for loop in ast.find_all(nodes.For):
    at = {"lineno": loop.iter.lineno, "environment": env}
    loop.iter = nodes.Call(nodes.Name(_LOOP, "load", **at), [loop.iter], [], None, None, **at)
  return env.from_string(ast)


def _size(messages) -> int:
  try:
    return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
  except (TypeError, AttributeError):
    return 0


def render(info: ChatInfo | None, messages: list[dict],
           add_generation_prompt: bool = True) -> str:
  """The prompt text the model's template makes of `messages` ({role, content} dicts).
  Rendering is bounded (MAX_STEPS, MAX_CHARS, MAX_POWER_BITS, Python's recursion limit):
  a template over a bound is a one-line KvjaxError, never a hang or a traceback."""
  import jinja2

  if info is None or info.template is None:
    raise KvjaxError(f"{info.origin if info else 'this model'} has no chat template; drop "
                     "--chat (chat=False) and write the prompt yourself")
  size = _size(messages)
  count = len(messages) if isinstance(messages, (list, tuple)) else 0
  env = _Sandbox(MAX_STEPS + 100 * count + 8 * size, MAX_CHARS + 4 * size)
  fix = "fix tokenizer.chat_template or drop --chat"
  try:
    template = _compile(env, info.template)
  except jinja2.TemplateSyntaxError as e:
    raise KvjaxError(f"the chat template of {info.origin} is malformed (line {e.lineno}: "
                     f"{e.message}); {fix}") from None
  except RecursionError:
    raise KvjaxError(f"the chat template of {info.origin} nests too deeply to read; {fix}") \
        from None
  out, n = [], 0
  try:
    for piece in template.generate(messages=messages, bos_token=info.bos_token,
                                   add_generation_prompt=add_generation_prompt,
                                   eos_token=info.eos_token):
      n += len(piece)
      if n > env.chars:
        raise _Runaway(f"prints over {env.chars} characters")
      out.append(piece)
  except KvjaxError:
    raise
  except _Runaway as e:
    raise KvjaxError(f"the chat template of {info.origin} {e}; {fix}") from None
  except RecursionError:
    raise KvjaxError(f"the chat template of {info.origin} recurses without end (past "
                     f"Python's recursion limit); {fix}") from None
  except MemoryError:
    raise KvjaxError(f"the chat template of {info.origin} needs more memory than any "
                     f"prompt; {fix}") from None
  except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
          AttributeError, OverflowError) as e:
    first = (str(e).splitlines() or [type(e).__name__])[0][:160]
    raise KvjaxError(f"the chat template of {info.origin} failed while rendering ({first}); "
                     f"{fix}") from None
  return "".join(out)

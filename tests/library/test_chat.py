"""The model's own chat template (rendered in jinja2's sandbox) and its set of stop tokens."""

import json
import re
import subprocess
import sys

import pytest

from conftest import tiny_config, tiny_params
from kvjax import cli
from kvjax.decode import generate
from kvjax.errors import KvjaxError
from kvjax.io import chat

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_render_follows_the_template_and_its_variables():
  info = chat.ChatInfo(CHATML + "{{ eos_token }}", frozenset({2}), "<s>", "</s>")
  text = chat.render(info, [{"role": "user", "content": "Hi"}])
  assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n</s>"
  assert "assistant" not in chat.render(info, [{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=False)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content }", "malformed (line 1"),
    ("{{ raise_exception('only user turns') }}", "refused the messages: only user turns"),
    ("{{ ''.__class__.__mro__ }}", "failed while rendering"),   # the sandbox says no
    ("{{ messages.append(1) }}", "failed while rendering"),     # immutable sandbox
])
def test_a_bad_template_is_one_line(template, words):
  with pytest.raises(KvjaxError, match=r"^[^\n]*$") as e:
    chat.render(chat.ChatInfo(template), [{"role": "user", "content": "x"}])
  assert words in str(e.value)


RUNAWAY = {  # template -> what the one line says; each would hang, exhaust memory or raise
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}": "recurses without end",
    "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}":
        "runs away",                                                   # 2**60 calls
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}":
        "runs away",                                                   # 10**10 silent steps
    "{% for a in 'x' * 99999 %}{% for b in 'x' * 99999 %}{% endfor %}{% endfor %}": "runs away",
    "{{ range(10**9)|list|length }}": "asks for a size of 1000000000",
    "{% for i in range(99999) %}{{ 'y' * 99999 }}{% endfor %}": "prints over",
    "{{ 'x' * 10**10 }}": "builds a sequence of 10000000000 items",
    "{{ 2 ** 1000000000 }}": "2000000000-bit power",
    "{{ 'x'|center(10**10) }}": "asks for a size of 10000000000",
    "{{ '{:>10000000000}'.format('x') }}": "asks for a size of 10000000000",
    "{{ '%5.10000000000f' % 1.0 }}": "asks for a size of 10000000000",
    "{{ ('x' * 1000).replace('', 'y' * 1000000) }}": "makes a value of 1001001000 items",
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}": "nests too deeply to read",
}


_RENDER_EACH = """
import json, sys, time
from kvjax.errors import KvjaxError
from kvjax.io import chat
chat.MAX_STEPS = 20_000  # the same rule, a smaller budget: faster
for template in json.loads(sys.stdin.read()):
  t0 = time.perf_counter()
  try:
    chat.render(chat.ChatInfo(template), [{"role": "user", "content": "x"}])
    got = "rendered"
  except KvjaxError as e:
    got = str(e)
  except BaseException as e:
    got = "escaped: " + type(e).__name__
  print(json.dumps([got, time.perf_counter() - t0]), flush=True)
"""


def test_a_runaway_template_is_one_line_in_bounded_time():
  """All of RUNAWAY rendered in one child process under a wall-clock limit, so a template
  that hangs fails this test (naming it) instead of hanging the suite."""
  templates = list(RUNAWAY)
  try:
    proc = subprocess.run([sys.executable, "-c", _RENDER_EACH], input=json.dumps(templates),
                          capture_output=True, text=True, timeout=90)
    out = proc.stdout
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
  got = [json.loads(line) for line in out.splitlines()]
  for template, (message, seconds) in zip(templates, got):
    assert re.fullmatch(r"the chat template of the model [^\n]*; fix tokenizer.chat_template "
                        r"or drop --chat", message), (template[:80], message)
    assert RUNAWAY[template] in message and seconds < 20, (template[:80], message, seconds)
  assert len(got) == len(templates), f"hung on {templates[len(got)][:80]!r}"


def test_the_budget_leaves_loops_and_long_messages_alone():
  template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{{ loop.index }}/{{ loop.length }}{{ '.' if loop.last }}{% else %}none"
              "{% endfor %}{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
              "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}"
              "{% else %}{{ x }}{% endif %}{% endfor %}{{ ns.n }}{{ '%3d' % 7 }}"
              "{{ messages[-1]['content']|length }}")
  long = [{"role": "user", "content": "w " * 300_000}] * 3  # over the fixed output budget
  assert chat.render(chat.ChatInfo(template), long) == \
      "1/32/33/3.a11233  7600000"  # as jinja2 renders it without the budget
  assert chat.render(chat.ChatInfo("{% for m in messages %}x{% else %}none{% endfor %}"),
                     []) == "none"
  assert len(chat.render(chat.ChatInfo(CHATML), long)) > chat.MAX_CHARS


def test_no_template_names_the_fix():
  with pytest.raises(KvjaxError, match="has no chat template; drop --chat"):
    chat.render(chat.ChatInfo(None), [{"role": "user", "content": "x"}])


def test_gguf_stop_ids_are_in_the_vocabulary():
  meta = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 99,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.chat_template": CHATML}
  info = chat.from_gguf(meta, {1: "<s>", 2: "</s>"}.get)
  assert (info.stop_ids, info.bos_token, info.eos_token) == ({2}, "<s>", "</s>")
  assert info.template == CHATML


def test_hf_folder_metadata(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(
      '{"chat_template": "T", "eos_token": {"content": "<eot>"}, "bos_token": "<s>"}')
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
  (tmp_path / "config.json").write_text('{"eos_token_id": 3}')
  info = chat.from_hf(tmp_path, {"<eot>": 11}.get)
  assert (info.template, info.stop_ids, info.bos_token) == ("T", {3, 7, 9, 11}, "<s>")


def test_gguf_metadata_of_the_instruct_model(smollm2_kvjax):
  tok = smollm2_kvjax[2]  # built by kvjax.io.tokenizer from the GGUF file's metadata
  assert tok.stop_ids == {2} and tok.decode([2]) == "" and tok.token_to_id("<|im_end|>") == 2
  ids = tok.encode(chat.render(tok.chat, [{"role": "user", "content": "Hi"}]), bos=False)
  assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(2) == 2  # system + user turns


def test_generation_stops_at_any_stop_token():
  cfg = tiny_config(**{"workload.temperature": 0.0})
  params = tiny_params(cfg)
  full = generate.generate(cfg, params, [[1, 2, 3]], 8, timed=False)["tokens"][0]
  assert len(full) == 8
  cut = generate.generate(cfg, params, [[1, 2, 3]], 8, timed=False,
                         stop={full[3], 10**6})["tokens"][0]
  assert cut == full[:full.index(full[3]) + 1]


def test_cli_chat_without_a_template_is_one_line(capsys):
  assert cli.main(["generate", "--set", "tokenizer=bytes", "--prompt", "x", "--chat"]) == 2
  err = capsys.readouterr().err.strip()
  assert "no chat template" in err and len(err.splitlines()) == 1
  assert cli.main(["generate", "--prompt-ids", "1,2", "--chat"]) == 2
  assert "--chat renders a text prompt" in capsys.readouterr().err


def test_a_model_s_own_template_wraps_the_long_context_prompts():
  """params.template=model: the model's template split at the user's text, its printed BOS
  left to a tokenizer that adds one (never two), the assistant's opening after the
  question; without a template in the metadata, the turn format its vocabulary names; a
  template that does not print the user's text once, or none at all, is one line."""
  import types

  from kvjax.lab import tasks

  def tok(info, bos_id=None, vocab=()):
    return types.SimpleNamespace(chat=info, bos_id=bos_id, token_to_id={
        t: i for i, t in enumerate(vocab)}.get)
  gemma = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
           "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
           "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
  info = chat.ChatInfo(gemma, frozenset({1}), "<bos>", "<eos>")
  t = tasks.own_template(tok(info, bos_id=2))
  assert (t.name, t.user, t.assistant) == ("model", "<start_of_turn>user\n",
                                           "<end_of_turn>\n<start_of_turn>model\n")
  assert tasks.own_template(tok(info)).user == "<bos><start_of_turn>user\n"
  assert tasks.own_template(tok(chat.ChatInfo(CHATML))) == tasks.Template(
      "model", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
  no_template = chat.ChatInfo(None, origin="g.gguf")
  assert tasks.own_template(tok(no_template, 2, ["<bos>", "<start_of_turn>"])) == \
      tasks.Template("model", tasks.GEMMA.user, tasks.GEMMA.assistant)
  assert tasks.own_template(tok(no_template, None, ["<|im_start|>"])).user == tasks.CHATML.user
  with pytest.raises(KvjaxError, match=r"^g.gguf has no chat template"):
    tasks.own_template(tok(no_template, None, ["a"]))
  e = tasks.generate("passkey", lambda s: list(s.encode()), 400, [0.5], template=t)
  assert e.prefix.startswith("<start_of_turn>user\n")
  assert "<end_of_turn>\n<start_of_turn>model\n" in e.queries[0].tail
  for bad in ("{{ 'no turns' }}", "{% for m in messages %}{{ m.content }}{{ m.content }}"
              "{% endfor %}"):
    with pytest.raises(KvjaxError, match=r"^[^\n]*does not print a user turn's text once"):
      tasks.own_template(tok(chat.ChatInfo(bad)))

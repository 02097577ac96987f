"""The Python API refuses what the command line refuses, with a KvjaxError from the same
check (kvjax.inputs), never a TypeError, an OSError or a result: wrong types, a seed the
CLI refuses, a prompt that is neither text nor ids, text that is not UTF-8, and a result
holding NaN. `evaluate` takes the text itself (`text=`), a file (`path=`) or a named corpus
(`corpus=`), and never guesses which a string is."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import kvjax
from kvjax import cli, inputs
from kvjax.errors import KvjaxError
from test_api import tiny  # noqa: F401  (the module's tiny model fixture)


@pytest.mark.parametrize("kwargs, words", [
    ({"max_new_tokens": "8"}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": None}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"prompt": None}, "prompt must be"),
    ({"prompt": 5}, "prompt must be"),
    ({"prompt": [1, "a"]}, "prompt must be"),
    ({"prompt": b"abc"}, "prompt must be"),
    ({"prompt": "a\udcffb"}, "not UTF-8 text (byte 0xff"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": -1}, "seed must be an integer"),
    ({"chat": "yes"}, "chat must be True or False"),
    ({"cache": {3: "int8"}}, "cache= keys"),
])
def test_generate_refuses_what_the_cli_refuses(tiny, kwargs, words):  # noqa: F811
  kwargs = {"prompt": "ab", "max_new_tokens": 2, **kwargs}
  with pytest.raises(KvjaxError) as e:
    tiny[0].generate(**kwargs)
  assert words in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_the_same_seed_and_bytes(tiny, capsys):  # noqa: F811
  path = str(tiny[1])
  assert cli.main(["generate", "--config", path, "--prompt", "ab", "--seed", "-1"]) == 2
  assert "--seed must be an integer" in capsys.readouterr().err
  assert cli.main(["generate", "--config", path, "--prompt", "a\udcffb"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--prompt is not UTF-8 text (byte 0xff" in err[0]


@pytest.mark.parametrize("kwargs, words", [
    ({"text": 5}, "text must be text"),
    ({"text": "  "}, "text= is empty"),
    ({"path": "/no/such/file.txt"}, "does not exist"),
    ({"path": 5}, "path= must be"),
    ({"corpus": "wikipedia"}, "corpus= names a built-in corpus"),
    ({"text": "abc", "path": "x"}, "one of text=, path= or corpus="),
    ({"tokens": "8"}, "tokens must be an integer"),
    ({"seqs": 1.0}, "seqs must be an integer"),
    ({"chunk": None}, "chunk must be an integer"),
])
def test_evaluate_refuses_what_the_cli_refuses(tiny, kwargs, words):  # noqa: F811
  with pytest.raises(KvjaxError) as e:
    tiny[0].evaluate(**kwargs)
  assert words in str(e.value) and "\n" not in str(e.value)


def test_evaluate_takes_text_as_text_and_a_file_as_a_path(tiny, tmp_path):  # noqa: F811
  m = tiny[0]
  body = "The quick brown fox jumps over the lazy dog. " * 4
  r = m.evaluate(body, tokens=8)  # once an OSError: File name too long
  assert r.tokens == 8 and r.to_dict()["text"] == f"text ({len(body)} characters)"
  f = tmp_path / "t.txt"
  f.write_text(body)
  assert m.evaluate(path=f, tokens=8).to_dict()["ppl"] == pytest.approx(r.to_dict()["ppl"])
  (tmp_path / "stdlib").write_text(body)  # a file named like the corpus is the file
  assert inputs.eval_source(None, tmp_path / "stdlib", None) == ("path",
                                                                 str(tmp_path / "stdlib"))


def test_nan_weights_are_one_line_not_ppl_nan(tiny):  # noqa: F811
  m = tiny[0]
  bad = kvjax.api.Model(m.config, jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), m.params),
                        m.tokenizer, m.source, m.overrides)
  with pytest.raises(KvjaxError, match="non-finite"):
    bad.evaluate("some text to read here", tokens=8)


# (the API's keywords, the same request on the command line, the keyword, the flag)
BOTH_FACES = [
    ({"max_new_tokens": 0}, ["--max-new-tokens", "0"], "max_new_tokens", "--max-new-tokens"),
    ({"max_new_tokens": -3}, ["--max-new-tokens", "-3"], "max_new_tokens", "--max-new-tokens"),
    ({"temperature": -1.0}, ["--temperature", "-1"], "temperature", "--temperature"),
    ({"top_k": -1}, ["--top-k", "-1"], "top_k", "--top-k"),
    ({"top_p": 2.0}, ["--top-p", "2"], "top_p", "--top-p"),
    ({"seed": -5}, ["--seed", "-5"], "seed", "--seed"),
    ({"tokens": 1}, ["--tokens", "1"], "tokens", "--tokens"),
    ({"seqs": 0}, ["--seqs", "0"], "seqs", "--seqs"),
    ({"chunk": 0}, ["--chunk", "0"], "chunk", "--chunk"),
]


@pytest.mark.parametrize("kwargs, argv, keyword, flag", BOTH_FACES)
def test_each_face_names_a_bad_argument_its_own_way(tiny, capsys, kwargs, argv, keyword,
                                                    flag):  # noqa: F811
  """The same bad value through `kvjax generate`/`eval` and `Model.generate`/`evaluate`: the
  command line's one line names the flag, the API's error the keyword, neither the other."""
  evaluates = keyword in ("tokens", "seqs", "chunk")
  with pytest.raises(KvjaxError) as e:
    if evaluates:
      tiny[0].evaluate(**kwargs)
    else:
      tiny[0].generate("ab", **{"max_new_tokens": 2, **kwargs})
  api = str(e.value)
  assert api.startswith(f"{keyword} must be") and flag not in api, api
  command = ["eval", "--config", str(tiny[1]), *argv] if evaluates else \
      ["generate", "--config", str(tiny[1]), "--prompt", "ab", *argv]
  assert cli.main(command) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f"error: {flag} must be" in err[0], err
  assert f"{keyword} must" not in err[0].replace(f"{flag} must", ""), err

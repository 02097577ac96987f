"""Corpus split (deterministic, disjoint, by document), byte tokens, recall task layout."""

import numpy as np
import pytest

from kvjax.errors import KvjaxError
from kvjax.io.tokenizer import BOS, ByteTokenizer
from kvjax.lab import data


def _folder(tmp_path, n=40):
  for i in range(n):
    sub = tmp_path / f"d{i % 3}"
    sub.mkdir(exist_ok=True)
    (sub / f"f{i}.txt").write_text(f"document {i}: " + "hello world " * (i + 1))
  (tmp_path / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix: ignored
  return tmp_path


def test_folder_split_deterministic_disjoint_complete(tmp_path):
  folder = _folder(tmp_path)
  a = data.load_corpus.__wrapped__(str(folder), 0.2)
  b = data.load_corpus.__wrapped__(str(folder), 0.2)
  assert a.train_docs == b.train_docs and a.validation_docs == b.validation_docs
  assert np.array_equal(a.train, b.train) and np.array_equal(a.validation, b.validation)
  assert not set(a.train_docs) & set(a.validation_docs)
  assert len(a.train_docs) + len(a.validation_docs) == 40
  assert a.validation_docs and a.train_docs
  # every document starts with BOS; the split streams hold exactly their documents' bytes
  assert (a.train == BOS).sum() == len(a.train_docs)
  expected = sum(len((folder / n).read_bytes()) + 1 for n in a.validation_docs)
  assert len(a.validation) == expected


def test_split_is_by_name_and_stable_when_documents_are_added(tmp_path):
  folder = _folder(tmp_path)
  before = data.load_corpus.__wrapped__(str(folder), 0.2)
  (folder / "d0" / "new.txt").write_text("another document")
  after = data.load_corpus.__wrapped__(str(folder), 0.2)
  assert set(before.validation_docs) <= set(after.validation_docs)
  assert set(before.train_docs) <= set(after.train_docs)


def test_stdlib_corpus_split():
  c = data.load_corpus("stdlib")
  assert not set(c.train_docs) & set(c.validation_docs)
  assert len(c.validation_docs) > 5 and len(c.train_docs) > 20 * len(c.validation_docs) / 2
  assert any(n.startswith("pydoc_data/topics/") for n in c.train_docs + c.validation_docs)
  assert all(data.is_validation(n, 0.05) for n in c.validation_docs)
  assert not any(data.is_validation(n, 0.05) for n in c.train_docs)
  assert c.train.max() <= BOS and c.train.min() >= 0
  # byte-level tokens are the ByteTokenizer's ids
  text = "def f(x):\n  return x  # é"
  assert list(data._stream([text.encode()])[1:]) == ByteTokenizer().encode(text)
  assert 2.0 < data.unigram_entropy(c.validation, 260) < np.log(256)


def test_single_file_splits_by_position(tmp_path):
  f = tmp_path / "book.txt"
  f.write_text("abcdefghij" * 100)
  c = data.load_corpus.__wrapped__(str(f), 0.1)
  assert len(c.train) + len(c.validation) == 1000 + 2
  assert len(c.validation) == 100 + 1


def test_missing_or_empty_data_is_a_clear_error(tmp_path):
  with pytest.raises(KvjaxError, match="neither"):
    data.load_corpus.__wrapped__(str(tmp_path / "nope"), 0.05)
  (tmp_path / "empty").mkdir()
  with pytest.raises(KvjaxError, match="no text files"):
    data.load_corpus.__wrapped__(str(tmp_path / "empty"), 0.05)


def test_recall_example_answers_are_the_paired_values():
  rng = np.random.default_rng(0)
  seq, mask = data.recall_example(rng, 64, n_pairs=6, n_queries=5)
  assert seq.shape == mask.shape == (64,) and seq[0] == BOS
  pairs = dict(zip(seq[1:13:2].tolist(), seq[2:13:2].tolist()))
  assert len(pairs) == 6 and all(k in data.KEYS for k in pairs)
  assert mask.sum() == 5
  for t in np.flatnonzero(mask):
    assert seq[t] == pairs[int(seq[t - 1])]
  # the filler never uses key or value bytes, so only the pairs can answer
  assert seq[13:64 - 10].max() < 128
  with pytest.raises(KvjaxError, match="shorter"):
    data.recall_example(rng, 10, n_pairs=6, n_queries=5)


def test_training_batch_mixes_recall_rows():
  c = data.Corpus("x", np.arange(5000, dtype=np.int32) % 200, np.arange(500, dtype=np.int32),
                  ("a",), ("b",))
  rng = np.random.default_rng(1)
  x, y, m = data.training_batch(c, rng, batch=8, seq_len=64, recall_mix=0.25, n_pairs=4,
                                n_queries=4)
  assert x.shape == y.shape == m.shape == (8, 64)
  assert np.array_equal(x[:, 1:], y[:, :-1])
  assert m[:2].sum(1).tolist() == [4, 4]   # recall rows: loss on the answers only
  assert m[2:].all()                        # text rows: loss everywhere
  a = data.training_batch(c, np.random.default_rng(7), 4, 32)
  b = data.training_batch(c, np.random.default_rng(7), 4, 32)
  assert all(np.array_equal(u, v) for u, v in zip(a, b))


def test_the_retrieval_corpus_asks_what_its_haystack_holds():
  """Each generated document states a fact in its haystack, asks for it, and answers it;
  the corpus is a named calibration text like the others."""
  import re
  from kvjax.lab import data
  docs = data.retrieval_documents()
  assert len(docs) == data.RETRIEVAL_DOCS
  kinds = {name.split("/")[1].split("_")[0] for name in docs}
  assert kinds == {"passkey", "niah", "vt"}
  for name in sorted(docs)[::97]:
    text = docs[name].decode()
    body, question = text.rsplit("Question:", 1)
    answer = re.findall(r"\d+", question)[-1]
    assert answer in body, name  # the answer is in the haystack before the question
    assert 150 < len(text.split()) <= data.RETRIEVAL_WORDS + 40
  assert "Question:" in data.calib_text("retrieval", chars=20_000)
  assert data.retrieval_documents() is docs  # generated once a process

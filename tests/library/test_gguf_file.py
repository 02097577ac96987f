"""kvjax.io.gguf_file, the GGUF header parser, against ggml's own reader (GGUFReader) on a
file holding every value type, arrays of strings and numbers, and plain and block-quantized
tensors: the same fields, the same tensor table, the same bytes; and malformed headers as
one line each."""

import numpy as np
import pytest

from kvjax.errors import KvjaxError
from kvjax.io import gguf_file


@pytest.fixture(scope="module")
def path(tmp_path_factory):
  from gguf import GGMLQuantizationType as Q
  from gguf import GGUFWriter, quants
  p = tmp_path_factory.mktemp("g") / "all.gguf"
  w = GGUFWriter(str(p), "llama")
  w.add_uint8("t.u8", 7)
  w.add_int8("t.i8", -7)
  w.add_uint16("t.u16", 700)
  w.add_int16("t.i16", -700)
  w.add_uint32("t.u32", 70000)
  w.add_int32("t.i32", -70000)
  w.add_float32("t.f32", 1e-6)
  w.add_uint64("t.u64", 2**40)
  w.add_int64("t.i64", -(2**40))
  w.add_float64("t.f64", 0.1)
  w.add_bool("t.bool", True)
  w.add_string("t.str", "Ünïcödé ▁ 日本")
  w.add_array("t.strs", ["a", "", "▁▁", "<0x0A>"])
  w.add_array("t.ints", [1, -2, 3])
  w.add_array("t.floats", [0.5, -1.5])
  rng = np.random.default_rng(0)
  w.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
  w.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16))
  for qt in (Q.Q8_0, Q.Q4_0):
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor(qt.name, quants.quantize(x, qt), raw_dtype=qt)
  # a K-quant (gguf-py cannot quantize them): four rows of 256 as random blocks of bytes
  w.add_tensor("Q6_K", rng.integers(0, 255, (4, 210), dtype=np.uint8), raw_dtype=Q.Q6_K)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return p


def test_fields_and_tensors_equal_ggml_reader(path):
  from gguf import GGUFReader, quants
  ref, got = GGUFReader(str(path)), gguf_file.open_file(path)
  for key, field in ref.fields.items():
    if key.startswith("GGUF."):
      continue
    want, have = field.contents(), got.fields[key]
    if isinstance(want, list):
      assert list(have) == want, key
      assert not isinstance(want[0], str) or isinstance(have, list)
    else:
      assert have == want and type(have) is type(want), (key, have, want)
  assert list(got.tensors) == [t.name for t in ref.tensors]
  for t in ref.tensors:
    mine = got.tensors[t.name]
    assert mine.tensor_type == t.tensor_type and mine.data.dtype == t.data.dtype
    np.testing.assert_array_equal(mine.data, t.data)
    np.testing.assert_array_equal(quants.dequantize(mine.data, mine.tensor_type),
                                  quants.dequantize(t.data, t.tensor_type))


@pytest.mark.parametrize("damage, needle", [
    (lambda b: b[:20], "shorter than a GGUF header"),
    (lambda b: b"GGML" + b[4:], "does not start with 'GGUF'"),
    (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "GGUF version 9"),
    (lambda b: b[:len(b) // 3], "past the end of the file"),
    (lambda b: b[:16] + (10**15).to_bytes(8, "little") + b[24:], "fields"),
])
def test_a_malformed_file_is_one_line(path, tmp_path, damage, needle):
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(damage(path.read_bytes()))
  with pytest.raises(KvjaxError) as e:
    gguf_file.open_file(bad)
  assert "\n" not in str(e.value) and needle in str(e.value) and "bad.gguf" in str(e.value)

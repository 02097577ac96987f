"""The few-row product with weights stored in bfloat16 or float32 (`kernels.weight_dots`,
matvec.cc): equal to XLA's (widen-then-)multiply, one call for several matrices of one
input, used by the default CPU program at decode's row counts and not beyond them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_params
from kvjax import decode, kernels, model
from kvjax.decode import step

f32, bf16 = jnp.float32, jnp.bfloat16


@pytest.fixture(autouse=True)
def _kernel():
  if not kernels.available():
    pytest.skip(f"the CPU kernels are not available here ({kernels.status()})")


@pytest.mark.parametrize("M,E,N", [(1, 64, 96), (3, 40, 264), (5, 24, 40), (16, 32, 32),
                                   (4, 22, 33), (2, 43, 48), (1, 7, 16), (1, 576, 1536),
                                   (2, 24, 4112), (1, 16, 40), (3, 7, 64), (8, 576, 192),
                                   (11, 33, 96), (2, 43, 64)])
@pytest.mark.parametrize("dtype", [bf16, f32])
def test_weight_dot_equals_the_widened_product(M, E, N, dtype):
  """Column stripes: row groups of 1-4, a task narrower than 256 columns, a ragged column
  tail, E not a multiple of 4 or 8, one or two rows too wide for the row split. The row
  split (one or two rows, columns a multiple of 16): E split over the threads with rows
  left after the blocks of 8, fewer than 8 rows, a real projection's shape. The tile form
  (AVX-512 builds; 3-16 rows, and one or two rows of bf16 weights, columns a multiple of
  32): 3, 8, 11 and 16 rows (one or two groups of 8), E of 7 and 33; bf16 at 1 and 2 rows
  (E of 64, 576 and 43)."""
  kx, kw = jax.random.split(jax.random.PRNGKey(M * 100 + N))
  x = jax.random.normal(kx, (M, E), f32)
  w = jax.random.normal(kw, (E, N), f32).astype(dtype)
  got = jax.jit(kernels.weight_dot)(x, w)
  want = x @ w.astype(f32)
  # the same products summed in another order: within a few float32 roundings of the sum
  # of their magnitudes
  bound = 4 * np.finfo(np.float32).eps * np.asarray(jnp.abs(x) @ jnp.abs(w.astype(f32)))
  assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= bound + 1e-6)


@pytest.mark.parametrize("M,E,V", [(1, 576, 2048), (8, 64, 300), (16, 40, 17), (3, 7, 5),
                                   (2, 33, 64)])
@pytest.mark.parametrize("dtype", [bf16, f32])
def test_weight_dot_of_table_rows_equals_the_widened_product(M, E, V, dtype):
  """The table form (a tied lm_head, `transposed=True`, the table [V, E]): E a multiple of
  the 32-wide blocks or not, a block-less E, fewer table rows than chunks, 1 to 16 rows."""
  kx, kw = jax.random.split(jax.random.PRNGKey(M * 100 + V))
  x = jax.random.normal(kx, (M, E), f32)
  t = jax.random.normal(kw, (V, E), f32).astype(dtype)
  got = jax.jit(lambda x, t: kernels.weight_dot(x, t, transposed=True))(x, t)
  want = x @ t.astype(f32).T
  bound = 4 * np.finfo(np.float32).eps * np.asarray(jnp.abs(x) @ jnp.abs(t.astype(f32)).T)
  assert got.shape == (M, V)
  assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= bound + 1e-6)


@pytest.mark.parametrize("M,E,Ns", [(1, 576, (576, 192, 192)), (2, 40, (48, 16)),
                                    (5, 24, (40, 264, 8)), (1, 24, (16, 40)),
                                    (8, 40, (64, 40, 32))])
def test_one_call_of_several_matrices_equals_each_product(M, E, Ns):
  """Several matrices of one input in one call (q/k/v, gate/up), mixed bf16 and float32:
  the row split across every matrix's blocks, the column stripes across every matrix's
  stripes, a call where one matrix's columns rule out the row split for all, and one
  where the tile form takes some matrices and the stripes the others."""
  keys = jax.random.split(jax.random.PRNGKey(M + sum(Ns)), len(Ns) + 1)
  x = jax.random.normal(keys[0], (M, E), f32)
  ws = [jax.random.normal(k, (E, N), f32).astype(bf16 if i % 2 else f32)
        for i, (k, N) in enumerate(zip(keys[1:], Ns))]
  fn = jax.jit(kernels.weight_dots)
  assert fn.lower(x, ws).as_text().count("kvjax_matvec") == 1
  for got, w in zip(fn(x, ws), ws):
    want = x @ w.astype(f32)
    bound = 4 * np.finfo(np.float32).eps * np.asarray(jnp.abs(x) @ jnp.abs(w.astype(f32)))
    assert got.shape == want.shape
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= bound + 1e-6)


def test_the_kernel_takes_decode_rows_only():
  lowered = lambda M, dt: jax.jit(kernels.weight_dot).lower(  # noqa: E731
      jnp.ones((M, 32), f32), jnp.ones((32, 64), dt)).as_text()
  for dt in (bf16, f32):
    assert "kvjax_matvec" in lowered(kernels.MATVEC_ROWS, dt)
    assert "kvjax_matvec" not in lowered(kernels.MATVEC_ROWS + 1, dt)  # a prompt: XLA's dot
  assert "kvjax_matvec" not in lowered(2, jnp.float16)  # a type the kernel does not take


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_decode_multiplies_every_weight_through_the_kernel(tied, param_dtype, monkeypatch):
  """The default CPU decode step multiplies every projection and the lm_head (untied, or
  tied: the table-rows form) through the kernel, the projections sharing an input in one
  call, and its logits equal XLA's products'."""
  cfg = tiny_config(**{"model.param_dtype": param_dtype, "model.tie_embeddings": tied})
  params = step.prepare_params(cfg, tiny_params(cfg))
  net = model.Transformer(cfg.model, layer_loop="switch")
  tokens = jnp.array([[3, 5], [7, 1]], jnp.int32)
  pos = jnp.array([[0, 1], [0, 1]], jnp.int32)
  run = jax.jit(lambda p, t: net.apply({"params": p}, t, pos)[0])
  text = run.lower(params, tokens).as_text()
  calls = text.count("kvjax_matvec")
  per_layer = 4  # q/k/v; o; gate/up; down (in the switch's branches: one each)
  assert calls == per_layer * cfg.model.n_layers + 1
  assert ("kvjax_matvec_t" in text) == tied
  got = run(params, tokens)
  monkeypatch.setattr(kernels, "available", lambda: False)
  want = jax.jit(lambda p, t: net.apply({"params": p}, t, pos)[0])(params, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

"""Choosing a kernel: `auto` falls back to the XLA reference for shapes the compiled kernel cannot take."""

import importlib

import pytest

from pallas_kernels import _dispatch

# The package re-exports functions under the module names, so fetch the modules themselves.
gmm = importlib.import_module("pallas_kernels.grouped_matmul")
itk = importlib.import_module("pallas_kernels.indexer_topk")
smla = importlib.import_module("pallas_kernels.sparse_mla_attention")


def test_auto_on_cpu_is_xla_unless_interpreting(monkeypatch):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: False)
    assert _dispatch.resolve_impl("auto") == "xla"
    assert _dispatch.resolve_impl("auto", interpret=True) == "pallas"
    with pytest.raises(ValueError, match="impl must be one of"):
        _dispatch.resolve_impl("triton")


def test_unsupported_shapes(monkeypatch):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    assert _dispatch.resolve_impl("auto", unsupported=None) == "pallas"
    assert _dispatch.resolve_impl("auto", unsupported="K=24 ...") == "xla"
    # Interpret mode runs any shape.
    assert _dispatch.resolve_impl("pallas", interpret=True, unsupported="K=24 ...") == "pallas"
    with pytest.raises(ValueError, match="K=24"):
        _dispatch.resolve_impl("pallas", unsupported="K=24 ...")


def test_real_model_shapes_are_supported():
    assert gmm.pallas_problem(7168) is None and gmm.pallas_problem(2688) is None and gmm.pallas_problem(1856) is None
    assert itk.pallas_problem(64, 128) is None
    assert smla.pallas_problem(128, 512, 64) is None and smla.pallas_problem(16, 512, 64) is None


def test_tiny_shapes_are_named():
    assert "K" in gmm.pallas_problem(24)
    assert gmm.pallas_problem(48) is None  # a 16-wide K tile divides 48
    assert "index_head_dim=20" in itk.pallas_problem(16, 20)
    assert "index_n_heads=4" in itk.pallas_problem(4, 32)
    assert "kv_lora_rank=20" in smla.pallas_problem(16, 20, 16)
    assert "multiple" in smla.pallas_problem(48, 512, 64)


def test_auto_falls_back_for_a_contiguous_cache_of_odd_length(monkeypatch):
    """The model forward's indexer runs over a contiguous cache whose 'page' is the whole sequence: a 21-token prompt
    is a 21-row page, which the compiled kernel cannot tile; `auto` must run the reference instead of raising."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    assert "page_size" in itk.pallas_problem(64, 128, 21)
    assert itk.pallas_problem(64, 128, 64) is None
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    q, w, k = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(21, 16, 32), (21, 16), (1, 21, 32)]))
    lens = jnp.arange(1, 22, dtype=jnp.int32)
    got = itk.indexer_topk(q, w, k, kv_lens=lens, topk=8, impl="auto")
    want = itk.indexer_topk_reference(q, w, k, kv_lens=lens, topk=8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="page_size"):
        itk.indexer_topk(q, w, k, kv_lens=lens, topk=8, impl="pallas")


class _Device:
    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


def test_gpu_capability_reads_the_first_device(monkeypatch):
    import jax

    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(jax, "devices", lambda: [_Device("9.0")])
    assert _dispatch.gpu_capability() == (9, 0) and _dispatch.is_hopper()
    assert not _dispatch.lacks_fp8_tensor_cores()
    monkeypatch.setattr(jax, "devices", lambda: [_Device("8.0")])
    assert _dispatch.gpu_capability() == (8, 0) and not _dispatch.is_hopper() and _dispatch.lacks_fp8_tensor_cores()
    monkeypatch.setattr(jax, "devices", lambda: [_Device("10.0")])
    assert not _dispatch.is_hopper() and not _dispatch.lacks_fp8_tensor_cores()
    # A device that does not say keeps the choices made for the H200.
    monkeypatch.setattr(jax, "devices", lambda: [object()])
    assert _dispatch.gpu_capability() is None and _dispatch.is_hopper() and not _dispatch.lacks_fp8_tensor_cores()
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: False)
    assert _dispatch.gpu_capability() is None


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_fp8_index_keys_run_the_reference_on_a_gpu_without_fp8(monkeypatch, capability):
    """An A100 (8.0) or an RTX 3090 (8.6) has no e4m3 type in Triton: `auto` runs the indexer's reference on FP8 keys
    (named by `fp8_problem`), and `pallas` refuses them with the reason."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(_dispatch, "gpu_capability", lambda: capability)
    q, w = jax.random.normal(jax.random.key(0), (4, 16, 32)), jax.random.normal(jax.random.key(1), (4, 16))
    k8, k_scale = itk.quantize_index_k_fp8(jax.random.normal(jax.random.key(2), (3, 16, 32)))
    kw = dict(kv_lens=jnp.array([16, 9, 40, 3], jnp.int32), topk=8, k_scale=k_scale,
              page_table=jnp.array([[1, 2, 0], [2, 1, 0]], jnp.int32), seq_ids=jnp.array([0, 0, 1, 1], jnp.int32))
    assert "8.9" in _dispatch.fp8_problem(k8) and _dispatch.fp8_problem(q) is None
    got = itk.indexer_topk(q, w, k8, impl="auto", **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(itk.indexer_topk_reference(q, w, k8, **kw)))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        itk.indexer_topk(q, w, k8, impl="pallas", **kw)
    monkeypatch.setattr(_dispatch, "gpu_capability", lambda: (8, 9))
    assert _dispatch.fp8_problem(k8) is None

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


def test_kernels_named_in_the_environment_run_their_reference(monkeypatch):
    """$JAXMODELS_XLA_KERNELS sends the kernels it names (or all) to XLA under `auto`, on the GPU and in interpret
    mode alike; an explicit impl is kept."""
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setenv(_dispatch.XLA_KERNELS_ENV, "causal_conv1d, ssd_state_update")
    assert _dispatch.resolve_impl("auto", kernel="causal_conv1d") == "xla"
    assert _dispatch.resolve_impl("auto", interpret=True, kernel="ssd_state_update") == "xla"
    assert _dispatch.resolve_impl("auto", kernel="causal_conv1d_update") == "pallas"
    assert _dispatch.resolve_impl("pallas", kernel="causal_conv1d") == "pallas"
    monkeypatch.setenv(_dispatch.XLA_KERNELS_ENV, "all")
    assert _dispatch.resolve_impl("auto", kernel="grouped_matmul") == "xla"


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


@pytest.mark.parametrize("capability, mla_stages, fp8_stages", [(None, 3, 4), ((9, 0), 3, 4), ((8, 0), 2, 4),
                                                                ((8, 9), 1, 3)])
def test_pipelines_fit_the_gpus_shared_memory(monkeypatch, capability, mla_stages, fp8_stages):
    """The kernels' default stages, sized for the H200's 227 KiB, shrink to what a program may take elsewhere (A100
    163 KiB, Ada 99 KiB), where Triton would refuse to compile them; the H200 (and a device that does not say) keeps
    them. The sparse MLA prefill tiles hold 64 gathered rows of 576 bf16 values a stage (72 KiB); the FP8 kernel's
    128 x 64 tiles (128 + 64) x 128 e4m3 bytes (24 KiB)."""
    import jax.numpy as jnp

    fp8_pallas = importlib.import_module("pallas_kernels.fp8_matmul_pallas")
    monkeypatch.setattr(_dispatch, "gpu_capability", lambda: capability)
    assert smla.default_tiles(2048, jnp.bfloat16, heads=128, topk=2048)["num_stages"] == mla_stages
    assert smla.default_tiles(2048, jnp.bfloat16, heads=128, topk=2048, width=288)["num_stages"] == min(
        3, 2 * mla_stages)  # half-width rows: twice the stages fit, at most the default
    tiles = fp8_pallas._checked_options((128, 128), 4096, 1, {}, interpret=False, dense=True)
    assert (tiles["block_m"], tiles["block_n"], tiles["num_stages"]) == (128, 64, fp8_stages)
    asked = fp8_pallas._checked_options((128, 128), 4096, 1, {"num_stages": 4}, interpret=False, dense=True)
    assert asked["num_stages"] == 4  # stages asked for are the caller's
    assert _dispatch.fit_stages(3, 10 ** 6) == 1  # never below one


@pytest.mark.gpu
def test_the_gpu_states_its_capability():
    """The kernel choices above read the device's compute capability; a GPU that did not state it would silently get
    the H200's choices. On the H200: (9, 0), a Hopper, 227 KiB a program."""
    capability = _dispatch.gpu_capability()
    assert capability is not None and capability >= (7, 0), capability
    if capability[0] == 9:
        assert _dispatch.is_hopper() and _dispatch.shared_memory_per_program() == _dispatch.HOPPER_SHARED_MEMORY

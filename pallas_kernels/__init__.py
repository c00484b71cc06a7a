"""Pallas kernels with their XLA references. Every kernel takes `impl="auto" | "pallas" | "xla"` and `interpret=`.

`impl="auto"` runs the Pallas kernel on a GPU and the XLA reference elsewhere (see `_dispatch.resolve_impl`).
"""
from pallas_kernels.causal_conv1d import (causal_conv1d, causal_conv1d_pooled, causal_conv1d_update,  # noqa: E402,F401
                                          causal_conv1d_windows)
from pallas_kernels.mamba_ssd import ssd_chunk_scan, ssd_chunk_scan_pooled  # noqa: E402,F401
from pallas_kernels.mamba_state_update import ssd_state_update, ssd_state_update_packed  # noqa: E402,F401
from pallas_kernels.mamba_verify import ssd_state_advance_packed, ssd_verify_scan_packed  # noqa: E402,F401
from .indexer_topk import indexer_topk, indexer_topk_reference, quantize_index_k_fp8  # noqa: E402,F401
from .sparse_mla_attention import (  # noqa: E402,F401
    logical_to_cache_rows, sparse_mla_attention, sparse_mla_attention_reference)
from .grouped_matmul import EPILOGUES as grouped_matmul_epilogues  # noqa: E402,F401
from .grouped_matmul import grouped_matmul, grouped_matmul_reference  # noqa: E402,F401
from .add_rms_norm import add_rms_norm, add_rms_norm_reference  # noqa: E402,F401
from .paged_attention import paged_attention, paged_attention_reference  # noqa: E402,F401
from .fp8_matmul import (  # noqa: E402,F401
    dequantize_weight, fp8_grouped_matmul, fp8_grouped_matmul_reference, fp8_matmul, fp8_matmul_reference,
    quantize_activations, quantize_weight)

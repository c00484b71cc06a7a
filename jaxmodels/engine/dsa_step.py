"""DSA (DeepSeek-V3.2, GLM-5) cache-aware steps for the engine.

Caches, paged like the GQA KV pool (page 0 is the null page): per layer the MLA latent rows `[c ‖ k_rope]`
(`latent`, model dtype) and, per layer with its own indexer, the index keys (`index_k`, plus `index_k_scale` under
FP8 reference numerics). With no recurrent state, extend and decode are the same per-token computation: every token
writes its rows at its position, its indexer picks the top-k keys among its request's positions 0..position, and
absorbed MLA attends to exactly those rows. Only which tokens' logits come back differs.
"""

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxmodels.layers.attention import write_pages
from jaxmodels.layers.rope import rope_cos_sin
from jaxmodels.engine.step import ModelStep
from pallas_kernels.packing import token_sequence_ids


class DSAStep(ModelStep):
    def __init__(self, model, *, matmul_precision: str | None = None, mamba_ssm_cache_dtype=None):
        if mamba_ssm_cache_dtype is not None:
            raise ValueError("mamba_ssm_cache_dtype applies to Nemotron-H models; DSA models have no Mamba state")
        super().__init__(model, matmul_precision=matmul_precision)
        self.num_indexers = sum(layer.self_attn.indexer is not None for layer in model.layers)
        self.fp8_keys = self.config.indexer_numerics != "exact"

    def cache_shapes(self, sizes) -> dict:
        c = self.config
        pages = (sizes.num_pages, sizes.page_size)
        latent = jax.ShapeDtypeStruct(pages + (c.kv_lora_rank + c.qk_rope_head_dim,), self.dtype)
        index_k = jax.ShapeDtypeStruct(pages + (c.index_head_dim,),
                                       jnp.float8_e4m3fn if self.fp8_keys else self.dtype)
        shapes = {"latent": [latent] * c.num_hidden_layers, "index_k": [index_k] * self.num_indexers}
        if self.fp8_keys:
            shapes["index_k_scale"] = [jax.ShapeDtypeStruct(pages, jnp.float32)] * self.num_indexers
        return shapes

    def _forward(self, params, caches, tokens, positions, seq_ids, page_table):
        """Packed tokens of the sequences of page_table[S, P]; seq_ids[T] == S marks padding (an all-zero row is
        appended for it, so padding reads and writes only the null page)."""
        model = self._model(params)
        caches = {name: list(arrays) for name, arrays in caches.items()}
        page_table = jnp.concatenate([page_table, jnp.zeros_like(page_table[:1])])
        page_size = caches["latent"][0].shape[1]
        topk = min(self.config.index_topk, page_table.shape[1] * page_size)
        token_pages = page_table[seq_ids]
        cos, sin = rope_cos_sin(positions, self.config.rope)
        hidden = model.embed_tokens(tokens)
        indices, i_index = None, 0
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q_nope, q_rope, latent, q_latent = attn.project(x, cos, sin)
            caches["latent"][i] = write_pages(caches["latent"][i], latent, token_pages, positions)
            if attn.indexer is not None:  # GLM-5's shared layers keep the previous layer's selection
                keys, key_scale = attn.indexer.keys(x, cos, sin)
                caches["index_k"][i_index] = write_pages(caches["index_k"][i_index], keys, token_pages, positions)
                scales = None
                if key_scale is not None:
                    scales = caches["index_k_scale"][i_index] = write_pages(
                        caches["index_k_scale"][i_index], key_scale, token_pages, positions)
                q, weights = attn.indexer.queries(x, q_latent, cos, sin)
                indices = attn.indexer.select(q, weights, caches["index_k"][i_index], kv_lens=positions + 1,
                                              topk=topk, k_scale=scales, page_table=page_table, seq_ids=seq_ids)
                i_index += 1
            rows = pallas_kernels.logical_to_cache_rows(indices, page_table, seq_ids, page_size)
            out = attn.attend_absorbed(attn.absorb_query(q_nope, q_rope), caches["latent"][i], rows)
            hidden = hidden + attn.output_from_latent(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return model, model.norm(hidden), caches

    def extend(self, params, caches, batch):
        """Same batch as NemotronHStep.extend (its Mamba fields are unused here)."""
        tokens, cu = batch["tokens"], batch["cu_seqlens"]
        num_tokens = tokens.shape[0]
        seq = token_sequence_ids(cu, num_tokens)  # one past the last sequence for padding tokens
        model, hidden, caches = self._forward(params, caches, tokens, batch["positions"], seq, batch["page_table"])
        last = jnp.clip(cu[1:] - 1, 0, num_tokens - 1)
        return model.logits(hidden[last]), caches

    def decode(self, params, caches, batch):
        rows = batch["tokens"].shape[0]
        seq = jnp.arange(rows, dtype=jnp.int32)
        model, hidden, caches = self._forward(params, caches, batch["tokens"], batch["positions"], seq,
                                              batch["page_table"])
        return model.logits(hidden), caches

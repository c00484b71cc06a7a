"""Nemotron-H's cache-aware steps for the engine: packed extend (prefill / chunked-prefill continuation) and decode.

Both are pure functions (params: {dotted path: array}, caches, batch of int arrays) -> (logits of each request's
last token [S or B, V], caches). The model is rebuilt from the flat params inside the trace (nnx.merge costs nothing
at run time), so the layer code is the same that `model(input_ids)` runs.

Caches: per attention layer `k`/`v` pages [num_pages, page_size, Hk, d] (model dtype); per Mamba layer `conv`
[num_slots, conv_dim, K-1] (model dtype) and `ssm` [num_slots, H, P, N] (float32 unless the config says otherwise).
"""

import jax
import jax.numpy as jnp

from jaxmodels.engine.step import ModelStep
from pallas_kernels.packing import token_sequence_ids


class NemotronHStep(ModelStep):
    def __init__(self, model, *, matmul_precision: str | None = None, mamba_ssm_cache_dtype=None):
        super().__init__(model, matmul_precision=matmul_precision)
        self.kinds = tuple(self.config.layer_types)
        self.ssm_cache_dtype = jnp.dtype(mamba_ssm_cache_dtype or self.config.mamba_ssm_cache_dtype)

    def cache_shapes(self, sizes) -> dict:
        c = self.config
        n_attn = self.kinds.count("attention")
        n_mamba = self.kinds.count("mamba")
        kv = jax.ShapeDtypeStruct((sizes.num_pages, sizes.page_size, c.num_key_value_heads, c.head_dim), self.dtype)
        conv = jax.ShapeDtypeStruct((sizes.num_slots, c.conv_dim, c.conv_kernel - 1), self.dtype)
        ssm = jax.ShapeDtypeStruct((sizes.num_slots, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size),
                                   self.ssm_cache_dtype)
        return {"k": [kv] * n_attn, "v": [kv] * n_attn, "conv": [conv] * n_mamba, "ssm": [ssm] * n_mamba}

    def _layers(self, model, hidden, caches, attention, mamba):
        """Run the blocks; `attention(mixer, x, k, v)` and `mamba(mixer, x, conv, ssm)` are the cached mixers."""
        caches = {name: list(arrays) for name, arrays in caches.items()}
        i_attn = i_mamba = 0
        for block in model.layers:
            x = block.norm(hidden)
            if block.kind == "attention":
                x, caches["k"][i_attn], caches["v"][i_attn] = attention(
                    block.mixer, x, caches["k"][i_attn], caches["v"][i_attn])
                i_attn += 1
            elif block.kind == "mamba":
                x, caches["conv"][i_mamba], caches["ssm"][i_mamba] = mamba(
                    block.mixer, x, caches["conv"][i_mamba], caches["ssm"][i_mamba])
                i_mamba += 1
            else:
                x = block.mixer(x)
            hidden = hidden + x
        return model.norm_f(hidden), caches

    def extend(self, params, caches, batch):
        """batch: tokens/positions int32[T]; cu_seqlens int32[S+1]; slot_ids, prompt_lens int32[S];
        has_prefix bool[S]; page_table int32[S, pages_per_seq]. Tokens at or past cu_seqlens[-1] are padding; so
        are sequences of length 0 (slot 0, all-zero page row)."""
        model = self._model(params)
        tokens, positions, cu = batch["tokens"], batch["positions"], batch["cu_seqlens"]
        num_tokens, num_seqs = tokens.shape[0], cu.shape[0] - 1
        seq = token_sequence_ids(cu, num_tokens)
        real = seq < num_seqs
        seq = jnp.minimum(seq, num_seqs - 1)
        token_pages = jnp.where(real[:, None], batch["page_table"][seq], 0)
        # transformers floors dt on prompt tokens only (see Mamba2Mixer.forward_packed).
        dt_floor = positions < batch["prompt_lens"][seq]
        slots, fresh = batch["slot_ids"], ~batch["has_prefix"]

        def attention(mixer, x, k, v):
            return mixer.forward_paged(x, k, v, token_pages=token_pages, page_table=batch["page_table"],
                                       cu_seqlens=cu, positions=positions)

        def mamba(mixer, x, conv, ssm):
            # A request's first chunk starts from zero state, whatever its slot's previous owner left there. The
            # SSM pool is updated in place by the scan, touching only the slots of real sequences (the conv states
            # are small enough to gather and scatter).
            conv0 = jnp.where(fresh[:, None, None], 0, conv[slots]).astype(conv.dtype)
            out, conv1, ssm = mixer.forward_packed_pooled(x, cu, conv0, ssm, slots, ~fresh, dt_floor_mask=dt_floor)
            return out, conv.at[slots].set(conv1.astype(conv.dtype)), ssm

        hidden, caches = self._layers(model, model.embeddings(tokens), caches, attention, mamba)
        last = jnp.clip(cu[1:] - 1, 0, num_tokens - 1)
        return model.logits(hidden[last]), caches

    def decode(self, params, caches, batch):
        """batch: tokens/positions/slot_ids int32[B]; page_table int32[B, pages_per_seq] (padded rows: slot 0, zeros)."""
        model = self._model(params)
        positions, slots, pages = batch["positions"], batch["slot_ids"], batch["page_table"]
        one_token_each = jnp.arange(positions.shape[0] + 1, dtype=jnp.int32)

        def attention(mixer, x, k, v):
            return mixer.forward_paged(x, k, v, token_pages=pages, page_table=pages, cu_seqlens=one_token_each,
                                       positions=positions)

        def mamba(mixer, x, conv, ssm):
            return mixer.forward_decode(x, conv, ssm, slots)

        hidden, caches = self._layers(model, model.embeddings(batch["tokens"]), caches, attention, mamba)
        return model.logits(hidden), caches

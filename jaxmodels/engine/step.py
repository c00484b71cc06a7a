"""The engine's side of a model: its params and their logical axes (and blocks), its caches' shapes, and the
step functions the runner jits (extend and decode; with speculative decoding, extend with its drafts and verify).

There is no per-family step code. Every model has one cache-aware forward, `model(tokens, step, caches)`, and
declares its caches (`model.cache_shapes(sizes)`); a step builds the `StepContext` from the host's batch and calls
it. The model is split into a static graph and flat params and rebuilt inside the trace (nnx.merge costs nothing at
run time), so the engine runs exactly the layer code that `model(input_ids)` runs. The step keeps the graph and an
abstract state (shapes only), never the model: its params are the runner's to place, and once it has placed them
on a mesh (`take_params`) nothing here keeps the unsharded arrays alive.
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxmodels.engine import speculative
from jaxmodels.engine.batch import DecodeBatch, ExtendBatch, VerifyBatch
from jaxmodels.engine.cache import PoolSizes
from jaxmodels.nnx_params import abstract_state, merge_params, model_params, param_axes, param_blocks, param_path
from jaxmodels.precision import matmul_precision_for
from jaxmodels.step_context import StepContext


# Pools of one page and one slot: enough to see which caches a model has.
_ONE_OF_EACH = PoolSizes(page_size=1, num_pages=1, num_slots=1, pages_per_seq=1)


def _slot_fields(cache) -> list[str]:
    """The fields of a layer's cache indexed by request slot (recurrent state), by its AXES; [] for None."""
    return [name for name, axes in getattr(cache, "AXES", {}).items() if axes and axes[0] == "slot"]


def copy_state_slots(caches: list, sources, targets) -> list:
    """Each layer's recurrent state of slot sources[i] copied to slot targets[i] (int32[C]; C = 0: nothing)."""
    if sources.shape[0] == 0:
        return caches
    return [_copy_slots(cache, _slot_fields(cache), sources, targets) for cache in caches]


def _copy_slots(cache, fields: list[str], sources, targets):
    """One layer's `copy_state_slots`: every source is read before any target is written."""
    if not fields:
        return cache
    return dataclasses.replace(cache, **{name: getattr(cache, name).at[targets].set(getattr(cache, name)[sources])
                                         for name in fields})


class ModelStep:
    def __init__(self, model, *, matmul_precision: str | None = None, mamba_ssm_cache_dtype=None,
                 num_speculative_tokens: int = 0):
        """`matmul_precision` overrides the model's own (its dtype's, or what load_model was told);
        `mamba_ssm_cache_dtype` the config's SSM state dtype (Nemotron-H only); `num_speculative_tokens` k > 0
        drafts k tokens per step with the model's MTP layers (their caches follow the target's in the cache list)."""
        if num_speculative_tokens and not model.num_mtp_layers:
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} needs the model's multi-token-prediction (MTP) "
                "layers to draft with, and this model has none: its config declares no MTP layers "
                "(num_nextn_predict_layers = 0) or it was loaded with load_mtp=False")
        self.num_speculative_tokens = num_speculative_tokens
        self.num_target_caches = len(model.layers)
        self.config = model.config
        self.dtype = model.dtype
        self.matmul_precision = (matmul_precision_for(self.dtype, matmul_precision) if matmul_precision
                                 else model.matmul_precision)
        self._cache_options = dict(mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
        self.graphdef, state = nnx.split(model)
        self.state = abstract_state(state)
        # Bound to a model rebuilt from the abstract state: `model.cache_shapes` would keep `model`'s weights alive.
        abstract_model = nnx.merge(self.graphdef, self.state)
        self._model_cache_shapes = abstract_model.cache_shapes
        self._model_mtp_cache_shapes = getattr(abstract_model, "mtp_cache_shapes", None)
        self.params = model_params(model)
        self.param_axes = param_axes(model)
        self.param_blocks = param_blocks(model)

    def record_tp_specs(self, specs: dict) -> None:
        """Record on each param ({dotted path: PartitionSpec}) its layout inside a shard_map manual over "tp", where
        layers that call custom-call kernels read it (jaxmodels.layers.tensor_parallel.tp_spec)."""
        self.state = nnx.from_flat_state([(key, variable.replace(variable.get_value(), tp_spec=specs[param_path(key)]))
                                          for key, variable in nnx.to_flat_state(self.state)])

    def take_params(self) -> dict:
        """The params, handed over: the step drops its reference, so a copy placed elsewhere (sharded over a mesh)
        leaves nothing here holding the original arrays."""
        params, self.params = self.params, None
        return params

    def cache_shapes(self, sizes) -> list:
        """Per layer, the ShapeDtypeStructs of its cache for pools of `sizes` (engine.cache.PoolSizes); with
        speculation, the MTP layers' after the target's."""
        shapes = self._model_cache_shapes(sizes, **self._cache_options)
        if self.num_speculative_tokens:
            shapes += self._model_mtp_cache_shapes(sizes)
        return shapes

    def _model(self, params):
        """The model with `params` ({dotted path: array}, traced inside the step) in place, at the step's precision."""
        model = merge_params(self.graphdef, self.state, params)
        model.matmul_precision = self.matmul_precision
        return model

    @property
    def recurrent(self) -> bool:
        """Whether the model keeps per-slot recurrent state (Mamba), which prefix caching must snapshot."""
        return any(_slot_fields(cache) for cache in self.cache_shapes(_ONE_OF_EACH))

    def extend(self, params, caches, batch: ExtendBatch, dp_axis: str | None = None):
        """Packed chunks of prompts -> (logits of each sequence's last token [S, V], caches). `dp_axis`: the mesh
        axis of the data-parallel groups when the step runs inside the engine's shard_map over it. The batch's
        recurrent-state restores run before the model, its saves after (engine.prefix_cache)."""
        caches = copy_state_slots(caches, batch.restore_from, batch.restore_to)
        logits, caches = self._model(params)(batch.tokens, self._extend_context(batch, dp_axis), caches)
        return logits, copy_state_slots(caches, batch.save_from, batch.save_to)

    @staticmethod
    def _extend_context(batch: ExtendBatch, dp_axis):
        return StepContext.extend(positions=batch.positions, cu_seqlens=batch.cu_seqlens, page_table=batch.page_table,
                                  slot_ids=batch.slot_ids, has_prefix=batch.has_prefix, prompt_lens=batch.prompt_lens,
                                  dp_axis=dp_axis)

    def _split(self, caches) -> tuple[list, list]:
        """The cache list -> (the target's, the MTP layers')."""
        return list(caches[: self.num_target_caches]), list(caches[self.num_target_caches:])

    def extend_hidden(self, params, caches, batch: ExtendBatch, dp_axis: str | None = None):
        """`extend` for speculative decoding: -> (logits [S, V], every token's hidden state [T, H], caches)."""
        step = self._extend_context(batch, dp_axis)
        model = self._model(params)
        target, mtp = self._split(copy_state_slots(caches, batch.restore_from, batch.restore_to))
        hidden, target = model.forward_hidden(batch.tokens, step, target)
        caches = copy_state_slots(target + mtp, batch.save_from, batch.save_to)
        return model.logits(hidden[step.logit_rows]), hidden, caches

    def draft_after_extend(self, params, caches, hidden, batch: ExtendBatch, next_tokens, sampled,
                           dp_axis: str | None = None):
        """The MTP layer over an extend step's tokens (see engine.speculative), then the drafts of each sequence.
        next_tokens int32[T]: the token after each one, -1 where it is the token just sampled for its sequence
        (sampled int32[S]). -> (drafts int32[S, k], the position of each sequence's sampled token [S], caches);
        drafts of sequences whose prompt is not complete are meaningless and never read."""
        step = self._extend_context(batch, dp_axis)
        model = self._model(params)
        target, mtp = self._split(caches)
        sequence = jnp.minimum(step.seq_ids, step.num_seqs - 1)
        next_tokens = jnp.where(next_tokens < 0, sampled[sequence], next_tokens)
        out, mtp = model.mtp_forward(hidden, next_tokens, step, mtp)
        rows = step.logit_rows
        drafts, mtp = speculative.draft_chain(model, out[rows], step.positions[rows], batch.page_table,
                                              batch.slot_ids, mtp, self.num_speculative_tokens, dp_axis)
        return drafts, step.positions[rows] + 1, target + mtp

    def verify(self, params, caches, last_tokens, state: speculative.DraftState, batch: VerifyBatch, knobs, *,
               greedy: bool, dp_axis: str | None = None):
        """One speculative decoding step of each row (see engine.speculative): the target checks the slot's last
        token and drafts, recurrent state commits the accepted ones, the MTP layer drafts anew. last_tokens
        int32[slots] and `state` (drafts and last positions) are per slot on the device, so the host needs neither.
        -> (int32[S, k+2]: the k+1 tokens then the number accepted; last_tokens; state; caches)."""
        k = self.num_speculative_tokens
        slots = batch.slot_ids
        proposed = state.tokens[slots]
        tokens = jnp.concatenate([last_tokens[slots][:, None], proposed], axis=1)
        start = jnp.where(slots > 0, state.positions[slots], 0)  # padding rows (null slot 0) at position 0
        positions = start[:, None] + jnp.arange(k + 1, dtype=start.dtype)
        step = StepContext.verify(positions=positions, page_table=batch.page_table, slot_ids=slots,
                                  prompt_lens=batch.prompt_lens, dp_axis=dp_axis)
        model = self._model(params)
        target, mtp = self._split(caches)
        hidden, target = model.forward_hidden(tokens.reshape(-1), step, target)
        logits = model.logits(hidden).reshape(len(slots), k + 1, -1)
        if greedy:
            out, accepted = speculative.accept_greedy(logits, proposed)
        else:  # the output index of the token after position `start`
            knobs = dataclasses.replace(knobs, step=start + 1 - batch.prompt_lens)
            out, accepted = speculative.accept_sampled(logits, proposed, knobs)
        target = model.commit_verified(target, step, accepted)
        mtp_out, mtp = model.mtp_forward(hidden, out.reshape(-1), step, mtp)
        rows = jnp.arange(len(slots))
        last_hidden = mtp_out.reshape(len(slots), k + 1, -1)[rows, accepted]
        new_drafts, mtp = speculative.draft_chain(model, last_hidden, start + accepted, batch.page_table, slots, mtp,
                                                  k, dp_axis)
        result = jnp.concatenate([out, accepted[:, None]], axis=1)
        state = state.set(slots, new_drafts, start + accepted + 1)
        return result, last_tokens.at[slots].set(out[rows, accepted]), state, target + mtp

    def decode(self, params, caches, batch: DecodeBatch, tokens, dp_axis: str | None = None):
        """One token per row, tokens[B] -> (logits [B, V], caches)."""
        step = StepContext.decode(positions=batch.positions, page_table=batch.page_table, slot_ids=batch.slot_ids,
                                  dp_axis=dp_axis)
        return self._model(params)(tokens, step, caches)

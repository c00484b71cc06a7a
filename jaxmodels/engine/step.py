"""The engine's side of a model: its params and their logical axes (and blocks), its caches' shapes, and the two step
functions the runner jits.

There is no per-family step code. Every model has one cache-aware forward, `model(tokens, step, caches)`, and
declares its caches (`model.cache_shapes(sizes)`); a step builds the `StepContext` from the host's batch and calls
it. The model is split into a static graph and flat params and rebuilt inside the trace (nnx.merge costs nothing at
run time), so the engine runs exactly the layer code that `model(input_ids)` runs. The step keeps the graph and an
abstract state (shapes only), never the model: its params are the runner's to place, and once it has placed them
on a mesh (`take_params`) nothing here keeps the unsharded arrays alive.
"""

from flax import nnx

from jaxmodels.engine.batch import DecodeBatch, ExtendBatch
from jaxmodels.nnx_params import abstract_state, merge_params, model_params, param_axes, param_blocks
from jaxmodels.precision import matmul_precision_for
from jaxmodels.step_context import StepContext


class ModelStep:
    def __init__(self, model, *, matmul_precision: str | None = None, mamba_ssm_cache_dtype=None):
        """`matmul_precision` overrides the model's own (its dtype's, or what load_model was told);
        `mamba_ssm_cache_dtype` the config's SSM state dtype (Nemotron-H only)."""
        self.config = model.config
        self.dtype = model.dtype
        self.matmul_precision = (matmul_precision_for(self.dtype, matmul_precision) if matmul_precision
                                 else model.matmul_precision)
        self._cache_options = dict(mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
        self.graphdef, state = nnx.split(model)
        self.state = abstract_state(state)
        # Bound to a model rebuilt from the abstract state: `model.cache_shapes` would keep `model`'s weights alive.
        self._model_cache_shapes = nnx.merge(self.graphdef, self.state).cache_shapes
        self.params = model_params(model)
        self.param_axes = param_axes(model)
        self.param_blocks = param_blocks(model)

    def take_params(self) -> dict:
        """The params, handed over: the step drops its reference, so a copy placed elsewhere (sharded over a mesh)
        leaves nothing here holding the original arrays."""
        params, self.params = self.params, None
        return params

    def cache_shapes(self, sizes) -> list:
        """Per layer, the ShapeDtypeStructs of its cache for pools of `sizes` (engine.cache.PoolSizes)."""
        return self._model_cache_shapes(sizes, **self._cache_options)

    def _model(self, params):
        """The model with `params` ({dotted path: array}, traced inside the step) in place, at the step's precision."""
        model = merge_params(self.graphdef, self.state, params)
        model.matmul_precision = self.matmul_precision
        return model

    def extend(self, params, caches, batch: ExtendBatch, dp_axis: str | None = None):
        """Packed chunks of prompts -> (logits of each sequence's last token [S, V], caches). `dp_axis`: the mesh
        axis of the data-parallel groups when the step runs inside the engine's shard_map over it."""
        step = StepContext.extend(positions=batch.positions, cu_seqlens=batch.cu_seqlens, page_table=batch.page_table,
                                  slot_ids=batch.slot_ids, has_prefix=batch.has_prefix, prompt_lens=batch.prompt_lens,
                                  dp_axis=dp_axis)
        return self._model(params)(batch.tokens, step, caches)

    def decode(self, params, caches, batch: DecodeBatch, tokens, dp_axis: str | None = None):
        """One token per row, tokens[B] -> (logits [B, V], caches)."""
        step = StepContext.decode(positions=batch.positions, page_table=batch.page_table, slot_ids=batch.slot_ids,
                                  dp_axis=dp_axis)
        return self._model(params)(tokens, step, caches)

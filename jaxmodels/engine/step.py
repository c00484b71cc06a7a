"""What every family's step object shares: the model split into a static graph and flat params, rebuilt inside the
jitted step (nnx.merge costs nothing at run time, so the steps run the same layer code as `model(input_ids)`)."""

from flax import nnx

from jaxmodels.models.registry import merge_params, model_params
from jaxmodels.precision import matmul_precision_for


class ModelStep:
    def __init__(self, model, *, matmul_precision: str | None = None):
        self.config = model.config
        self.dtype = model.dtype
        # The model's own precision (its dtype's, or what load_model was told) unless the engine overrides it.
        self.matmul_precision = (matmul_precision_for(self.dtype, matmul_precision) if matmul_precision
                                 else model.matmul_precision)
        self.graphdef, self.state = nnx.split(model)
        self.params = model_params(model)

    def _model(self, params):
        """The model with `params` ({dotted path: array}, traced inside the step) in place."""
        return merge_params(self.graphdef, self.state, params)

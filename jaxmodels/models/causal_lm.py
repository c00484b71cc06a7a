"""What the causal LMs share around their layer stacks: dtype and compute precision, the token embedding, the LM
head (or tied embeddings) and what a forward returns in each mode. The attribute names of the embedding and the final
norm differ per family (they mirror transformers' parameter names, which the bridge maps by rule)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.layers.linear import linear, lm_logits
from jaxmodels.precision import matmul_precision_for
from jaxmodels.step_context import StepContext


class CausalLM(nnx.Module):
    EMBEDDING = "embed_tokens"  # the attribute holding the nnx.Embed

    def _init_model(self, config, dtype, matmul_precision: str | None, rngs: nnx.Rngs | None) -> nnx.Rngs:
        """Set the config, dtype, precision and embedding; returns the rngs the layers draw from next."""
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.matmul_precision = matmul_precision_for(self.dtype, matmul_precision)
        setattr(self, self.EMBEDDING, nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                                embedding_metadata={"axes": ("vocab", "embed")}, rngs=rngs))
        return rngs

    def _init_head(self, rngs: nnx.Rngs) -> None:
        """The LM head, after the layers (so random inits draw in the order they always did)."""
        if not self.config.tie_word_embeddings:
            self.lm_head = linear(self.config.hidden_size, self.config.vocab_size, axes=("embed", "vocab"), rngs=rngs,
                                  dtype=self.dtype)

    def embed(self, input_ids) -> jax.Array:
        return getattr(self, self.EMBEDDING)(jnp.asarray(input_ids, jnp.int32))

    def logits(self, hidden: jax.Array) -> jax.Array:
        head = None if self.config.tie_word_embeddings else self.lm_head
        return lm_logits(hidden, getattr(self, self.EMBEDDING), head)

    def _layer_caches(self, caches: list | None) -> list:
        """A list to fill with each layer's updated cache: the step's caches, or one None per layer without a step."""
        return list(caches) if caches is not None else [None] * len(self.layers)

    def _output(self, hidden: jax.Array, step: StepContext | None, caches: list):
        """Final-normed hidden -> the forward's result: all logits without a step, else (logits of the step's
        `logit_rows`, caches)."""
        if step is None:
            return self.logits(hidden)
        return self.logits(hidden[step.logit_rows]), caches

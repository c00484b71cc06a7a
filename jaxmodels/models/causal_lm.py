"""What the causal LMs share around their layer stacks: dtype and compute precision, the token embedding, the LM
head (or tied embeddings), what a forward returns in each mode, and the multi-token-prediction (MTP) draft step. The
attribute names of the embedding and the final norm differ per family (they mirror transformers' parameter names,
which the bridge maps by rule).

Each family implements `_hidden_states` (its layer stack and final norm) and, when its config declares MTP layers,
`_mtp_hidden` (one MTP layer) and `mtp_checkpoint_prefixes` (where checkpoints keep the MTP layers' tensors).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.layers.linear import linear, lm_logits
from jaxmodels.precision import matmul_precision_for, precision_scope
from jaxmodels.step_context import StepContext


class CausalLM(nnx.Module):
    EMBEDDING = "embed_tokens"  # the attribute holding the nnx.Embed
    # Tensors stored under each MTP layer's checkpoint prefix that copy the target's embedding or LM head: loading
    # skips them and the MTP layers use the target's.
    MTP_COPIES_OF_TARGET: tuple[str, ...] = ()
    # Linear layers the family's FP8 checkpoints never quantize (wildcards over module paths; jaxmodels.quantization).
    FP8_UNQUANTIZED: tuple[str, ...] = ("lm_head",)

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

    @classmethod
    def mtp_checkpoint_prefixes(cls, config) -> dict[str, str]:
        """{param path prefix: checkpoint name prefix} of the MTP layers `config` declares (empty for none)."""
        return {}

    def __call__(self, input_ids: jax.Array, step: StepContext | None = None, caches: list | None = None,
                 **options):
        """Without a step: int32[B, T] -> float32[B, T, V], the full causal forward with no cache.

        With one: the step's packed int32[T] over `caches` (as `cache_shapes` lays them out) ->
        (logits float32[R, V] of the step's `logit_rows`, updated caches). `options` are the family's (see its
        `_hidden_states`).
        """
        with precision_scope(self.matmul_precision):
            hidden, caches = self._hidden_states(input_ids, step, caches, **options)
            if step is None:
                return self.logits(hidden)
            return self.logits(hidden[step.logit_rows]), caches

    def forward_hidden(self, input_ids: jax.Array, step: StepContext, caches: list):
        """The engine's step up to the LM head: (final-normed hidden states [T, H] of every packed token, caches);
        `logits` turns rows of them into logits. Speculative decoding drafts from these hidden states."""
        with precision_scope(self.matmul_precision):
            return self._hidden_states(input_ids, step, caches)

    def commit_verified(self, caches: list, step: StepContext, accepted: jax.Array) -> list:
        """After a VERIFY step: advance the recurrent state of each request by its verified token and its first
        accepted[s] drafts (see StepContext). Attention caches need nothing: the rejected drafts' keys sit past the
        request's length, where the next steps overwrite them before anything reads them. Families with recurrent
        layers override this."""
        return caches

    def hidden_states(self, input_ids: jax.Array, **options) -> jax.Array:
        """int32[B, T] -> [B, T, H]: the last hidden states of the full causal forward, final norm applied: what the
        LM head reads, and what the MTP layers draft from (`mtp_step`)."""
        with precision_scope(self.matmul_precision):
            return self._hidden_states(input_ids, None, None, **options)[0]

    @property
    def num_mtp_layers(self) -> int:
        """How many MTP layers the model has (0: it cannot draft tokens for speculative decoding)."""
        return self.config.num_nextn_predict_layers

    def mtp_step(self, hidden: jax.Array, next_tokens: jax.Array, *, depth: int = 0, **options):
        """One MTP draft step over whole sequences: (logits float32[B, T, V], hidden [B, T, H]).

        At depth 0, `hidden`[:, t] is the target's `hidden_states` at position t and `next_tokens`[:, t] the token
        at t + 1; the logits predict the token at t + 2. A deeper step takes the hidden this step returns and the
        tokens one further on, and runs MTP layer `depth % num_mtp_layers` (a model with one MTP layer reuses it
        for every depth, as SGLang and vLLM do). Each step attends causally over the sequence, at the target's
        positions 0..T-1.
        """
        if not self.num_mtp_layers:
            raise ValueError("the model has no multi-token-prediction (MTP) layers, so it cannot draft tokens: its "
                             "config declares none (num_nextn_predict_layers = 0), or load_model was given "
                             "load_mtp=False")
        with precision_scope(self.matmul_precision):
            hidden = self._mtp_hidden(depth % self.num_mtp_layers, hidden, self.embed(next_tokens), **options)
            return self.logits(hidden), hidden

    def mtp_forward(self, hidden: jax.Array, next_tokens: jax.Array, step: StepContext, caches: list, *,
                    depth: int = 0):
        """`mtp_step` in the engine: the step's packed tokens, hidden[T, H] (the target's, or the previous depth's)
        and next_tokens int32[T] (each the token one position on) -> (normed output [T, H], caches of the MTP layers,
        as `mtp_cache_shapes` lays them out). The MTP layers keep their own paged caches, indexed like the target's
        by the step's page table and positions."""
        with precision_scope(self.matmul_precision):
            return self._mtp_hidden(depth % self.num_mtp_layers, hidden, self.embed(next_tokens), step=step,
                                    caches=caches)

    def embed(self, input_ids) -> jax.Array:
        return getattr(self, self.EMBEDDING)(jnp.asarray(input_ids, jnp.int32))

    def logits(self, hidden: jax.Array) -> jax.Array:
        head = None if self.config.tie_word_embeddings else self.lm_head
        return lm_logits(hidden, getattr(self, self.EMBEDDING), head)

    def _layer_caches(self, caches: list | None) -> list:
        """A list to fill with each layer's updated cache: the step's caches, or one None per layer without a step."""
        return list(caches) if caches is not None else [None] * len(self.layers)

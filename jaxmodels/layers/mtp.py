"""The input of a multi-token-prediction (MTP) layer, the same in both families.

An MTP layer drafts the token after next. At position t it fuses the target's last hidden state h_t, final norm
applied (what the target's LM head reads), with the embedding of the token at t + 1:

    eh_proj([enorm(embed(token_{t+1})) ; hnorm(h_t)])        # eh_proj: 2H -> H, no bias

then runs a decoder layer (in Nemotron-H a short run of blocks) causally over the sequence at the target's positions,
and a final norm before the target's LM head. A deeper draft feeds that normed output back in as h.

Read in vLLM (`deepseek_mtp.py`, `nemotron_h_mtp.py`; `deepseek_v2.py` returns the final-normed hidden states the
proposer hands over), SGLang (`deepseek_nextn.py`, `nemotron_h_mtp.py`) and Megatron-LM
(`multi_token_prediction.py`, which trains Nemotron's MTP layers on its decoder's final-normed output): all put the
embedding first and take the final-normed target state. Where they differ we follow SGLang and Megatron-LM: vLLM's
DeepSeek MTP also zeroes the embedding at position 0 and chains its deeper drafts on the output before the MTP
layer's final norm; neither of the other two does.

In checkpoints `enorm`, `hnorm` and `eh_proj` sit beside the layer's own weights, so they are attributes of the module
that opens the layer (this mixin) rather than a submodule.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.layers.linear import linear
from jaxmodels.layers.norms import RMSNorm


class MTPInputFusion:
    """Mixin for the nnx.Module that opens an MTP layer: `init_input_fusion` in its __init__, `fuse_inputs` first in
    its forward."""

    def init_input_fusion(self, hidden_size: int, eps: float, *, rngs: nnx.Rngs, dtype, scale_in_float32: bool):
        self.enorm = RMSNorm(hidden_size, eps, dtype=dtype, scale_in_float32=scale_in_float32)
        self.hnorm = RMSNorm(hidden_size, eps, dtype=dtype, scale_in_float32=scale_in_float32)
        self.eh_proj = linear(2 * hidden_size, hidden_size, axes=("embed", "embed"), rngs=rngs, dtype=dtype)

    def fuse_inputs(self, token_embeddings: jax.Array, hidden: jax.Array) -> jax.Array:
        """Embeddings of the tokens at t + 1 [..., H] and hidden states at t [..., H] -> the layer's input [..., H]."""
        return self.eh_proj(jnp.concatenate([self.enorm(token_embeddings), self.hnorm(hidden)], axis=-1))

"""Reference multi-token-prediction (MTP) layers in torch, for parity tests: transformers does not build MTP layers,
so these assemble one from transformers' own layer classes, and give its weights under the names published
checkpoints use (for `hf_models.append_tensors`).

A reference MTP layer is `eh_proj([enorm(embedding of token t+1) ; hnorm(h_t)])` fed as `inputs_embeds` to a
transformers base model of the family whose layers are the MTP layer's decoder layer (DeepSeek-V3.2, GLM-5) or
blocks (Nemotron-H) and whose final norm is the MTP layer's; the target's LM head turns its output into logits. h_t is
the target's `last_hidden_state`, final norm applied (transformers' `hidden_states[-1]` is the same tensor).
"""

import os
import tempfile

import torch
from safetensors.torch import load_file

from tests.hf_models import append_tensors, make_dsa, make_nemotron_h, perturb_norms_and_router_biases, save

VARIANTS = ("deepseek_v32", "glm_moe_dsa", "nemotron_h_moe")


class ReferenceMTPLayer(torch.nn.Module):
    def __init__(self, stack, final_norm: torch.nn.Module, eps: float):
        super().__init__()
        hidden_size = stack.config.hidden_size
        self.enorm = type(final_norm)(hidden_size, eps=eps)
        self.hnorm = type(final_norm)(hidden_size, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.stack = stack

    def forward(self, hidden: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        fused = self.eh_proj(torch.cat([self.enorm(token_embeddings), self.hnorm(hidden)], dim=-1))
        return self.stack(inputs_embeds=fused).last_hidden_state

    def fusion_tensors(self, prefix: str) -> dict:
        """{checkpoint name: tensor} of `enorm`, `hnorm` and `eh_proj`, under `prefix`."""
        return {prefix + name: tensor for name, tensor in self.state_dict().items() if not name.startswith("stack.")}


def save_with_mtp(variant: str, directory, seed: int = 1, **overrides):
    """A tiny target whose config declares one MTP layer (`variant`: one of VARIANTS; `overrides` for its config),
    saved to `directory` with a random reference MTP layer's tensors appended. Returns (target, reference MTP layer)."""
    target, mtp_layer, published, _ = _target_with_mtp_layer(variant, seed, **overrides)
    append_tensors(save(target, directory), published(target, mtp_layer))
    return target, mtp_layer


def _target_with_mtp_layer(variant: str, seed: int, **overrides):
    """(target, random reference MTP layer, the function giving its published tensors, the attribute name of the
    family's final norm)."""
    if variant == "nemotron_h_moe":
        target = make_nemotron_h("moe", num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"],
                                 **overrides)
        return target, nemotron_h_mtp_layer(target, seed), nemotron_h_published_tensors, "norm_f"
    target = make_dsa(variant, num_nextn_predict_layers=1, **overrides)
    return target, dsa_mtp_layer(target, seed), dsa_published_tensors, "norm"


def chained_draft_logits(target, mtp_layer, input_ids, depths: int) -> list[torch.Tensor]:
    """The logits of `depths` chained drafts over whole sequences: draft d reads the hidden state draft d - 1 returned
    (the target's at d = 0) at positions 0..T-d-2 and the tokens at d + 1.., and predicts the tokens at d + 2..."""
    input_ids = torch.as_tensor(input_ids)
    with torch.no_grad():
        hidden = target.model(input_ids).last_hidden_state
        logits = []
        for depth in range(depths):
            hidden = mtp_layer(hidden[:, :-1], target.get_input_embeddings()(input_ids[:, depth + 1 :]))
            logits.append(target.lm_head(hidden).float())
    return logits


def _reference_layer(target, raw: dict, seed: int, *, final_norm: str, eps: float) -> ReferenceMTPLayer:
    """The MTP layer around a random stack of the target's family built from config dict `raw`, its final norm
    (attribute `final_norm` of the stack) closing the layer; norms and router biases perturbed."""
    torch.manual_seed(seed)
    stack = type(target.model)(type(target.config).from_dict(raw)).eval()
    layer = ReferenceMTPLayer(stack, getattr(stack, final_norm), eps).eval()
    perturb_norms_and_router_biases(layer)
    return layer


def dsa_mtp_layer(target, seed: int) -> ReferenceMTPLayer:
    """A random MTP layer for a DeepSeek-V3.2 / GLM-5 `target`: a MoE decoder layer with its own indexer."""
    raw = target.config.to_dict()
    # The attention kind's name differs across transformers versions: keep the target's own for the one layer.
    one_layer = dict(num_hidden_layers=1, mlp_layer_types=["sparse"], layer_types=raw.get("layer_types", [])[:1],
                     indexer_types=["full"])
    raw.update({key: value for key, value in one_layer.items() if key in raw})
    return _reference_layer(target, raw, seed, final_norm="norm", eps=target.config.rms_norm_eps)


def dsa_published_tensors(target, mtp_layer: ReferenceMTPLayer) -> dict:
    """{checkpoint name: tensor} of the MTP layer, stored as DeepSeek does: decoder layer `num_hidden_layers`, with
    copies of the target's embedding and LM head."""
    prefix = f"model.layers.{target.config.num_hidden_layers}."
    others = {"norm.weight": prefix + "shared_head.norm.weight", "embed_tokens.weight": None}
    tensors = _renamed(_saved_tensors(mtp_layer.stack), layers=("layers.0.", prefix), others=others)
    copies = {prefix + "embed_tokens.weight": target.model.embed_tokens.weight,
              prefix + "shared_head.head.weight": target.lm_head.weight}
    return {**tensors, **mtp_layer.fusion_tensors(prefix), **copies}


def nemotron_h_mtp_layer(target, seed: int) -> ReferenceMTPLayer:
    """A random MTP layer for a Nemotron-H `target`, of the blocks its config's `mtp_layers_block_type` lists."""
    raw = target.config.to_dict()
    raw["layers_block_type"] = raw["mtp_layers_block_type"]
    return _reference_layer(target, raw, seed, final_norm="norm_f", eps=target.config.layer_norm_epsilon)


def nemotron_h_published_tensors(target, mtp_layer: ReferenceMTPLayer) -> dict:
    """{checkpoint name: tensor} of the MTP layer as NVIDIA stores it: blocks `mtp.layers.{j}` at the top level, the
    fusion on the first block and `final_layernorm` on the last; no copies of the embedding or LM head."""
    last = len(target.config.mtp_layers_block_type) - 1
    others = {"norm_f.weight": f"mtp.layers.{last}.final_layernorm.weight", "embeddings.weight": None}
    tensors = _renamed(_saved_tensors(mtp_layer.stack), layers=("layers.", "mtp.layers."), others=others)
    return {**tensors, **mtp_layer.fusion_tensors("mtp.layers.0.")}


def _saved_tensors(model) -> dict:
    """`model`'s weights as `save_pretrained` writes them: the published layout, one tensor per expert."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return load_file(os.path.join(directory, "model.safetensors"))


def _renamed(tensors: dict, *, layers: tuple[str, str], others: dict) -> dict:
    """`tensors` under their checkpoint names: the names under the prefix `layers[0]` move under `layers[1]`, the
    others as `others` maps them (None: dropped; a name it lacks fails)."""
    old_prefix, new_prefix = layers
    renamed = {}
    for name, tensor in tensors.items():
        new_name = new_prefix + name.removeprefix(old_prefix) if name.startswith(old_prefix) else others[name]
        if new_name is not None:
            renamed[new_name] = tensor
    return renamed


# The projections that write a layer's output back into the residual stream (attention, Mamba, MLP, experts).
OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def save_with_drafting_mtp(variant: str, directory, *, target_scale: float, seed: int = 1):
    """A checkpoint (`variant`: one of VARIANTS) whose MTP layer drafts what a context-free target would predict,
    for tests of acceptance. Returns the target.

    The MTP layer's own blocks add nothing (their output projections are zero), `eh_proj` passes the next token's
    normed embedding through and drops the hidden state, and its final norm is the target's: it maps the token at
    t + 1 to lm_head(norm(embedding)), i.e. the token the target would predict after it if the target's layers added
    nothing either. The target's output projections are scaled by `target_scale`: at 0 the target is exactly that
    context-free map (RMS norm is scale invariant, so norm(enorm(e)) = norm(e) up to its epsilon) and every draft is
    accepted; a small scale makes the target depend on its context (Mamba state and attention included) while most
    drafts still agree.
    """
    target, mtp_layer, published, final_norm = _target_with_mtp_layer(variant, seed)
    hidden_size = target.config.hidden_size
    with torch.no_grad():
        for name, tensor in target.model.layers.named_parameters():
            if name.endswith(OUTPUT_PROJECTIONS):
                tensor.mul_(target_scale)
        for name, tensor in mtp_layer.stack.named_parameters():
            if name.endswith(OUTPUT_PROJECTIONS):
                tensor.zero_()
        mtp_layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden_size), torch.zeros(hidden_size, hidden_size)], 1))
        mtp_layer.enorm.weight.fill_(1.0)
        getattr(mtp_layer.stack, final_norm).weight.copy_(getattr(target.model, final_norm).weight)
    append_tensors(save(target, directory), published(target, mtp_layer))
    return target

"""Run in a subprocess with 8 simulated CPU devices (XLA_FLAGS must be set before jax starts)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmodels
from jaxmodels.nnx_params import merge_params, model_params, param_axes
from sharding import make_mesh, param_partition_specs, shard_params, spec_for
from sharding.rules import ALL
from tests.hf_models import make_nemotron_h, save
from tests.numerics import max_relative_error


def main(directory: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    model = jaxmodels.load_model(save(make_nemotron_h("moe", seed=2), directory), progress=False)
    ids = np.random.default_rng(0).integers(0, 97, size=(4, 19))
    expected = np.asarray(model(ids))

    mesh = make_mesh(dp=2, tp=4)
    params, axes = model_params(model), param_axes(model)
    specs = param_partition_specs(params, axes, mesh)
    assert specs["layers.1.mixer.experts.up_proj"] == P(ALL, None, None)
    assert specs["layers.2.mixer.q_proj.kernel"] == P(None, "tp")
    assert specs["layers.0.mixer.in_proj.kernel"] == P(None, None)
    up, down = axes["layers.1.mixer.experts.up_proj"], axes["layers.1.mixer.experts.down_proj"]
    assert (up, down) == (("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed"))
    # Six experts do not divide over 8 devices: each expert's intermediate dimension is split instead.
    assert spec_for(up, (6, 48, 16), mesh) == P(None, None, ALL)
    assert spec_for(down, (6, 16, 48), mesh) == P(None, ALL, None)
    assert spec_for(up, (6, 48, 12), mesh) == P(None, None, None)
    assert spec_for(axes["layers.2.mixer.q_proj.kernel"], (48, 6), mesh) == P(None, None)
    sharded = shard_params(params, axes, mesh)
    assert len(sharded["layers.1.mixer.experts.up_proj"].sharding.device_set) == 8

    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(params, ids):
        return merge_params(graphdef, state, params)(ids)

    ids_sharded = jax.device_put(jnp.asarray(ids, jnp.int32), NamedSharding(mesh, P("dp", None)))
    got = np.asarray(forward(sharded, ids_sharded))
    error = max_relative_error(got, expected)
    assert error < 1e-5, error
    print(f"sharded forward matches: relative error {error:.2e}")


if __name__ == "__main__":
    main(sys.argv[1])

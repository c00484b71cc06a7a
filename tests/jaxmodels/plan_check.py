"""Run in a subprocess started without device flags: the plan command arranges its 8 simulated CPU devices itself,
plans a tiny hybrid Nemotron-H (Mamba, attention, MLP and MoE blocks) on a dp=2 x tp=4 mesh, and in the same
process the engine built for real (random weights) on that mesh is what its numbers must equal: per-device weight
and cache bytes, and the collectives of the decode program.
"""

import contextlib
import io
import json
import os
import re
import sys

from jaxmodels import plan

CONFIG = {"model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 64, "hybrid_override_pattern": "M*EM-E",
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 128,
          "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
          "chunk_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "moe_shared_expert_intermediate_size": 64, "max_position_embeddings": 4096}
LIMITS = ["--max-batch-size", "8", "--max-seq-len", "64", "--decode-sizes", "4", "--prefill-sizes", "16"]


def bytes_on_each_device(arrays) -> set[int]:
    """The bytes each device holds of real (sharded) arrays, as a set over the devices."""
    import jax

    held = {}
    for array in jax.tree.leaves(arrays):
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return set(held.values())


def main(directory: str) -> None:
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(CONFIG, f)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        (planned,) = plan.main(["--config", path, "--dp", "2", "--tp", "4", "--devices", "8", "--buckets", "largest",
                                *LIMITS])
    assert "| dp=2 x tp=4 | ours | 8 |" in printed.getvalue(), printed.getvalue()
    assert "Collectives of dp=2 x tp=4's decode step" in printed.getvalue()
    print("the plan prints its table")

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmodels.engine.engine import Engine
    from jaxmodels.families import load_config, model_class
    from jaxmodels.plan_collectives import collectives
    from jaxmodels.plan_fit import cache_bytes
    from sharding import make_mesh

    assert jax.device_count() == 8 and jax.default_backend() == "cpu"
    config = load_config(CONFIG)
    model = model_class(config)(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    engine = Engine(model, mesh=make_mesh(2, 4), warmup=False, progress=False, launch_thread=False,
                    **planned.limits)
    runner = engine.runner
    assert bytes_on_each_device(runner.params) == {planned.weights}, (bytes_on_each_device(runner.params), planned)
    print(f"weights: {planned.weights} bytes on every device, as the engine places them")
    assert bytes_on_each_device(runner.caches) == {planned.caches}
    assert cache_bytes(planned, 8, 64) == planned.caches  # the fit solver prices the planned pools exactly
    print(f"caches: {planned.caches} bytes on every device, as the engine allocates them")

    (decode_job, *_) = planned.decode_jobs
    hlo = runner.programs.executable(decode_job).as_text()
    (decode_plan,) = [p for p in planned.programs if p.job == decode_job]
    assert collectives(hlo, 8) == decode_plan.collectives
    opcodes = re.findall(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo)
    assert len(opcodes) == len(decode_plan.collectives) > 0
    kinds = {c.kind for c in decode_plan.collectives}
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= kinds, kinds  # MoE over groups, heads over tp
    print(f"collectives: the {len(opcodes)} of the engine's compiled decode program")


if __name__ == "__main__":
    main(sys.argv[1])

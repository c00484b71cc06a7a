"""Run in a subprocess with 8 simulated CPU devices: LLM with dp x tp > 1 serves the tokens of the 1-device LLM.

Each dp group serves its own requests from its own slice of the cache pools (DP attention); MLP and MoE weights are
split over all devices. Four prompts on up to eight groups leave some groups idle.
"""

import gc
import sys

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxmodels
import pallas_kernels
from jaxmodels.engine.programs import ON_DEMAND
from jaxmodels.step_context import StepKind
from tests.hf_models import make_dsa, make_nemotron_h, save

# One bucket of each kind (compiled before serving: warm-up "all"), so that the count of compiled programs shows any
# compilation while serving.
LIMITS = dict(max_batch_size=8, max_seq_len=64, prefill_sizes=[8], warmup="all", progress=False)
MESHES = ((2, 1), (2, 2), (4, 2), (8, 1), (1, 2))


def serve(path, prompts, **options):
    decode_sizes = [LIMITS["max_batch_size"] // options.get("dp", 1)]  # per dp group
    llm = jaxmodels.LLM(path, dtype="float32", decode_sizes=decode_sizes, **LIMITS, **options)
    programs = llm.engine.runner.programs
    compiled = set(programs._compiled)
    greedy = llm.generate(prompts, jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.0))
    sampled = llm.generate(prompts, jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3))
    # Only the samplers compiled on demand (off the step path: the sampled requests waited for them) are new.
    on_demand = {job for kind in ON_DEMAND for job in programs.bucket_jobs(kind, 0)}
    assert set(programs._compiled) - compiled <= on_demand, "a step program was compiled after warm-up"
    return llm, [o.token_ids for o in greedy], [o.token_ids for o in sampled]


def check_compiled_layout(llm, dp: int, tp: int) -> None:
    """The decode executable's input shardings: cache pools split over dp (each device holds 1/dp of every pool),
    KV heads over tp, routed experts over all devices."""
    runner = llm.engine.runner
    decode = runner.programs.executable((StepKind.DECODE, runner.decode_sizes[-1]))
    params_in, caches_in = decode.input_shardings[0][:2]
    for cache, shardings in zip(runner.caches, caches_in):
        if cache is None:
            continue
        for name in ("ssm", "k"):
            if getattr(cache, name, None) is None:
                continue
            array, sharding = getattr(cache, name), getattr(shardings, name)
            assert sharding.spec[0] == "dp", (name, sharding.spec)
            assert sharding.shard_shape(array.shape)[0] == array.shape[0] // dp, (name, sharding.spec)
            if name == "k":
                assert sharding.spec == P("dp", None, "tp", None), sharding.spec
    experts = [(s, value.shape) for name, s, value in zip(runner.param_names, params_in, runner.params)
               if name.endswith("experts.up_proj")]
    assert experts and all(s.shard_shape(shape)[0] == shape[0] // (dp * tp) for s, shape in experts)


# The kernels that take arrays split over "tp" (experts, KV heads): on a GPU each is a custom call, which XLA cannot
# partition, so the layers must call them manual over "tp" (jaxmodels.layers.tensor_parallel).
TP_SPLIT_KERNELS = ("grouped_matmul", "paged_attention")


def record_kernel_calls(calls: list) -> None:
    """Wrap the TP_SPLIT_KERNELS so each call appends (kernel, the mesh axes the code is manual over) while the
    engine traces its programs."""
    for name in TP_SPLIT_KERNELS:
        def recording(*args, _kernel=getattr(pallas_kernels, name), _name=name, **kwargs):
            calls.append((_name, tuple(jax.sharding.get_abstract_mesh().manual_axes)))
            return _kernel(*args, **kwargs)

        setattr(pallas_kernels, name, recording)


def unsharded_param_copies(llm) -> list:
    """Live arrays on one device shaped like one of the engine's params: the loaded model's copies, which sharding
    over the mesh should have left unreferenced."""
    shapes = {param.shape for param in llm.engine.runner.params}
    gc.collect()
    return [a for a in jax.live_arrays() if len(a.sharding.device_set) == 1 and a.shape in shapes]


def main(directory: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    calls = []
    record_kernel_calls(calls)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (1, 6, 13, 27)]
    for name, hf_model in (("nemotron_h_moe", make_nemotron_h("moe")), ("deepseek_v32", make_dsa("deepseek_v32"))):
        path = save(hf_model, f"{directory}/{name}")
        greedy_1, sampled_1 = serve(path, prompts)[1:]  # the 1-device LLM, and its params, dropped at once
        for dp, tp in MESHES:
            calls.clear()
            llm, greedy_n, sampled_n = serve(path, prompts, dp=dp, tp=tp)
            assert {kernel for kernel, _ in calls} == set(TP_SPLIT_KERNELS[:1 if name == "deepseek_v32" else 2])
            if tp > 1:  # never on arrays the compiler splits over "tp"
                assert all("tp" in manual for _, manual in calls), (name, dp, tp, calls)
            assert greedy_n == greedy_1, (name, dp, tp, greedy_n, greedy_1)
            assert sampled_n == sampled_1, (name, dp, tp, sampled_n, sampled_1)
            check_compiled_layout(llm, dp, tp)
            assert llm.model is None and not unsharded_param_copies(llm)
            print(f"{name}: dp={dp} tp={tp} serves the 1-device tokens")


if __name__ == "__main__":
    main(sys.argv[1])

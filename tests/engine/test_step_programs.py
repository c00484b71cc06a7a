"""The step programs the engine sends to a GPU hold no XLA control flow.

On the GPU an XLA while loop or conditional copies its predicate to the host and waits for it, blocking the thread
that launches the step until the device has caught up; the engine then cannot schedule step N+1 while step N runs.
(Measured on the H200: with a conditional in the sampler and while loops from jnp.searchsorted, 93-97% of every
decode step's wall time was spent inside the launch. jax 0.11 lowers jnp.cumsum to a chlo.scan, whose portable
form is a while loop too.) Loops inside Pallas kernels run on the device and are fine. The programs are lowered for
CUDA here, on any machine, with the kernels' GPU paths selected.
"""

import re

import pytest

from jaxmodels.engine.cache import PoolSizes
from jaxmodels.engine.runner import Runner
from jaxmodels.engine.step import ModelStep
from pallas_kernels import _dispatch
from tests.hf_models import TINY_CONFIGS, build_from_config


def control_flow(text: str) -> list[str]:
    """The XLA while / case / if ops of a StableHLO module, each with the function it sits in: jax lowers a nested
    jit (jnp.searchsorted's `_searchsorted_scan_impl`, say) to a private function, which names the culprit."""
    found, function = [], "?"
    for line in text.splitlines():
        header = re.search(r"func\.func (?:public |private )?@([\w.$-]+)", line)
        if header:
            function = header.group(1)
        op = re.search(r"stablehlo\.(while|case|if)\b", line)
        if op:
            found.append(f"{op.group(1)} in {function}")
    return found


# With speculative decoding: one MTP layer (attention + MoE blocks for Nemotron-H).
MTP = {"nemotron_h": dict(num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"]),
       "deepseek_v32": dict(num_nextn_predict_layers=1)}


@pytest.mark.parametrize("speculative", [0, 2])
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_step_programs_have_no_xla_control_flow(model_type, speculative, monkeypatch, cuda_lowering):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    model = build_from_config({**TINY_CONFIGS[model_type], **(MTP[model_type] if speculative else {})}, "bfloat16")
    step = ModelStep(model, num_speculative_tokens=speculative)
    runner = Runner(step, PoolSizes.from_limits(max_batch_size=2, max_seq_len=16), decode_sizes=[2],
                    prefill_sizes=[8], max_seqs_per_extend=2)
    programs = {}
    for job in runner.programs.jobs():
        program, args = runner.programs.program_and_args(job)
        programs[job] = cuda_lowering(program, *args)
    for name, text in programs.items():
        assert not control_flow(text), (name, control_flow(text))

"""bench/speculative.py runs end to end on CPU with a tiny config: the always-agreeing drafter has every draft
stand, and each row carries its bound; `--floors-only` prints the bounds from a real config's shapes."""

import json
import os
import re
import subprocess
import sys

from tests.hf_models import TINY_CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(*args: str) -> str:
    result = subprocess.run([sys.executable, "bench/speculative.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_agreeing_drafter_has_every_draft_stand(tmp_path):
    config, rows = tmp_path / "config.json", tmp_path / "rows.json"
    config.write_text(json.dumps(TINY_CONFIGS["nemotron_h"]))
    run_bench("--config", str(config), "--batches", "2", "--ks", "1", "--tokens", "2", "--prompt-len", "8",
              "--drafters", "agreeing", "--json", str(rows))
    by_drafter = {row["drafter"]: row for row in json.loads(rows.read_text())}
    assert set(by_drafter) == {"-", "agreeing"}
    assert by_drafter["agreeing"]["accept_rate"] == 1.0 and by_drafter["agreeing"]["k"] == 1
    assert by_drafter["-"]["bound"] == 1.0 and by_drafter["agreeing"]["bound"] > 0


def test_floors_only_bounds_a_moe_model_below_plain_decoding_at_one_sequence():
    """DeepSeek's verify step at B=1, k=3 reads the experts of 4 tokens: at 0.7 per draft the bound is below 1x
    (docs/BENCHMARKS.md, docs/serving.md)."""
    out = run_bench("--config", "bench/configs/deepseek_v32_4layer.json", "--batches", "1", "--ks", "3",
                    "--accept", "0.7", "--floors-only")
    row = re.search(r"^\| 1 \| .* \| ([\d.]+)x \|$", out, re.MULTILINE)
    assert row, out
    assert float(row.group(1)) < 1

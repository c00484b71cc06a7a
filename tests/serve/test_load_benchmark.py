"""bench/serve_load.py runs end to end on CPU (--smoke) and both runs produce all the tokens asked for."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_load_benchmark_smoke_compares_http_with_generate():
    result = subprocess.run([sys.executable, "bench/serve_load.py", "--smoke", "--no-progress"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {run: int(tokens) for run, tokens in re.findall(r"^\| (LLM.generate|HTTP streams) \| 16 \| (\d+) \|",
                                                            result.stdout, re.MULTILINE)}
    assert rows == {"LLM.generate": 16 * 16, "HTTP streams": 16 * 16}
    assert re.search(r"^headline: HTTP [\d,]+ output tok/s = \d+% of LLM.generate's", result.stdout, re.MULTILINE)

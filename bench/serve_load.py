"""HTTP serving vs LLM.generate on the same work (the code lives in `jaxmodels/serve/benchmark.py`).

    PYTHONPATH=. python3 bench/serve_load.py --config bench/configs/nemotron_h_nano9b.json --layers 8 \
        --requests 256 --prompt-len 128 --max-tokens 128
    PYTHONPATH=. python3 bench/serve_load.py --smoke      # CPU, a tiny random model
"""

from jaxmodels.serve.benchmark import main

if __name__ == "__main__":
    main()

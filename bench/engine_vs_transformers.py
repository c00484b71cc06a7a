"""The serving benchmark on the GPU machine (code in `jaxmodels/benchmark.py`, also `python -m jaxmodels bench`):

    PYTHONPATH=. python3 bench/engine_vs_transformers.py --config bench/configs/nemotron_h_nano9b.json \\
        --compare-transformers --profile /tmp/profile
"""

from jaxmodels.benchmark import main

if __name__ == "__main__":
    main()

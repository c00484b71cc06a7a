"""Engine vs transformers on the H200 (the code lives in `jaxmodels/benchmark.py`, also `python -m jaxmodels bench`).

    PYTHONPATH=. python3 bench/engine_vs_transformers.py --config bench/configs/nemotron_h_nano9b.json \
        --layers 8 --batch 16 --prompt-len 512 --new-tokens 128
"""

from jaxmodels.benchmark import main

if __name__ == "__main__":
    main()

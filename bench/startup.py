"""Start-up on the GPU: a new user's cold and warm start, the padding cost of bucket lists, a checkpoint's load.

    python3 bench/startup.py start --config bench/configs/nemotron_h_nano30b_a3b.json [--compilation-cache DIR]
    python3 bench/startup.py padding --config bench/configs/nemotron_h_nano9b.json
    python3 bench/startup.py load --config bench/configs/nemotron_h_nano9b.json --checkpoint /tmp/nano9b

See jaxmodels/benchmark_startup.py for what each measures.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxmodels.benchmark_startup import main  # noqa: E402

if __name__ == "__main__":
    main()

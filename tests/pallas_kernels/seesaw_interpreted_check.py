"""Run in a subprocess with 4 simulated CPU devices: the Mosaic sparse MLA kernel's seesaw schedule in Mosaic GPU's
interpreter, against dense attention (`python -m tests.pallas_kernels.seesaw_interpreted_check dense|listed SETTINGS`).

Why a subprocess: the interpreter runs each warpgroup as an XLA computation on the CPU client's thread pool, whose
size follows the cores and the devices. On a 2-core machine two warpgroups blocked on barriers can hold the pool while
the third, the one they wait for, waits for a thread: the seesaw with its copies arriving on their barriers hung in 5
runs of 5 there, and passed in 4 of 4 with 4 simulated devices (2026-12-05).
"""

import sys

from tests.pallas_kernels.test_sparse_mla_mosaic import (check_against_dense_attention, check_listed_counts,
                                                         interpreted, set_seesaw)


def main(lists: str, settings: str):
    set_seesaw(settings)
    if lists == "dense":
        check_against_dense_attention(lambda q, c, i: interpreted(q, c, i, num_splits=2), T=4, H=128, topk=320,
                                      num_pages=8)
    else:
        check_listed_counts(lambda q, c, i, n: interpreted(q, c, i, n, num_splits=2), T=6, topk=200,
                            counts=[200, 1, 0, 65, 64, 130])
    print(f"seesaw, {lists} lists, {settings}: equals dense masked attention")


if __name__ == "__main__":
    main(*sys.argv[1:])

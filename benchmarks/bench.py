"""``shardtune bench`` as a script: the same arguments, e.g.

python benchmarks/bench.py --shape mistral-7b --seq 4096 --batch 2 --gradient-checkpointing --baseline hf
"""

from __future__ import annotations

import sys

from shardtune.entry import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

import sys

from shardtune.cli import main

sys.exit(main())

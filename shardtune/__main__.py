import sys

from shardtune.entry import main

sys.exit(main())

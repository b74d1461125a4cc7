import sys

from shardtune.entry import main
from shardtune.launch.local import exit_worker, running_as_worker

status = main()
if running_as_worker():
    # A worker that stopped on an error (its line said, its process group destroyed) ends like one that
    # finished: without the interpreter's finalization, whose rare SIGABRT would turn exit 2 into a crash.
    exit_worker(status)
sys.exit(status)

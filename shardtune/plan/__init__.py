"""``shardtune plan``: size a run offline (strategy, memory per GPU, steps) with the estimate the doctor uses."""

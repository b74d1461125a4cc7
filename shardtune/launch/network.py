"""The ``network`` config section, as the NCCL_* / GLOO_* environment of every worker.

Seed 002 needed six hand-typed exports on every node before two nodes would talk; here they come from
the config, so every node of a run gets the same ones. Variables the user already exported win: a
cluster's module system often sets them, and it knows its fabric better than a config file written
elsewhere.
"""

from __future__ import annotations

import os

from shardtune.config import NetworkConfig


def network_environment(network: NetworkConfig) -> dict[str, str]:
    """The variables ``network`` asks for (not yet merged with the caller's environment)."""
    variables: dict[str, str] = {}
    if network.socket_ifname:
        variables["NCCL_SOCKET_IFNAME"] = network.socket_ifname
        # gloo takes one interface name, not NCCL's exclusion (^) or exact-match (=) syntax.
        gloo_ifname = _first_plain_interface(network.socket_ifname)
        if gloo_ifname:
            variables["GLOO_SOCKET_IFNAME"] = gloo_ifname
    if network.ib is False:
        variables["NCCL_IB_DISABLE"] = "1"
        variables["NCCL_NET"] = "Socket"
    elif network.ib is True:
        variables["NCCL_IB_DISABLE"] = "0"
    if network.nccl_debug:
        variables["NCCL_DEBUG"] = network.nccl_debug
    if network.nccl_socket_nthreads:
        variables["NCCL_SOCKET_NTHREADS"] = str(network.nccl_socket_nthreads)
    if network.nccl_nsocks_perthread:
        variables["NCCL_NSOCKS_PERTHREAD"] = str(network.nccl_nsocks_perthread)
    # A collective that fails on one rank must fail on all, not leave the others hanging.
    variables["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    variables.update(network.env)
    return variables


def apply_network_environment(network: NetworkConfig) -> dict[str, str]:
    """Set the variables in this process (inherited by the workers it starts), except those the user
    exported already; returns those set."""
    applied = {}
    for key, value in network_environment(network).items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def _first_plain_interface(spec: str) -> str | None:
    if spec.startswith("^"):
        return None
    first = spec.split(",")[0].lstrip("=")
    return first or None

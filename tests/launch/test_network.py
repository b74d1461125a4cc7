"""The ``network`` section as worker environment variables."""

from __future__ import annotations

import pytest

from shardtune.config import ConfigError, NetworkConfig
from shardtune.launch.network import apply_network_environment, network_environment


def test_settings_become_nccl_and_gloo_variables():
    network = NetworkConfig(
        socket_ifname="eth0", ib=False, nccl_debug="INFO", nccl_socket_nthreads=4, nccl_nsocks_perthread=2,
        env={"NCCL_P2P_LEVEL": "NVL"},
    )  # fmt: skip
    assert network_environment(network) == {
        "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
        "NCCL_DEBUG": "INFO", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "2",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_P2P_LEVEL": "NVL",
    }  # fmt: skip


def test_defaults_leave_the_fabric_to_nccl_and_exclusions_to_nccl_only():
    assert network_environment(NetworkConfig()) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    # gloo has no exclusion syntax: it is left to pick its interface itself.
    assert network_environment(NetworkConfig(socket_ifname="^lo,docker0")) == {
        "NCCL_SOCKET_IFNAME": "^lo,docker0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip
    assert network_environment(NetworkConfig(ib=True))["NCCL_IB_DISABLE"] == "0"


def test_the_users_own_exports_win(monkeypatch):
    network = NetworkConfig(socket_ifname="eth0", nccl_debug="WARN")
    for key in network_environment(network):
        # Set then removed through monkeypatch, so that whatever apply sets is undone after the test.
        monkeypatch.setenv(key, "unset below")
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    applied = apply_network_environment(network)
    assert "NCCL_SOCKET_IFNAME" not in applied and applied["NCCL_DEBUG"] == "WARN"
    assert applied["GLOO_SOCKET_IFNAME"] == "eth0"


def test_only_network_variables_are_accepted(tmp_path):
    from shardtune.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("model: {name_or_path: m}\ndata: {dataset_path: d.jsonl}\nnetwork: {env: {PATH: /x}}\n")
    with pytest.raises(ConfigError, match="network.env.*PATH is not a network variable"):
        load_config(config, check_paths=False)

"""The Hugging Face Hub, where a hub id (``org/name``) is fetched from: asked once per process whether it can be
reached at all, so that a machine without it (a cluster's compute nodes often have no internet) reads hub ids from
its cache at once, with one line saying so.

Why: otherwise huggingface_hub retries each request five times over 23 s, printing two lines a retry, before the
error, and again for every file of the model, tokenizer and dataset that its cache already holds.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from urllib.parse import urlparse

from shardtune.config import looks_local
from shardtune.rank_zero_log import SAID_BY_RANK_ZERO

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
# A proxy may reach the hub where a direct connection cannot: huggingface_hub is left to try through it.
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def use_the_cache_if_the_hub_is_out_of_reach(name: str) -> str | None:
    """Before ``name`` (a model's or dataset's, as a config or option gives it) is fetched: where it is a hub id and
    the hub's host does not resolve or take a connection within ``CONNECT_TIMEOUT_S``, put this process (and the
    workers it starts) in huggingface_hub's offline mode. The reason the hub is out of reach (e.g. "Name or
    service not known"), or None (a local path, or the hub in reach)."""
    if looks_local(name):
        return None
    reason = _out_of_reach()
    if reason is not None:
        from huggingface_hub import constants

        # huggingface_hub and transformers ask constants.HF_HUB_OFFLINE at every request; workers read the
        # variable when they import it.
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
    return reason


@functools.cache
def say_the_cache_serves(reason: str) -> None:
    """Once a hub id was read from the cache (the hub out of reach for ``reason``): one line, once a process
    (and only on rank 0), which a run that then fails for want of a file does not print before its error."""
    logger.warning(
        "%s cannot be reached from here (%s): hub ids are read from this machine's Hugging Face cache alone "
        "(HF_HUB_OFFLINE=1)", hub_host(), reason, extra=SAID_BY_RANK_ZERO,
    )  # fmt: skip


def hub_host() -> str:
    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT


def not_cached_line(where: str, name: str, reason: str, fix: str, dataset: bool = False) -> str:
    """The error line for hub id ``name`` (``where``: what names it; a model's, or a ``dataset``'s), absent from the
    cache of a machine the hub is out of reach of (``reason``); ``fix`` says where the downloaded copy's directory
    goes."""
    # hf download fetches a model repository unless told otherwise: a dataset's id there is "not found".
    repo_type = " --repo-type dataset" if dataset else ""
    return (
        f"{where}: {name} is not in this machine's Hugging Face cache, and {hub_host()} cannot be reached from "
        f"here ({reason}): download it where the hub can be reached (hf download {name}{repo_type} --local-dir DIR), "
        f"copy DIR here and {fix}"
    )


@functools.cache
def _out_of_reach() -> str | None:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None  # offline already, or reached through a proxy: nothing to find out
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except TimeoutError:
        return f"no connection to port {port} within {CONNECT_TIMEOUT_S:.0f} s"
    except OSError as error:
        return error.strerror or str(error)

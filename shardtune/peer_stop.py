"""A rank that stops on its own while its peers wait in a collective with it, and how the peers learn of it.

A rank may be the only one to stop: out of device memory, or on input only it reads (global rank 0 alone opens
Weights & Biases). It says its line itself (a ``ReportedError``) and, before it leaves, puts its exit status in the
rendezvous store. A peer whose collective then fails as that rank leaves finds the status there and stops quietly
with it, so the run ends with the one line and no traceback from the others. The store outlives the ranks: the
launcher holds it, one per restart attempt.

A rank that stops without a word (killed by the kernel's out-of-memory killer or by hand, its node lost) leaves
nothing in the store: its peers' collectives fail with the transport's words for a dropped connection, and they
say so in one line (``lost_peer_line``) rather than each printing a traceback of the collective it waited in.
"""

from __future__ import annotations

from shardtune.distributed.env import DistributedEnv
from shardtune.errors import ReportedError

STOPPED_KEY = "shardtune/stopped"


def peer_stop_status(error: BaseException, env: DistributedEnv) -> int | None:
    """For a rank's ``except`` around its work: ``None`` when the caller is to re-raise ``error``, else the status
    to exit with quietly.

    An error this rank reports itself (a ``ReportedError``) is told to the peers (its status in the store) and
    re-raised. Any other is this rank's collective failing as a peer left, when a peer left its status: that
    status; else a failure of this rank's own, re-raised with its traceback.
    """
    try:
        store = env.store()
        if isinstance(error, ReportedError):
            store.set(STOPPED_KEY, str(error.exit_code))
            return None
        return int(store.get(STOPPED_KEY)) if store.check([STOPPED_KEY]) else None
    except Exception:  # no store (one process without a group), or it went with the launcher: nothing to go on
        return None


# gloo's and NCCL's words for a connection whose other end went away mid-collective.
_LOST_PEER_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def lost_peer_line(error: BaseException) -> str | None:
    """The line for a collective that failed because a peer process is gone, or None for any other error."""
    if not isinstance(error, RuntimeError):  # torch.distributed's DistBackendError is one
        return None
    words = next((words for words in _LOST_PEER_WORDS if words in str(error)), None)
    if words is None:
        return None
    return (
        f"shardtune: error: a worker left the run while the others waited for it in a collective ({words}): it "
        "stopped without a word (killed, out of host memory, or its node lost); the launcher's line names it"
    )

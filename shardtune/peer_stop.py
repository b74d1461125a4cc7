"""A rank that stops on its own while its peers wait in a collective with it, and how the peers learn of it.

A rank may be the only one to stop: out of device memory, or on input only it reads (global rank 0 alone opens
Weights & Biases). It says its line itself (a ``ReportedError``) and, before it leaves, puts its exit status in the
rendezvous store. A peer whose collective then fails as that rank leaves finds the status there and stops quietly
with it, so the run ends with the one line and no traceback from the others. The store outlives the ranks: the
launcher holds it, one per restart attempt.
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

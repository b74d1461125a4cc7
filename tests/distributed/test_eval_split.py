"""An evaluation set that does not split evenly over the ranks: every rank runs the same number of
forward passes (under FSDP each is a series of all-gathers, so one pass fewer on one rank left the
others waiting until the collective timeout), and the loss over the padding passes stays exact.

CI runs 3 examples on 2 ranks (one rank a batch short); ``SHARDTUNE_EVAL_MATRIX=1 python -m pytest
tests/distributed/test_eval_split.py`` runs the whole matrix of 1, 3 and 5 examples (1: a rank with none).
"""

from __future__ import annotations

import os

import pytest
from cli_runs import jsonl, train

from shardtune.train.eval import batches_per_rank

SIZES = [1, 3, 5] if os.environ.get("SHARDTUNE_EVAL_MATRIX") else [3]
# One example per evaluation batch, so the ranks' shares differ in batches; a short collective
# timeout: without the padding passes the run fails in a minute instead of half an hour.
EVAL = ["training.per_device_eval_batch_size=1", "parallel.timeout_s=60"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process eval loss per eval-set size (the same global batch: two micro-batches accumulated)."""
    tmp_path = tmp_path_factory.mktemp("eval-single")
    runs = {}

    def run(size: int) -> dict:
        if size not in runs:
            runs[size] = train(
                tmp_path, f"single-{size}", 1, "training.gradient_accumulation_steps=2",
                f"training.eval_subset_size={size}", *EVAL, steps=1,
            )  # fmt: skip
        return runs[size]

    return run


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.variants), "fsdp"])
def test_an_uneven_eval_set_on_two_ranks_gives_the_one_process_eval_loss(tmp_path, single, size, strategy):
    reference = single(size)
    run = train(
        tmp_path, f"{strategy}-{size}", 2, f"parallel.strategy={strategy}", f"training.eval_subset_size={size}", *EVAL,
        steps=1,
    )  # fmt: skip
    assert run["metrics"]["eval_loss"] == pytest.approx(reference["metrics"]["eval_loss"], rel=1e-5)
    # The padding passes count no token: every example's targets, once.
    evaluated = jsonl(run["out"] / "logs/eval_log.jsonl")[-1]["eval_tokens"]
    assert evaluated == jsonl(reference["out"] / "logs/eval_log.jsonl")[-1]["eval_tokens"] > 0
    assert (run["out"] / "final" / "adapter_model.safetensors").is_file()


def test_every_rank_runs_as_many_batches_as_the_rank_with_the_most_examples():
    # 3 examples on 2 ranks, one per batch: rank 0 has two, rank 1 one and runs a padding batch.
    assert batches_per_rank(3, 1, 2) == 2
    assert batches_per_rank(1, 4, 2) == 1  # rank 1 has none, and still runs one pass
    assert batches_per_rank(5, 2, 2) == 2 and batches_per_rank(8, 2, 4) == 1 and batches_per_rank(9, 2, 4) == 2

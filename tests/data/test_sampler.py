"""The global sampler: one order per epoch whatever the world size, and a cursor that resumes it."""

from __future__ import annotations

import pytest

from shardtune.data.sampler import GlobalBatchSampler, rank_micro_batches
from shardtune.distributed.mesh import ParallelDims
from shardtune.errors import ConfigError


@pytest.mark.parametrize(("world_size", "expert_parallel"), [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_union_over_ranks_equals_the_single_process_batch(world_size: int, expert_parallel: int):
    # Expert-parallel ranks are data-parallel too: each reads its own slice.
    micro, accum = 2, 2
    single = GlobalBatchSampler(100, micro * accum * 12, seed=5)
    many = GlobalBatchSampler(100, micro * accum * 12, seed=5)
    for _ in range(20):  # crosses epoch boundaries (8 batches per epoch)
        reference = single.next_global_batch()
        global_batch = many.next_global_batch()
        meshes = [ParallelDims(world_size, rank, world_size, "cpu", expert_parallel) for rank in range(world_size)]
        pieces = [rank_micro_batches(global_batch, mesh, micro) for mesh in meshes]
        union = [index for rank_batches in pieces for batch in rank_batches for index in batch]
        assert union == reference
        assert all(len(batch) == micro for rank_batches in pieces for batch in rank_batches)


def test_each_epoch_is_a_permutation_without_the_incomplete_last_batch():
    sampler = GlobalBatchSampler(10, 4, seed=0)
    assert sampler.batches_per_epoch == 2
    first_epoch = sampler.next_global_batch() + sampler.next_global_batch()
    second_epoch = sampler.next_global_batch() + sampler.next_global_batch()
    assert len(set(first_epoch)) == 8 and len(set(second_epoch)) == 8
    assert first_epoch != second_epoch  # reshuffled, so a different pair is left out
    assert sampler.cursor.epoch == 1


def test_resume_from_cursor_continues_the_same_order():
    reference = GlobalBatchSampler(50, 4, seed=3)
    expected = [reference.next_global_batch() for _ in range(30)]
    first = GlobalBatchSampler(50, 4, seed=3)
    seen = [first.next_global_batch() for _ in range(17)]
    resumed = GlobalBatchSampler(50, 4, seed=3)
    resumed.load_state_dict(first.state_dict())
    seen += [resumed.next_global_batch() for _ in range(13)]
    assert seen == expected


def test_cursor_from_another_dataset_is_refused():
    state = GlobalBatchSampler(50, 4, seed=3).state_dict()
    with pytest.raises(ValueError, match="sampler state is for 50 examples with seed 3"):
        GlobalBatchSampler(60, 4, seed=3).load_state_dict(state)


def test_too_little_data_for_one_batch_is_a_config_error():
    with pytest.raises(ConfigError) as raised:
        GlobalBatchSampler(2280, 16000, seed=0)
    assert str(raised.value) == (
        "training.per_device_train_batch_size: the training set has 2,280 examples, fewer than one global batch of "
        "16,000 (per-device batch size x gradient accumulation x world size); lower "
        "training.per_device_train_batch_size or training.gradient_accumulation_steps, or add examples"
    )

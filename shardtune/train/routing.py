"""What training does with the routers of an MoE model on each micro-batch: record their decisions,
count the load per expert, and add the load-balancing loss (``training.moe_aux_loss_coef``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from shardtune.data.collate import Batch
from shardtune.distributed.env import DistributedEnv
from shardtune.errors import ConfigError
from shardtune.metrics.expert_usage import ExpertUsage
from shardtune.model.moe import MoeBlock, RoutingRecorder, load_balancing_loss

log = logging.getLogger("shardtune")


class RouterTraining:
    def __init__(self, blocks: list[MoeBlock], aux_loss_coef: float, device: torch.device):
        if len({(block.num_experts, block.top_k) for block in blocks}) > 1:
            raise ConfigError("this model's MoE layers differ in their number of experts or top_k: not supported")
        self.coef = aux_loss_coef
        self.recorder = RoutingRecorder(blocks, trains_balance=aux_loss_coef > 0)
        self.usage = ExpertUsage(blocks, device)
        scoring = blocks[0].scoring
        log.info(
            "moe: %d MoE layers, %d experts, top %d (%s router); load-balancing loss coefficient %g",
            len(blocks),
            blocks[0].num_experts,
            blocks[0].top_k,
            scoring,
            aux_loss_coef,
        )

    @contextlib.contextmanager
    def forward(self, batch: Batch) -> Iterator[None]:
        """Record the routers during the forward pass of ``batch`` (its real tokens only)."""
        with self.recorder.recording(batch.real_tokens):
            yield

    def balance_term(self, micro_batches: int) -> torch.Tensor | None:
        """Count the forward just recorded and return what to add to this rank's objective, or None.

        The objective is LM loss + coef x (mean load-balancing loss over the step's micro-batches on all
        ranks). Data-parallel wrappers average gradients over ranks, so each rank adds coef x its own
        micro-batch losses / micro_batches; the average over ranks is then the global mean.
        """
        records = self.recorder.records
        term = None
        if self.coef > 0:
            loss, term = self.recorder.balance_objective(self.coef / micro_batches)
        else:
            with torch.no_grad():  # logged, not trained on: no graph
                loss = load_balancing_loss(records)
        self.usage.add(records, loss)
        self.recorder.records = []  # the probabilities keep the graph alive only until backward
        return term

    def interval_record(self, env: DistributedEnv, step: int) -> dict[str, Any]:
        """The interval's expert usage, reduced over ranks (every rank calls this at logging steps)."""
        return self.usage.reduce(env, step)

"""Expert parallelism (``parallel.expert_parallel_size``) on CPU with gloo, against one worker: EP 2 on 2
workers and EP 2 x data parallel 2 on 4 workers train with the 1-worker losses (LoRA on attention and the
routed experts, fp32); checkpoints resume across EP sizes (2 -> 1, 1 -> 2) and export the same adapter; a
rank with no token (whose experts also receive none) neither hangs nor errs; bad sizes are one line.

By default (CI) Qwen3-MoE runs; ``python -m pytest -m expert_parallel`` adds Mixtral, GLM-4.5 (Glm4Moe) and the other
expert layouts: Llama 4 (transposed), Nemotron-H (ungated, latent projections), HY-V4 (a SwiGLU limit), GPT-OSS
(biased), Gemma 4 (GELU-tanh-gated, beside the dense MLP), DBRX (2-D slabs, which take no LoRA: LoRA on its attention
and router, and full fine-tuning) and JetMoE (its MLP's experts a pair of modules of its block, beside a mixture of
attention experts that EP leaves to FSDP) and LongCat-Flash (identity experts, whose pairs stay on their rank; their
gate_up_proj rows split with the GEMM experts'); CI also runs the 2-rank block test of Nemotron-H, GPT-OSS, Gemma 4,
DBRX, JetMoE and LongCat-Flash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import jsonl, train
from conftest import REPO
from safetensors.torch import load_file
from tiny_models import FUSED_MOE_ARCHITECTURES, write_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.distributed.mesh import ParallelDims
from shardtune.errors import ConfigError

STEPS = 4
SAVE_AT = 2
# LoRA on attention and the routed experts, the balance loss on: every piece EP touches.
EXPERTS = ["lora.moe_targets=[attention,routed_experts]", "training.moe_aux_loss_coef=0.01"]
# The settings that replace EXPERTS, by architecture: DBRX's routed experts take no LoRA (its 2-D slabs:
# lora.moe_targets refuses them), so its runs adapt the router beside the attention; JetMoE's MLP router takes LoRA
# too: under EP it stays whole on every rank, outside the experts' FSDP unit (its pair of expert modules), and its
# adapters' gradients average over every rank as the attention's do.
ARCH_EXPERTS = {
    "dbrx": ["lora.moe_targets=[attention,router]", "training.moe_aux_loss_coef=0.01"],
    "jetmoe": ["lora.moe_targets=[attention,routed_experts,router]", "training.moe_aux_loss_coef=0.01"],
}
# Where the MoE block's adapters are, by architecture, where not under an ``experts`` module: DBRX's router's (its
# experts take none); JetMoE's MLP experts are its block's input_linear and output_linear (its attention's ``experts``
# are a mixture of attention).
BLOCK_ADAPTERS = {"dbrx": "router", "jetmoe": ".mlp.input_linear.lora_"}
EP2 = ["parallel.expert_parallel_size=2"]
SAVES = [f"training.save_steps={SAVE_AT}", "training.checkpoint_mode=full"]
# Adapters after a few Adam steps, across reduction orders: Adam's normalized update amplifies the last-bit
# differences of near-zero gradients, up to ~1e-3 of one step's update (lr 3e-3 in the quickstart).
ABS = 1e-5
# Gemma 4's: one expert adapter element of 32k lands 1.4e-5 away (5e-3 of a step's update; the rest within 2e-6), its
# Adam moments at the last step within 1e-5 of the one worker's, relatively.
ADAPTER_ABS = {"gemma4_text": 3e-5}
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

# Architectures with identity experts (LongCat-Flash's): their pairs stay on their rank under EP.
IDENTITY_EXPERTS = {"longcat_flash"}


def has(arch: str) -> pytest.MarkDecorator:
    """Skip where this transformers has no ``arch`` (LongCat-Flash came with transformers 5)."""
    return pytest.mark.skipif(arch not in FUSED_MOE_ARCHITECTURES, reason=f"this transformers has no {arch}")


ep_matrix = pytest.mark.expert_parallel
ci = [pytest.mark.expert_parallel, pytest.mark.representative]


class Runs:
    """Training runs shared by the tests of this module, each started the first time a test asks for it."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def model(self, arch: str) -> Path:
        return write_tiny_model(self.root / "models" / arch, arch)

    def common(self, arch: str) -> list[str]:
        model = [f"model.name_or_path={self.model(arch)}", "model.init=random", "lora.target_modules=null"]
        return [*model, *ARCH_EXPERTS.get(arch, EXPERTS)]

    def get(self, arch: str, name: str, nproc: int, *overrides: str, steps: int = STEPS) -> dict:
        key = (arch, name)
        if key not in self.done:
            self.done[key] = train(self.root, f"{arch}-{name}", nproc, *self.common(arch), *overrides, steps=steps)
        return self.done[key]

    def single(self, arch: str) -> dict:
        """One worker, two micro-batches of 2 a step: the global batch of 2 workers with 2 each; merged at the end for
        an architecture whose experts take no LoRA (its frozen experts' weights whole, for the EP run's to match)."""
        frozen = not any("routed_experts" in setting for setting in ARCH_EXPERTS.get(arch, EXPERTS))
        merged = ["training.merge_final=true"] if frozen else []
        return self.get(arch, "single", 1, "training.gradient_accumulation_steps=2", *SAVES, *merged)

    def ep2(self, arch: str) -> dict:
        return self.get(arch, "ep2", 2, *EP2, *SAVES, "training.merge_final=true")

    def resumed(self, arch: str, source: dict, name: str, nproc: int, *overrides: str) -> dict:
        """``source``'s run from its step-2 checkpoint on, in a copy of its output directory, on ``nproc`` workers."""
        key = (arch, name)
        if key not in self.done:
            out = self.root / f"{arch}-{name}"
            shutil.copytree(source["out"], out)
            for path in out.glob("checkpoint-*"):
                if int(path.name.split("-")[1]) > SAVE_AT:
                    shutil.rmtree(path)
            for finished in ("final", "final-merged"):
                shutil.rmtree(out / finished, ignore_errors=True)
            self.done[key] = train(
                self.root, out.name, nproc, *self.common(arch), *overrides, *SAVES,
                "training.resume_from_checkpoint=auto", steps=STEPS,
            )  # fmt: skip
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("expert-parallel"))


def assert_trains_like(run: dict, reference: dict) -> None:
    assert len(reference["losses"]) == STEPS
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    mine, theirs = jsonl(run["out"] / "logs/train_log.jsonl"), jsonl(reference["out"] / "logs/train_log.jsonl")
    # The gradient norm covers the experts' gradients, which the losses of a few Adam steps hardly show.
    for key in ("moe_balance_loss", "grad_norm"):
        assert [row[key] for row in mine] == pytest.approx([row[key] for row in theirs], rel=1e-5), key
    # MFU counts the whole model's FLOPs per token (every routed expert a token may use), not one rank's share.
    flops = [[row["tflops_per_device"] / row["tokens_per_s_per_device"] for row in rows] for rows in (mine, theirs)]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)
    # Routing statistics stay global: every rank routes its own tokens, the counts sum over all ranks.
    usage, reference_usage = (jsonl(r["out"] / "logs/expert_usage.jsonl") for r in (run, reference))
    for mine, theirs in zip(usage, reference_usage, strict=True):
        assert [layer["counts"] for layer in mine["layers"]] == [layer["counts"] for layer in theirs["layers"]]


def weights(directory: Path) -> dict:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def adapter(directory: Path) -> dict:
    return load_file(directory / "adapter_model.safetensors")


def assert_same_adapter(mine: dict, theirs: dict, rel: float, abs: float = ABS, arch: str = "") -> None:
    """The same tensors, adapters of ``arch``'s MoE block among them (its routed experts', or BLOCK_ADAPTERS')."""
    assert sorted(mine) == sorted(theirs)
    assert any(BLOCK_ADAPTERS.get(arch, "experts") in name for name in mine)
    for name, tensor in mine.items():
        assert tensor.shape == theirs[name].shape, name
        assert tensor.numpy() == pytest.approx(theirs[name].numpy(), rel=rel, abs=abs), name


# -- CI: Qwen3-MoE ----------------------------------------------------------------------------------------


# Besides the SiLU-gated (E, 2I, H) experts: Llama 4's transposed ones (weighted inputs, PEFT's factors swapped),
# Nemotron-H's ungated ReLU² ones (between latent projections, replicated like the rest of the layer), HY-V4's with
# a SwiGLU limit, GPT-OSS's transposed ones with a bias per expert and projection (sharded with their experts), Gemma
# 4's GELU-tanh-gated ones (the decoder layer's experts beside its dense MLP; the run's whole adapter gathered by the
# fused router's count of experts), DBRX's 2-D slabs (frozen, LoRA on its router: its experts' slabs merged whole),
# JetMoE's pair of expert modules of its block (their weights and adapters sharded under the block's names, its router
# and output bias whole on every rank; its attention's mixture of experts, with their routers and LoRA adapters,
# ordinary weights FSDP shards over every rank).
@pytest.mark.parametrize("arch", [pytest.param("qwen3_moe", marks=ci), pytest.param("mixtral", marks=ep_matrix),
                                  pytest.param("glm4_moe", marks=ep_matrix),
                                  pytest.param("llama4_text", marks=ep_matrix),
                                  pytest.param("nemotron_h", marks=ep_matrix),
                                  pytest.param("hy_v4", marks=ep_matrix),
                                  pytest.param("gpt_oss", marks=ep_matrix),
                                  pytest.param("gemma4_text", marks=ep_matrix),
                                  pytest.param("dbrx", marks=ep_matrix),
                                  pytest.param("jetmoe", marks=ep_matrix),
                                  pytest.param("longcat_flash", marks=[ep_matrix, has("longcat_flash")])])  # fmt: skip
def test_ep2_on_two_workers_trains_like_one_worker(runs, arch):
    run = runs.ep2(arch)
    assert_trains_like(run, runs.single(arch))
    assert run["metrics"]["world_size"] == 2 and run["metrics"]["strategy"] == "fsdp"
    assert "expert parallel:" in run["log"]
    # Each rank holds half the routed experts: fewer parameter bytes than FSDP over 2 ranks would not show
    # (FSDP shards them too), but the whole adapter comes back in final/, as one worker writes it.
    assert_same_adapter(
        adapter(run["out"] / "final"), adapter(runs.single(arch)["out"] / "final"), rel=1e-4,
        abs=ADAPTER_ABS.get(arch, ABS), arch=arch,
    )  # fmt: skip
    if arch in IDENTITY_EXPERTS:  # pairs chose identity experts (the last 2 ids; kept on their rank) in every layer
        usage = jsonl(run["out"] / "logs/expert_usage.jsonl")
        assert all(len(layer["counts"]) == 10 and sum(layer["counts"][-2:]) > 0 for layer in usage[0]["layers"])
    if arch == "dbrx":  # the merged model's slabs, each gathered whole from the two ranks' rows: the frozen init's
        merged = weights(run["out"] / "final-merged")
        slabs = [name for name in merged if name.endswith(("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2"))]
        assert len(slabs) == 3 * 2 and all(merged[name].shape == (8 * 32, 64) for name in slabs)
        init = weights(runs.single(arch)["out"] / "final-merged")  # one worker's: the same init, whole
        for name in slabs:
            assert merged[name].equal(init[name]), name


# Full fine-tuning of DBRX under EP 2: its 2-D slabs train on the ranks that hold their rows (their gradients in the
# gradient norm), a checkpoint holds them as views of the whole slabs (DCP reassembles them for another EP size), and
# final/ holds them whole.
@ep_matrix
def test_ep2_full_finetuning_of_slabs_trains_saves_and_resumes_like_one_worker(runs):
    full = ["lora.enabled=false", *SAVES]
    single = runs.get("dbrx", "full-single", 1, *full, "training.gradient_accumulation_steps=2")
    run = runs.get("dbrx", "full-ep2", 2, *full, *EP2)
    assert_trains_like(run, single)
    mine, theirs = weights(run["out"] / "final"), weights(single["out"] / "final")
    assert sorted(mine) == sorted(theirs)
    slabs = [name for name in mine if ".experts.mlp." in name]
    assert len(slabs) == 3 * 2 and all(mine[name].shape == (8 * 32, 64) for name in slabs)
    for name, tensor in mine.items():
        assert tensor.numpy() == pytest.approx(theirs[name].numpy(), rel=1e-4, abs=ABS), name
    init = weights(runs.single("dbrx")["out"] / "final-merged")  # the LoRA run's frozen slabs: the init
    assert all((mine[name] - init[name]).abs().max() > 1e-3 for name in slabs)  # trained
    resumed = runs.resumed("dbrx", run, "full-ep2-to-1", 1, *full, "training.gradient_accumulation_steps=2")
    assert "saved by 2 rank(s)" in resumed["log"]
    assert resumed["losses"][SAVE_AT:] == pytest.approx(single["losses"][SAVE_AT:], rel=1e-5)
    for name, tensor in weights(resumed["out"] / "final").items():
        assert tensor.numpy() == pytest.approx(theirs[name].numpy(), rel=1e-4, abs=ABS), name


# Both in the matrix only (four workers on CI's two cores take a minute): test_ep2_on_two_workers_trains_like_one_worker
# runs the exchange CI checks.
@ep_matrix
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", pytest.param("longcat_flash", marks=has("longcat_flash"))])
def test_ep2_times_dp2_on_four_workers_trains_like_one_worker(runs, arch):
    # One sequence per micro-batch on both sides, so that the micro-batches (and their padding) are the same.
    reference = runs.get(arch, "single-b1", 1, "training.per_device_train_batch_size=1",
                         "training.gradient_accumulation_steps=4")  # fmt: skip
    run = runs.get(arch, "ep2-dp2", 4, *EP2, "training.per_device_train_batch_size=1")
    assert_trains_like(run, reference)
    assert run["metrics"]["world_size"] == 4


@ep_matrix
@pytest.mark.parametrize(
    "arch",
    ["qwen3_moe", "mixtral", "llama4_text", "nemotron_h", "gpt_oss", "gemma4_text", "jetmoe",
     pytest.param("longcat_flash", marks=has("longcat_flash"))],
)  # fmt: skip
def test_checkpoints_resume_across_expert_parallel_sizes(runs, arch):
    single, ep2 = runs.single(arch), runs.ep2(arch)
    from_ep2 = runs.resumed(arch, ep2, "ep2-to-1", 1, "training.gradient_accumulation_steps=2")
    from_single = runs.resumed(arch, single, "1-to-ep2", 2, *EP2)
    for resumed, saved_by in ((from_ep2, "2 rank(s)"), (from_single, "1 rank(s)")):
        assert f"saved by {saved_by}" in resumed["log"]
        # The steps after the checkpoint continue the run (weights and Adam state) exactly as it went on.
        assert resumed["losses"][SAVE_AT:] == pytest.approx(single["losses"][SAVE_AT:], rel=1e-5)
    # The resumed runs end with the adapter of the uninterrupted run, whatever EP size saved or loaded it.
    tolerance = {"rel": 1e-4, "abs": ADAPTER_ABS.get(arch, ABS), "arch": arch}
    assert_same_adapter(adapter(from_ep2["out"] / "final"), adapter(single["out"] / "final"), **tolerance)
    assert_same_adapter(adapter(from_single["out"] / "final"), adapter(single["out"] / "final"), **tolerance)


@ep_matrix
@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "llama4_text", "nemotron_h", pytest.param("longcat_flash", marks=has("longcat_flash"))]
)
def test_export_of_an_ep_checkpoint_is_the_runs_own_adapter(runs, arch, tmp_path):
    run = runs.ep2(arch)
    checkpoint = run["out"] / f"checkpoint-{STEPS}"
    for merge in (False, True):
        out = tmp_path / ("merged" if merge else "adapter")
        result = subprocess.run(
            [sys.executable, "-m", "shardtune", "export", str(checkpoint), "--out", str(out),
             *(["--merge"] if merge else [])],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    # The checkpoint of the last step holds exactly what final/ holds (both are the whole experts' adapter).
    assert_same_adapter(adapter(tmp_path / "adapter"), adapter(run["out"] / "final"), rel=0, abs=0)
    # The merged model of the checkpoint is the run's own final-merged/ (merged from the gathered experts).
    merged, final_merged = (weights(directory) for directory in (tmp_path / "merged", run["out"] / "final-merged"))
    expert_weights = [name for name in merged if "experts" in name and name.endswith("up_proj")]  # gate_up, up
    # Every expert's, as transformers' own model of the config holds them (from_pretrained's layout): 8, and
    # LongCat-Flash's gate_up_proj up to transformers 5.24 the 2 identity experts' rows after the 8 GEMM experts'.
    with torch.device("meta"):
        own = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run["out"] / "final-merged"))
    rows = {name: own.get_parameter(name).shape[0] for name in expert_weights}
    assert expert_weights and set(rows.values()) <= ({8, 10} if arch in IDENTITY_EXPERTS else {8})
    assert all(merged[name].shape[0] == rows[name] for name in expert_weights)
    assert sorted(merged) == sorted(final_merged)
    for name, tensor in merged.items():
        assert tensor.equal(final_merged[name]), name


@ep_matrix
@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_eval_with_a_rank_of_padding_only(runs, arch, tmp_path):
    # 3 examples, one a batch, on 2 ranks: rank 1's second forward is a padding batch (no target), whose
    # tokens still go through every all-to-all. The loss is the one worker's, as without EP.
    checkpoint = runs.ep2(arch)["out"] / f"checkpoint-{STEPS}"
    data = tmp_path / "three.jsonl"
    data.write_text("".join((REPO / "examples/data/tiny_instruct.jsonl").read_text().splitlines(True)[:3]))
    losses = {}
    for nproc, overrides in ((1, ["parallel.expert_parallel_size=1"]), (2, EP2)):
        out = tmp_path / f"eval-{nproc}.json"
        result = subprocess.run(
            [sys.executable, "-m", "shardtune", "eval", str(checkpoint / "config.yaml"), "--checkpoint",
             str(checkpoint), "--data", str(data), "--nproc", str(nproc), "--out", str(out),
             "training.per_device_eval_batch_size=1", *overrides],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        losses[nproc] = json.loads(out.read_text())["eval_loss"]
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)


# -- no hang with idle experts or an idle rank; sizes that do not fit ---------------------------------------


# Each expert layout's block: Qwen3-MoE's SiLU-gated experts, Nemotron-H's ungated ones (up_proj, inside latent
# projections that stay whole on every rank), Llama 4's transposed ones (weighted inputs; its block also returns its
# router logits), HY-V4's with a SwiGLU limit, GPT-OSS's biased ones, Gemma 4's GELU-tanh-gated ones (beside their
# fused router in the decoder layer, which keeps transformers' forward), DBRX's 2-D slabs (each rank's rows of them),
# JetMoE's pair of expert modules (4 experts, each rank 2; its output bias whole on every rank).
@has("longcat_flash")
def test_one_process_saves_and_resumes_longcat_flashs_routed_adapters(tmp_path):
    """One process, LongCat-Flash with LoRA on the routed experts: its down_proj's adapters have a factor for each
    GEMM expert only (8), its gate_up_proj's one for the identity experts too (10). The checkpoint code took 10 for
    both and stopped at the first save ("shape '[64, -1, 10]' is invalid"); now a run saves, and resuming from its
    checkpoint ends with the uninterrupted run's losses and adapter."""
    model = write_tiny_model(tmp_path / "model", "longcat_flash")
    common = [f"model.name_or_path={model}", "model.init=random", "lora.target_modules=null",
              "lora.moe_targets=[attention,routed_experts]", *SAVES]  # fmt: skip
    whole = train(tmp_path, "whole", 1, *common, steps=STEPS)
    shutil.copytree(whole["out"], tmp_path / "resumed")
    for later in [tmp_path / "resumed" / "final", *(tmp_path / "resumed").glob(f"checkpoint-{STEPS}")]:
        shutil.rmtree(later)
    resumed = train(tmp_path, "resumed", 1, *common, "training.resume_from_checkpoint=auto", steps=STEPS)
    assert resumed["losses"][SAVE_AT:] == pytest.approx(whole["losses"][SAVE_AT:], rel=1e-5)
    assert_same_adapter(
        adapter(resumed["out"] / "final"), adapter(whole["out"] / "final"), rel=1e-4, arch="longcat_flash"
    )


@pytest.mark.parametrize("arch", [pytest.param("qwen3_moe", marks=ci), pytest.param("nemotron_h", marks=ci),
                                  pytest.param("llama4_text", marks=ep_matrix),
                                  pytest.param("hy_v4", marks=ep_matrix),
                                  pytest.param("gpt_oss", marks=ci),
                                  pytest.param("gemma4_text", marks=ci),
                                  pytest.param("dbrx", marks=ci),
                                  pytest.param("jetmoe", marks=ci),
                                  pytest.param("longcat_flash", marks=[*ci, has("longcat_flash")])])  # fmt: skip
def test_a_rank_without_tokens_and_experts_without_rows_neither_hang_nor_err(tmp_path, arch):
    # Rank 0 routes every token to experts 0 and 1 (both its own); rank 1 has no token at all: its experts
    # get no row, and it takes part in every exchange with empty splits, forward and backward. LongCat-Flash (identity
    # experts): both ranks route every token to expert 0 and half of them to expert 1, the other half to an identity
    # expert, whose pairs stay on their rank (no exchange; the token times its weight, as in one process).
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests/distributed/ep_block_worker.py"), str(tmp_path), arch],
        cwd=REPO, env={**ENV, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [report["tokens"] for report in reports] == [12, 12 if arch in IDENTITY_EXPERTS else 0]
    assert [report["identity_pairs"] for report in reports] == ([6, 6] if arch in IDENTITY_EXPERTS else [0, 0])
    half = reports[0]["experts"] // 2
    assert [report["local_experts"] for report in reports] == [[0, half], [half, 2 * half]]
    for report in reports:  # each rank's output and gradients are those of the whole block on its tokens
        assert report["output_matches"] and report["input_grad_matches"] and report["expert_grads_match"]
    assert reports[0]["expert_grad_abs_sum"] > 0 and reports[1]["expert_grad_abs_sum"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (SHARDTUNE_TEST_GPU=1)")
def test_a_dispatch_waits_on_the_device_once(world):
    # all-to-all takes its split sizes from the host: one sync a dispatch is the price, and every MoE layer of
    # an EP run pays it in forward and recomputation. A second one (repeat_interleave finding its output's
    # size) doubled the times the host waited.
    import warnings

    import torch.distributed as dist

    from shardtune.distributed.expert_parallel import ExpertDispatch

    experts, hidden = 8, 64
    expert_ids = torch.sort(torch.randint(0, experts, (256,), device="cuda")).values
    bounds = torch.searchsorted(expert_ids, torch.arange(experts + 1, device="cuda"), out_int32=True)
    rows = torch.randn(256, hidden, device="cuda", requires_grad=True)
    weights = torch.rand(256, device="cuda", requires_grad=True)
    dispatch = ExpertDispatch(dist.group.WORLD, ep_size=1, local_experts=experts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            received, received_weights, received_bounds, receive_back = dispatch.send(rows, weights, bounds)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [warning for warning in caught if "synchronizing" in str(warning.message)]
    assert len(syncs) == 1, [str(warning.message) for warning in syncs]
    assert torch.equal(received, rows) and torch.equal(received_bounds, bounds)
    (receive_back(received * 2) * received_weights[:, None]).sum().backward()
    assert torch.allclose(rows.grad, 2 * weights.detach()[:, None].expand_as(rows))


def test_the_mesh_lays_ep_groups_on_consecutive_ranks():
    meshes = [ParallelDims(world_size=8, rank=rank, local_world_size=4, expert_parallel_size=2) for rank in range(8)]
    assert [mesh.ep_rank for mesh in meshes] == [0, 1] * 4
    assert [mesh.node_index for mesh in meshes] == [0] * 4 + [1] * 4
    assert [(mesh.dp_rank, mesh.dp_size) for mesh in meshes] == [(rank, 8) for rank in range(8)]
    assert meshes[3].expert_dp_size == 4 and meshes[3].local_experts(8) == range(4, 8)
    alone = ParallelDims(world_size=1, rank=0, local_world_size=1)
    assert (alone.dp_rank, alone.dp_size, alone.ep_size, alone.local_experts(8)) == (0, 1, 1, range(8))


def test_sizes_that_do_not_fit_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"^parallel.expert_parallel_size: 3 does not divide the world size 4"):
        ParallelDims(world_size=4, rank=0, local_world_size=4, expert_parallel_size=3)
    with pytest.raises(ConfigError, match=r"^parallel.expert_parallel_size: 4 does not divide the 6 routed experts"):
        ParallelDims(world_size=4, rank=0, local_world_size=4, expert_parallel_size=4).check_experts(6, "m")


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["parallel.strategy=ddp"], "parallel.expert_parallel_size: 2 needs parallel.strategy: fsdp or auto"),
        (["model.experts_implementation=grouped_mm"], "needs model.experts_implementation: fused"),
        (
            [
                "lora.target_modules=null",
                "lora.moe_targets=[attention,routed_experts]",
                "lora.shared_expert_adapter=true",
            ],
            "cannot train lora.shared_expert_adapter",
        ),
    ],
)
def test_settings_expert_parallelism_cannot_run_are_config_errors(overrides, error):
    from shardtune.config import load_config

    with pytest.raises(ConfigError, match=error):
        load_config(REPO / "examples/quickstart.yaml", [*EP2, *overrides], check_paths=False)


@pytest.mark.variants
def test_a_dense_model_with_expert_parallelism_stops_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "shardtune", "train", "examples/quickstart.yaml", "--nproc", "2", *EP2,
         f"training.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", "training.max_steps=1"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert lines == [
        "shardtune: error: parallel.expert_parallel_size: 2 needs an MoE model; examples/tiny-llama has no MoE "
        "layers; set it to 1"
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr

"""LoRA's down-projections that read one input run as one GEMM in a compiled layer (``shared_input_gemms``), with
the gradients of the GEMMs they replace."""

from __future__ import annotations

import peft
import pytest
import torch
from tiny_models import tiny_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from transformers import AutoModelForCausalLM

from shardtune.distributed.shared_input_gemms import fuse_shared_input_linears


def lora_llama(dropout: float = 0.0) -> peft.PeftModel:
    """A tiny Llama with LoRA on every linear layer, its factors random (PEFT's B starts at zero, which would
    leave A's gradient zero)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    config = peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False)
    return peft.get_peft_model(model, config).train()


class FusedGroups:
    """A compile backend that fuses, then records each fused GEMM's weights by name and runs the graph eagerly."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        fuse_shared_input_linears(graph)
        for module in graph.modules():
            if not isinstance(module, torch.fx.GraphModule):
                continue
            for node in module.graph.nodes:
                if node.target is torch.nn.functional.linear and getattr(node.args[1], "target", None) is torch.cat:
                    self.groups.append([weight.name for weight in node.args[1].args[0]])
        return graph.forward


def loss_and_gradients(model: peft.PeftModel, autocast: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    trained = [(name.replace("._checkpoint_wrapped_module", ""), p) for name, p in model.named_parameters()]
    return loss.item(), {name: p.grad for name, p in trained if p.requires_grad}


def compile_layers(model: peft.PeftModel, backend) -> None:
    torch._dynamo.reset()  # each test's models are new: no earlier test's graphs count against the recompile limit
    for layer in model.get_base_model().model.layers:
        layer.compile(backend=backend)


def test_the_down_projections_of_q_k_v_and_of_gate_up_become_one_gemm_each():
    model, backend = lora_llama(), FusedGroups()
    compile_layers(model, backend)
    loss_and_gradients(model)
    assert backend.groups  # a graph per layer input kind (the first layer's input needs no gradient)
    for group in backend.groups:
        names = [name.split("_modules_")[-3] for name in group]  # ..._modules_q_proj_modules_lora_a_modules_...
        assert "lora_a" in group[0] and all("lora_a" in name for name in group), group
        assert names in (["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]), group
    assert len(backend.groups) % 2 == 0 and len(backend.groups) >= 2


def test_under_bf16_autocast_the_casts_of_the_input_to_the_adapters_fp32_are_looked_through():
    model = lora_llama()
    model.get_base_model().to(torch.bfloat16)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # adapters in fp32, as training keeps them
    backend = FusedGroups()
    compile_layers(model, backend)
    loss_and_gradients(model, autocast=True)
    assert sorted(len(group) for group in backend.groups)[-1] == 3


def test_inputs_dropped_out_differently_are_not_one_input():
    model, backend = lora_llama(dropout=0.1), FusedGroups()
    compile_layers(model, backend)
    loss_and_gradients(model)
    assert backend.groups == []


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint-replayed"])
def test_with_the_fused_gemms_the_loss_and_every_gradient_equal_eager(checkpointed):
    """fp32: the fused GEMM computes each output column as the separate ones did (the rewritten graph run as
    traced; inductor compiles it in training). Replayed by a non-reentrant checkpoint around the compiled layer (as
    shardtune compiles MoE layers), the recomputation saves what the first forward saved: the pass's fake values
    are made without autograd."""
    eager_loss, eager = loss_and_gradients(lora_llama())
    model, backend = lora_llama(), FusedGroups()
    compile_layers(model, backend)
    if checkpointed:
        layers = model.get_base_model().model.layers
        for index, layer in enumerate(layers):
            layers[index] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    loss, gradients = loss_and_gradients(model)
    assert backend.groups
    assert loss == pytest.approx(eager_loss, rel=1e-6)
    for name, gradient in eager.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


class SharedInput(torch.nn.Module):
    """Three narrow linear layers and a wide one on one input, the third behind an autocast switch."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.switched = (torch.nn.Linear(64, 8, bias=False) for _ in range(3))
        self.wide = torch.nn.Linear(64, 32, bias=False)  # not narrow: its GEMM's time is not the input's reading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.first(x).sum() + self.second(x).sum() + self.wide(x).sum()
        with torch.autocast("cpu", enabled=False):
            return total + self.switched(x).sum()


def test_only_narrow_weights_on_the_same_side_of_an_autocast_switch_are_one_gemm():
    torch._dynamo.reset()
    module, backend = SharedInput(), FusedGroups()
    compiled = torch.compile(module, backend=backend)
    x = torch.randn(4, 64)
    torch.testing.assert_close(compiled(x), module(x))
    assert [[name.split("_")[-4] for name in group] for group in backend.groups] == [["first", "second"]]

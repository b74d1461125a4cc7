"""``model.attn_implementation: flash_attention_4`` on a GPU of compute capability 9.0 or newer with flash-attn-4
installed (``SHARDTUNE_TEST_GPU=1 python -m pytest -m gpu``): compiled layers train like sdpa to bf16's precision,
and packed examples stay apart in a batch of several rows."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch
from tiny_models import kernel_sized_qwen3_moe
from transformers import AutoModelForCausalLM

from shardtune.data.collate import collate
from shardtune.distributed.parallelize import decoder_layers
from shardtune.train.loss import summed_token_loss


def _flash_attention_4_trains_here() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        importlib.metadata.distribution("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _flash_attention_4_trains_here(),
        reason="needs a Hopper or newer GPU with flash-attn-4 (SHARDTUNE_TEST_GPU=1)",
    ),
]


def bf16_model(attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        kernel_sized_qwen3_moe(), dtype=torch.bfloat16, attn_implementation=attention
    )
    model.config.use_cache = False
    return model.cuda().train()


def test_compiled_layers_train_like_sdpa():
    ids = torch.randint(0, 1024, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = {}
    for attention in ("sdpa", "flash_attention_4"):
        model = bf16_model(attention)
        for layer in decoder_layers(model):
            layer.compile()
        torch._dynamo.reset()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[attention] = loss.detach(), {name: p.grad for name, p in model.named_parameters()}
    (loss, grads), (expected_loss, expected) = results["flash_attention_4"], results["sdpa"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-2, atol=0)
    for name, value in expected.items():
        scale = value.float().abs().max().item()
        off = (grads[name].float() - value.float()).abs().max().item()
        assert off <= 0.05 * scale + 1e-6, f"{name}: off by {off} of {scale}"


def test_packed_examples_stay_apart_in_a_batch_of_rows():
    """Each example of two packed rows has the loss it has alone (``summed_token_loss`` lays the rows end to
    end for flash attention); without that, the examples would attend to those before them."""
    generator = torch.Generator().manual_seed(2)
    examples = [torch.randint(3, 1000, (n,), generator=generator).numpy() for n in (200, 312, 128, 384)]
    sequences = []
    for first, second in ((examples[0], examples[1]), (examples[2], examples[3])):
        ids = torch.cat([torch.from_numpy(first), torch.from_numpy(second)]).numpy()
        targets = ids.copy()
        targets[len(first) - 1] = -100
        positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))]).numpy().astype("int32")
        sequences.append((ids, targets, positions))
    packed = collate(sequences, pad_token_id=0, packed=True).to(torch.device("cuda"))
    model = bf16_model("flash_attention_4").eval()
    with torch.no_grad():
        together = summed_token_loss(model, packed, None).item()
        alone = 0.0
        for ids in examples:
            targets = ids.copy()
            targets[-1] = -100
            one = collate([(ids, targets, None)], pad_token_id=0, packed=False).to(torch.device("cuda"))
            alone += summed_token_loss(copy.deepcopy(model), one, None).item()
    assert together == pytest.approx(alone, rel=2e-3)

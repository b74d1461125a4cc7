"""The chunked loss (``training.loss_chunk_tokens``) gives the standard loss and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardtune.config import LoraConfig
from shardtune.data.collate import collate
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.errors import ConfigError
from shardtune.model.lora import apply_lora
from shardtune.train.loss import summed_token_loss


def batch_with_prompts_and_padding():
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for length, prompt in ((30, 11), (17, 5), (25, 0)):
        ids = torch.randint(3, 1000, (length,), generator=generator).numpy()
        targets = ids.copy()
        targets[:prompt] = IGNORE_INDEX  # prompt tokens carry no loss
        sequences.append((ids, targets, None))
    return collate(sequences, pad_token_id=0, packed=False)


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("chunk", [7, 1000])
def test_chunked_loss_equals_the_standard_loss_and_gradients(tiny_model_dir, lora, chunk):
    batch = batch_with_prompts_and_padding()
    results = []
    for chunk_tokens in (0, chunk):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if lora:
            model = apply_lora(model, LoraConfig(r=4, lora_dropout=0.0))
        loss = summed_token_loss(model, batch, None, chunk_tokens)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
        # The head is restored: the model gives logits again.
        assert model(input_ids=batch.input_ids).logits.shape[-1] == model.config.vocab_size
    (loss, grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, loss, rtol=1e-5, atol=1e-5)
    assert chunked_grads.keys() == grads.keys() and grads
    for name in grads:
        # Summation order differs between chunks: allow fp32 rounding relative to the gradient's scale.
        scale = grads[name].abs().max().item()
        torch.testing.assert_close(chunked_grads[name], grads[name], rtol=1e-4, atol=1e-6 * max(scale, 1.0))


def test_chunked_loss_refuses_models_that_transform_logits(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.final_logit_softcapping = 30.0
    expected = "loss_chunk_tokens: not for LlamaForCausalLM: it transforms logits.*turn it off"
    with pytest.raises(ConfigError, match=expected):
        summed_token_loss(model, batch_with_prompts_and_padding(), None, 16)

"""The chunked loss (``training.loss_chunk_tokens``) gives the standard loss and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.config import LoraConfig
from shardtune.data.collate import collate
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.distributed.compile import LayerCompiler
from shardtune.errors import ConfigError
from shardtune.model.lora import apply_lora
from shardtune.train.loss import (
    LinearCrossEntropy,
    chunk_tokens_for,
    compiled_softmax_gradient,
    describe_loss,
    head_vocab,
    softmax_compiles_right_on,
    softmax_gradient_,
    summed_token_loss,
)


def batch_with_prompts_and_padding():
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for length, prompt in ((30, 11), (17, 5), (25, 0)):
        ids = torch.randint(3, 1000, (length,), generator=generator).numpy()
        targets = ids.copy()
        targets[:prompt] = IGNORE_INDEX  # prompt tokens carry no loss
        sequences.append((ids, targets, None))
    return collate(sequences, pad_token_id=0, packed=False)


def loss_and_gradients(model: torch.nn.Module, batch, chunk_tokens: int) -> tuple[torch.Tensor, dict]:
    """``summed_token_loss`` of ``batch`` with ``chunk_tokens``, and every gradient it gives."""
    loss = summed_token_loss(model, batch, None, chunk_tokens)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_gradients(chunked: tuple[torch.Tensor, dict], standard: tuple[torch.Tensor, dict]) -> None:
    (chunked_loss, chunked_grads), (loss, grads) = chunked, standard
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5, atol=1e-5)
    assert chunked_grads.keys() == grads.keys() and grads
    for name in grads:
        # Summation order differs between chunks: allow fp32 rounding relative to the gradient's scale.
        scale = grads[name].abs().max().item()
        torch.testing.assert_close(chunked_grads[name], grads[name], rtol=1e-4, atol=1e-6 * max(scale, 1.0))


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
        results.append(loss_and_gradients(model, batch, chunk_tokens))
        # The head is restored: the model gives logits again.
        assert model(input_ids=batch.input_ids).logits.shape[-1] == model.config.vocab_size
    standard, chunked = results
    assert_same_loss_and_gradients(chunked, standard)


def test_chunked_loss_refuses_models_that_transform_logits(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.logit_scale = 0.5  # Cohere's
    expected = "loss_chunk_tokens: not for LlamaForCausalLM: it transforms logits.*turn it off"
    with pytest.raises(ConfigError, match=expected):
        summed_token_loss(model, batch_with_prompts_and_padding(), None, 16)


@pytest.mark.parametrize("arch", ["gemma2", "gemma4_text"])
def test_chunked_loss_caps_the_logits_as_the_model_does(tmp_path, arch):
    """Gemma 2 and Gemma 4 cap their logits at final_logit_softcapping (cap * tanh(logits / cap)) after the LM
    head: the chunked loss caps each chunk's logits itself (the model's own cap off while its head stands in), with
    the standard loss's loss and every gradient, and the model caps its logits again afterwards."""
    from tiny_models import FUSED_MOE_ARCHITECTURES, write_tiny_model

    if arch not in {**FUSED_MOE_ARCHITECTURES, "gemma2": None}:
        pytest.skip(f"this transformers has no {arch}")
    directory = write_tiny_model(tmp_path / arch, arch)
    batch = batch_with_prompts_and_padding()
    results = []
    for chunk_tokens in (0, 7):
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(directory)
        config.final_logit_softcapping = 30.0  # Gemma 2's default, Gemma 4 26B-A4B's
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        assert model.config.final_logit_softcapping == 30.0 and head_vocab(model) == model.config.vocab_size
        with torch.no_grad():  # logits up to about 60: the cap bends them
            model.get_output_embeddings().weight.mul_(60 / model(input_ids=batch.input_ids).logits.abs().max())
        results.append(loss_and_gradients(model, batch, chunk_tokens))
        logits = model(input_ids=batch.input_ids).logits
        assert model.config.final_logit_softcapping == 30.0 and 25 < logits.abs().max() < 30
    standard, chunked = results
    assert_same_loss_and_gradients(chunked, standard)


@pytest.fixture(scope="module")
def compiled_softmax():
    if not softmax_compiles_right_on("cpu"):  # training takes the eager softmax there (test_compile.py)
        pytest.skip(f"torch {torch.__version__}'s inductor computes this loss wrong on a CPU")
    torch._dynamo.reset()
    compiler = LayerCompiler()
    yield compiler, compiled_softmax_gradient(compiler)
    torch._dynamo.reset()


def test_the_compiled_softmax_gradient_equals_the_eager_one_and_overwrites_the_logits(compiled_softmax):
    """Its loss and gradient equal the eager ops' (fp32 and bf16 logits, ignored rows), written over the
    logits with no buffer of their size (inductor's code allocates only per-row values); a second row count
    compiles once more (dynamic rows), a third not at all."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    compiler, compiled = compiled_softmax
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    for rows, dtype in ((64, torch.bfloat16), (64, torch.float32), (37, torch.bfloat16), (21, torch.bfloat16)):
        logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
        targets = torch.randint(0, vocab, (rows,), generator=generator)
        targets[:5] = IGNORE_INDEX
        eager_logits, compiled_logits = logits.clone(), logits.clone()
        eager_loss = softmax_gradient_(eager_logits, targets)
        code = []  # the source of what inductor compiles for this call, if anything
        with mock.patch.object(GraphLowering, "save_output_code", code.append):
            compiled_loss = compiled(compiled_logits, targets)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
        # Within one rounding of the logits' dtype (fp32 exp and log differ in their last bits).
        rounding = torch.finfo(dtype).eps
        torch.testing.assert_close(compiled_logits, eager_logits, rtol=rounding, atol=1e-6)
        expected = torch.softmax(logits.float(), -1) - torch.nn.functional.one_hot(targets.clamp_min(0), vocab)
        torch.testing.assert_close(compiled_logits.float()[5:], expected[5:], rtol=1e-2, atol=1e-3)
        assert not compiled_logits[:5].any()  # ignored rows: no gradient
        allocations = [line for source in code for line in source.splitlines() if "= empty_strided" in line]
        assert not any(f"{vocab}" in line for line in allocations), allocations
        assert bool(allocations) == (rows != 21)  # the dynamic graph of 37 rows serves 21
    # 64 rows in bf16 and fp32 (a dtype change compiles again), then any row count in bf16.
    assert compiler.graphs == 3 and compiler.failure is None


@pytest.mark.parametrize("softmax", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_gives_the_standard_loss_and_every_gradient(dtype, softmax, request):
    """Chunks of 5 rows, ignored targets, a bias, and an incoming gradient that is not 1: as autograd through
    the logits. In bf16 (weights bf16, as a LoRA run holds its frozen head) within bf16 rounding; the
    chunks' softmax eager and compiled."""
    softmax_gradient = request.getfixturevalue("compiled_softmax")[1] if softmax == "compiled" else softmax_gradient_
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=generator).to(dtype)
    weight = (torch.randn(50, 16, generator=generator) / 4).to(dtype)
    bias = torch.randn(50, generator=generator).to(dtype)
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    targets[0, :4] = IGNORE_INDEX
    targets[2, -1] = IGNORE_INDEX
    scale = 0.37
    results = []
    for chunked in (False, True):
        inputs = [tensor.clone().requires_grad_() for tensor in (hidden, weight, bias)]
        if chunked:
            loss = LinearCrossEntropy.apply(*inputs, targets, 5, True, softmax_gradient)
        else:
            logits = torch.nn.functional.linear(*inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        (loss * scale).backward()
        results.append((loss.detach(), [tensor.grad for tensor in inputs]))
    (loss, grads), (chunked_loss, chunked_grads) = results
    assert chunked_loss.dtype == torch.float32
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=0)
    for chunked_grad, grad in zip(chunked_grads, grads, strict=True):
        assert chunked_grad.dtype == grad.dtype == dtype
        torch.testing.assert_close(chunked_grad, grad, **tolerance)
    # Ignored positions get no gradient at all.
    assert not chunked_grads[0][0, :4].any() and not chunked_grads[0][2, -1].any()


def test_linear_cross_entropy_without_gradients_only_sums_the_loss():
    """Evaluation of a full fine-tune (a head that requires grad, under no_grad): the logits' GEMM and no
    other, where training runs two more (the gradients of the head's input and weights)."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight = torch.randn(9, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 20, (9,))
    for grad_enabled, gemms in ((False, 1), (True, 3)):
        with torch.set_grad_enabled(grad_enabled), FlopCounterMode(display=False) as flops:
            loss = LinearCrossEntropy.apply(hidden, weight, None, targets, 4, grad_enabled)
        assert flops.get_total_flops() == gemms * 2 * 9 * 8 * 20
        expected = torch.nn.functional.cross_entropy(hidden.detach() @ weight.detach().T, targets, reduction="sum")
        torch.testing.assert_close(loss.detach(), expected)
        assert (loss.grad_fn is None) != grad_enabled


@pytest.mark.parametrize(
    ("setting", "vocab", "tokens", "chunk"),
    [
        ("auto", 151_936, 8_192, 1_024),  # Qwen3: 2**28 / 151,936 = 1,766, rounded down to a power of two
        ("auto", 128_256, 8_192, 2_048),  # Llama 3
        ("auto", 32_000, 8_192, 0),  # Mistral: one chunk would hold the whole batch, the standard loss does
        ("auto", 32_000, 16_384, 8_192),
        ("auto", None, 16_384, 0),  # no plain linear head (or logits transformed after it)
        ("auto", 10_000_000, 4_096, 128),  # never fewer rows than a GEMM worth running
        (0, 151_936, 8_192, 0),
        (300, 151_936, 8_192, 300),
    ],
)
def test_chunk_size_by_vocabulary_and_batch(setting, vocab, tokens, chunk):
    assert chunk_tokens_for(setting, vocab, tokens) == chunk


def test_auto_chunks_a_batch_whose_logits_pass_the_limit(tiny_model_dir, monkeypatch):
    """The tiny model's batch (3 x 30 positions) under ``auto``: the standard loss (its logits are far below
    the limit); with chunks of 16 rows made the auto size, the chunked loss, in 6 chunks, equal to it."""
    import shardtune.train.loss as loss_module

    batch = batch_with_prompts_and_padding()
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoraConfig(r=4))
    assert head_vocab(model) == model.config.vocab_size
    chunks = []
    apply = LinearCrossEntropy.apply
    monkeypatch.setattr(LinearCrossEntropy, "apply", lambda *args: chunks.append(args[4]) or apply(*args))
    standard = summed_token_loss(model, batch, None, "auto")
    assert chunks == []
    monkeypatch.setattr(loss_module, "auto_chunk_tokens", lambda vocab: 16)
    chunked = summed_token_loss(model, batch, None, "auto")
    assert chunks == [16] and batch.targets.numel() == 90
    torch.testing.assert_close(chunked, standard, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("setting", "vocab", "fused", "compiled", "line"),
    [
        (
            "auto",
            151_936,
            False,
            True,
            "loss: cross-entropy and its gradients 1,024 tokens at a time in the forward pass, the softmax "
            "compiled (training.loss_chunk_tokens: auto)",
        ),
        (
            300,
            151_936,
            False,
            False,
            "loss: cross-entropy and its gradients 300 tokens at a time in the forward pass, the softmax "
            "eager (training.loss_chunk_tokens: 300)",
        ),
        ("auto", 32_000, False, True, "loss: cross-entropy over all logits at once (training.loss_chunk_tokens: auto)"),
        (0, 151_936, False, True, "loss: cross-entropy over all logits at once (training.loss_chunk_tokens: 0)"),
        ("auto", 151_936, True, True, "loss: liger-kernel's fused linear cross-entropy (model.liger_kernel)"),
    ],
)
def test_the_log_names_the_loss(setting, vocab, fused, compiled, line):
    assert describe_loss(setting, vocab, 8_192, fused, compiled) == line


def packed_batch_of_two_rows():
    """Two rows of two packed examples each; the positions restart where each example begins."""
    generator = torch.Generator().manual_seed(3)
    sequences = []
    for lengths in ((12, 18), (20, 7)):
        ids = torch.randint(3, 1000, (sum(lengths),), generator=generator).numpy()
        targets = ids.copy()
        targets[lengths[0] - 1] = IGNORE_INDEX  # no example predicts the next one's first token
        positions = torch.cat([torch.arange(n) for n in lengths]).numpy().astype("int32")
        sequences.append((ids, targets, positions))
    return collate(sequences, pad_token_id=0, packed=True)


def test_flash_attention_models_get_packed_rows_as_one_row_with_the_same_loss(tiny_model_dir):
    """transformers' flash attention isolates packed examples only in a one-row batch: such a model gets the
    rows laid end to end. The loss of that one row is the loss of the rows (sdpa, which runs
    here under a config that names flash attention, isolates the examples either way); other implementations
    keep their rows."""
    import copy

    class NamesFlashAttention(torch.nn.Module):
        def __init__(self, model: torch.nn.Module, implementation: str):
            super().__init__()
            self.model = model
            self.config = copy.copy(model.config)
            self.config._attn_implementation = implementation
            self.seen: list[dict] = []

        def forward(self, **inputs):
            self.seen.append(inputs)
            return self.model(**inputs)

    batch = packed_batch_of_two_rows()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    rows = summed_token_loss(model, batch, None)
    for implementation in ("flash_attention_2", "sdpa"):
        wrapper = NamesFlashAttention(model, implementation)
        assert summed_token_loss(wrapper, batch, None).item() == pytest.approx(rows.item(), rel=1e-6)
        if implementation == "sdpa":
            assert wrapper.seen[-1]["input_ids"].shape == batch.input_ids.shape
        else:
            assert wrapper.seen[-1]["input_ids"].shape == (1, batch.input_ids.numel())
            assert torch.equal(wrapper.seen[-1]["position_ids"], batch.position_ids.reshape(1, -1))

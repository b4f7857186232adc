"""seqckpt on models nobody here wrote: torchvision ResNets, timm models and HF
transformers, each checked against its plain run (bitwise gradients, outputs and
buffers on the CPU) and for a lower peak memory.

- torchvision: ``seqckpt.checkpoint_blocks(model)`` swaps the stages
  (``layer1``..``layer4``) for CheckpointedSequential.
- timm: the same call replaces ``model.set_grad_checkpointing()`` (leave that
  off): ViT's ``blocks``, ConvNeXt's per-stage ``blocks``, ResNet's stages.
- Code that calls ``torch.utils.checkpoint.checkpoint`` itself (timm with
  ``model.set_grad_checkpointing()``, torchvision's DenseNet with
  ``memory_efficient=True``) runs seqckpt's inside
  ``seqckpt.replace_torch_checkpoint()``, unchanged.
- HF transformers: seqckpt becomes the model's checkpoint function. The public
  ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable()``
  in transformers 5) only takes keyword arguments for torch's function; the
  function itself can only be given through the private
  ``model._set_gradient_checkpointing(gradient_checkpointing_func=...)``.

Run ``python examples/real_models.py`` with torchvision, timm and transformers
installed; each part runs if its package is there. The tests run each part
where the package is installed.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import seqckpt


def compare(
    build: Callable[[], nn.Module],
    inputs: Any,
    convert: Callable[[nn.Module], nn.Module],
    loss: Callable[[Any], torch.Tensor] = lambda out: out.float().sum(),
) -> tuple[int, int]:
    """Train one step plainly and one with ``convert(model)`` from the same
    weights and RNG seed; assert bitwise equal outputs, gradients and buffers,
    and return both peak bytes (CPU live tensors beyond parameters and their
    gradients, which are allocated first as in a training loop). NumPy's
    global RNG, where NumPy is loaded, is seeded with torch's (HF's speech
    models draw their SpecAugment masks from it, outside any region)."""
    torch.manual_seed(0)
    plain = build().train()
    checkpointed = convert(copy.deepcopy(plain))
    peaks, results = [], []
    for model in (plain, checkpointed):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        torch.manual_seed(1)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(1)
        with seqckpt.track_memory("cpu") as mem:
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            loss(out).backward()
        peaks.append(mem.peak_bytes)
        results.append(
            (
                loss(out).detach(),
                [p.grad for p in model.parameters()],
                list(model.buffers()),
            )
        )
    (loss_a, grads_a, bufs_a), (loss_b, grads_b, bufs_b) = results
    assert torch.equal(loss_a, loss_b), "outputs differ"
    assert any(g is not None for g in grads_a), "no gradient reached the model"
    for i, (a, b) in enumerate(zip(grads_a, grads_b, strict=True)):
        assert (a is None) == (b is None), f"parameter {i}: one gradient is None"
        assert a is None or torch.equal(a, b), f"parameter {i}: gradients differ"
    for i, (a, b) in enumerate(zip(bufs_a, bufs_b, strict=True)):
        assert torch.equal(a, b), f"buffer {i} differs"
    return peaks[0], peaks[1]


def report(name: str, peaks: tuple[int, int]) -> None:
    plain, ckpt = peaks
    print(
        f"{name:<36} bitwise equal, peak {plain / 2**20:7.2f} -> "
        f"{ckpt / 2**20:7.2f} MiB ({100 * (1 - ckpt / plain):4.1f}% less)"
    )


class UnderSeqckpt(nn.Module):
    """Runs ``model`` with torch's checkpoint functions replaced by seqckpt's
    (for models that call torch's themselves)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with seqckpt.replace_torch_checkpoint():
            return self.model(*args, **kwargs)


# ------------------------------------------------------------------ torchvision


def check_torchvision() -> dict[str, tuple[int, int]]:
    import torchvision

    x = torch.randn(4, 3, 128, 128)
    found = {}
    for name in ("resnet18", "resnet50"):
        build = functools.partial(getattr(torchvision.models, name), num_classes=10)
        found[name] = compare(build, x, seqckpt.checkpoint_blocks)
    # Stochastic depth draws random numbers in every block: replayed.
    for name in ("efficientnet_b0", "swin_t"):
        build = functools.partial(getattr(torchvision.models, name), num_classes=10)
        found[name] = compare(
            build, torch.randn(2, 3, 64, 64), seqckpt.checkpoint_blocks
        )

    # DenseNet checkpoints its own layers with torch's function when memory
    # efficient; BatchNorm statistics are updated once under seqckpt's (twice
    # under torch's, which is not equal to the plain run).
    def memory_efficient(model: nn.Module) -> nn.Module:
        for layer in model.modules():
            if hasattr(layer, "memory_efficient"):
                layer.memory_efficient = True
        return UnderSeqckpt(model)

    build = functools.partial(torchvision.models.densenet121, num_classes=10)
    found["densenet121 (own ckpt)"] = compare(
        build, torch.randn(2, 3, 64, 64), memory_efficient
    )
    # Its blocks are nn.ModuleDict subclasses whose layers take the growing
    # list of features: each layer a region of its own.
    found["densenet121"] = compare(
        build, torch.randn(2, 3, 64, 64), seqckpt.checkpoint_blocks
    )
    # Its Inception blocks are attributes of the model (inception3a, ...),
    # each running its branches side by side: each block a region.
    build = functools.partial(
        torchvision.models.googlenet,
        num_classes=10,
        aux_logits=False,
        init_weights=True,
    )
    found["googlenet"] = compare(
        build, torch.randn(2, 3, 96, 96), seqckpt.checkpoint_blocks
    )
    return found


# ------------------------------------------------------------------------- timm


def check_timm() -> dict[str, tuple[int, int]]:
    import timm

    found = {}
    for name, size in (
        ("vit_tiny_patch16_224", 128),
        ("convnext_atto", 128),
        ("resnet18", 128),
        ("deit_tiny_patch16_224", 96),
    ):
        extra: dict[str, Any] = {"img_size": size} if "patch16" in name else {}
        if name.startswith("deit"):  # dropout and drop path: random in training
            extra.update(drop_rate=0.1, drop_path_rate=0.1)
        build = functools.partial(
            timm.create_model, name, pretrained=False, num_classes=10, **extra
        )
        x = torch.randn(4, 3, size, size)
        found[name] = compare(build, x, seqckpt.checkpoint_blocks)

    # timm's own switch, running seqckpt under the drop-in
    def timm_switch(model: nn.Module) -> nn.Module:
        model.set_grad_checkpointing(True)
        return UnderSeqckpt(model)

    for name in ("convnext_atto", "resnet18"):
        build = functools.partial(
            timm.create_model, name, pretrained=False, num_classes=10
        )
        found[f"{name} (set_grad_ckpt)"] = compare(
            build, torch.randn(4, 3, 128, 128), timm_switch
        )
    return found


# ---------------------------------------------------------------- transformers


def use_seqckpt(model: nn.Module, **options: Any) -> nn.Module:
    """Make seqckpt the checkpoint function of an HF model (``options``: for
    :func:`seqckpt.checkpoint`, such as ``policy``)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:  # transformers 4
        enable = model.gradient_checkpointing_enable
    enable()  # public: flags the layers, lets the input embeddings get grads
    model._set_gradient_checkpointing(  # private: the only route for a function
        enable=True,
        gradient_checkpointing_func=functools.partial(
            seqckpt.checkpoint, use_reentrant=False, **options
        ),
    )
    return model


def check_transformers() -> dict[str, tuple[int, int]]:
    import transformers

    gpt2 = transformers.GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    llama = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    bert = transformers.BertConfig(  # dropout 0.1 in attention and hidden layers
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    t5 = transformers.T5Config(  # encoder and decoder stacks, dropout 0.1
        num_layers=2,
        num_decoder_layers=2,
        d_model=32,
        d_ff=64,
        num_heads=2,
        d_kv=16,
        vocab_size=128,
        decoder_start_token_id=0,
    )
    ids = torch.randint(0, 128, (4, 64))
    logits = lambda out: out.logits.float().sum()  # noqa: E731
    found = {}
    for name, config, cls, inputs, loss in (
        ("gpt2", gpt2, transformers.GPT2LMHeadModel, {"use_cache": False}, logits),
        ("llama", llama, transformers.LlamaForCausalLM, {"use_cache": False}, logits),
        ("bert", bert, transformers.BertForMaskedLM, {}, logits),
        (
            "t5",
            t5,
            transformers.T5ForConditionalGeneration,
            {"labels": ids, "use_cache": False},
            lambda out: out.loss.float(),
        ),
    ):
        found[name] = compare(
            functools.partial(cls, config),
            {"input_ids": ids, **inputs},
            use_seqckpt,
            loss=loss,
        )
    return found


CHECKS = {
    "torchvision": check_torchvision,
    "timm": check_timm,
    "transformers": check_transformers,
}

if __name__ == "__main__":
    for package, check in CHECKS.items():
        if importlib.util.find_spec(package) is None:
            print(f"{package}: not installed, skipped")
            continue
        for name, peaks in check().items():
            report(f"{package} {name}", peaks)

"""Real clients, where they are installed: torchvision ResNets, timm models and
HF transformers trained with seqckpt (examples/real_models.py), and diffusers
models through examples/model_sweep.py, bitwise equal to their plain runs and
lighter. CI does not install them (the torchvision
wheel reachable there does not import against the CPU build of torch); these
tests skip cleanly without them and must pass where they are installed."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "real_models.py"


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    return runpy.run_path(str(EXAMPLE))  # definitions only: no __main__ run


def check(example: dict[str, Any], package: str) -> None:
    pytest.importorskip(package)
    results = example["CHECKS"][package]()  # asserts bitwise equality inside
    assert results
    for name, (plain, checkpointed) in results.items():
        assert checkpointed < plain, f"{package} {name}: peak did not drop"


@pytest.mark.slow
def test_torchvision_resnets(example: dict[str, Any]) -> None:
    check(example, "torchvision")


@pytest.mark.slow
def test_timm_models(example: dict[str, Any]) -> None:
    check(example, "timm")


@pytest.mark.slow
def test_hf_transformers_with_seqckpt_as_the_checkpoint_function(
    example: dict[str, Any],
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    model = example["use_seqckpt"](transformers.GPT2LMHeadModel(config))
    functions = [
        m._gradient_checkpointing_func
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False)
    ]
    assert functions and all(
        f.func.__module__ == "seqckpt.checkpoint" for f in functions
    )
    check(example, "transformers")


@pytest.mark.slow
def test_model_sweep_runs_where_its_packages_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A few models of the wider sweep, every policy, so the script does not rot.
    pytest.importorskip("torchvision")
    pytest.importorskip("transformers")
    sweep = runpy.run_path(str(EXAMPLE.parent / "model_sweep.py"))
    code = sweep["main"](
        ["--only", "mobilenet_v2,gpt2", "--policies", "none,compute_heavy,everything"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    # mobilenet_v2, its QAT-prepared twin and gpt2, under three policies each
    assert out.count("bitwise equal") == 3 * 3 and "0 failed" in out


@pytest.mark.slow
@pytest.mark.parametrize("route", ["function", "blocks"])
def test_diffusers_models_through_both_routes(
    capsys: pytest.CaptureFixture[str], route: str
) -> None:
    # diffusers' own enable_gradient_checkpointing(gradient_checkpointing_func=
    # seqckpt.checkpoint), and checkpoint_blocks instead: five models, three
    # policies, each bitwise equal to the plain run.
    pytest.importorskip("diffusers")
    sweep = runpy.run_path(str(EXAMPLE.parent / "model_sweep.py"))
    code = sweep["main"](
        ["--only", "diffusers", "--policies", "none,compute_heavy,everything"]
        + ["--hf-route", route]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("bitwise equal") == 5 * 3 and "0 failed" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "efficientnet_b0"])
def test_timm_own_switch_keeps_only_the_statistics_each_region_updates(
    example: dict[str, Any], name: str
) -> None:
    # timm's checkpoint_seq closes over every block and runs one per region:
    # seqckpt kept every block's batch-norm statistics in every region
    # (resnet50: nn.BatchNorm2d; efficientnet_b0: timm's BatchNormAct2d), a
    # peak above torch's by about a megabyte at 64x64. Now the difference is
    # one copy of the statistics (the first-run values, which torch does not
    # keep, updating them twice).
    import functools

    import torch

    import seqckpt

    timm = pytest.importorskip("timm")
    build = functools.partial(timm.create_model, name, num_classes=3)

    def switched(model: Any) -> Any:
        model.set_grad_checkpointing(True)
        return example["UnderSeqckpt"](model)

    images = torch.randn(2, 3, 64, 64)
    example["compare"](build, images, switched)  # bitwise, inside
    peaks = {}
    for route in ("torch", "seqckpt"):
        torch.manual_seed(0)
        model = build().train()
        model.set_grad_checkpointing(True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with seqckpt.track_memory() as mem:
            if route == "torch":
                out = model(images)
            else:
                with seqckpt.replace_torch_checkpoint():
                    out = model(images)
            out.float().sum().backward()
        peaks[route] = mem.peak_bytes
    statistics = sum(b.numel() * b.element_size() for b in model.buffers())
    assert peaks["seqckpt"] <= peaks["torch"] + statistics, peaks


@pytest.mark.slow
def test_every_hf_type_sweep_runs_where_transformers_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A causal LM, a vision model with batch norms (whose statistics torch's
    # checkpoint updates twice, which the sweep reports beside), an encoder-
    # decoder, and a speech model whose SpecAugment masks come from NumPy's RNG
    # (for CTC and for audio classification).
    pytest.importorskip("transformers")
    sweep = runpy.run_path(str(EXAMPLE.parent / "hf_every_type.py"))
    code = sweep["main"](
        ["--only", "llama,mobilevit,t5,wav2vec2", "--policies", "none,values"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("bitwise equal") == 5 * 2, out
    for task in (
        "causal-lm",
        "image-classification",
        "seq2seq-lm",
        "ctc",
        "audio-classification",
    ):
        assert f"{task}: 2 bitwise, 0 failed" in out, out


@pytest.mark.slow
def test_hf_trainer_keeps_seqckpt_as_the_checkpoint_function(tmp_path: Path) -> None:
    # The README's Trainer route: seqckpt set as the layers' checkpoint function
    # before building the Trainer, HF's own flag left off in the arguments. Two
    # steps are bitwise those of a plain Trainer run; with the flag on, the
    # Trainer puts torch's function back (the README warns of it).
    import copy
    import functools

    import torch

    import seqckpt

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        attention_dropout=0.1,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config)
    data = [
        {
            "input_ids": torch.randint(0, 128, (12,)),
            "labels": torch.randint(0, 128, (12,)),
        }
        for _ in range(8)
    ]
    fields = transformers.TrainingArguments.__dataclass_fields__
    flag = next(
        f for f in ("activation_checkpointing", "gradient_checkpointing") if f in fields
    )

    def train(with_seqckpt: bool, hf_flag: bool) -> tuple[Any, list[Any], str]:
        model = copy.deepcopy(base)
        if with_seqckpt:
            getattr(model, f"{flag}_enable")()
            model._set_gradient_checkpointing(
                enable=True,
                gradient_checkpointing_func=functools.partial(
                    seqckpt.checkpoint, use_reentrant=False
                ),
            )
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
            **{flag: hf_flag},
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        function = getattr(model.model, "_gradient_checkpointing_func", None)
        where = getattr(getattr(function, "func", function), "__module__", "")
        return losses, [p.detach().clone() for p in model.parameters()], where

    plain_losses, plain_weights, _ = train(False, False)
    losses, weights, where = train(True, False)
    assert where == "seqckpt.checkpoint"
    assert losses == plain_losses and len(losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert train(True, True)[2] == "torch.utils.checkpoint"


@pytest.mark.slow
def test_hf_decoder_cache_and_peft_prefix_tuning_through_checkpoint_blocks(
    example: dict[str, Any],
) -> None:
    # With its cache on (HF's default in training) a decoder fills the cache
    # in each layer; PEFT's prefix tuning hands every layer a cache prefilled
    # with its learned prefix. Both train bitwise through checkpoint_blocks,
    # and the cache a step returns is the plain step's (before 2026-12-06 the
    # recompute appended to it again: a shape error in backward).
    import copy

    import torch

    import seqckpt

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        attention_dropout=0.1, use_cache=True,
    )  # fmt: skip
    ids = torch.randint(0, 128, (2, 8))
    caches: list[list[torch.Tensor]] = []

    def loss(out: Any) -> torch.Tensor:
        cache = out.past_key_values  # transformers 5: a DynamicLayer per layer
        parts = [(p.keys, p.values) for p in cache.layers]
        caches.append([t.detach().clone() for pair in parts for t in pair])
        return out.logits.float().sum()

    def llama() -> Any:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)

    example["compare"](llama, {"input_ids": ids}, seqckpt.checkpoint_blocks, loss)
    # (loss runs twice per model: before backward and after, when a recompute
    # has run)
    plain, checkpointed = caches[1], caches[3]
    assert len(plain) == 4 and len(checkpointed) == 4  # keys, values per layer
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))

    peft = pytest.importorskip("peft")
    prefix = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    example["compare"](
        lambda: peft.get_peft_model(llama(), copy.deepcopy(prefix)),
        {"input_ids": ids, "labels": ids},
        seqckpt.checkpoint_blocks,
        lambda out: out.loss.float(),
    )


@pytest.mark.slow
def test_hf_attention_kept_whole_through_either_route(example: dict[str, Any]) -> None:
    """seqckpt.keep_modules on a Llama's self_attn (attention dropout on):
    bitwise through HF's switch with seqckpt's function and through
    checkpoint_blocks, the attention not run again in backward, and the peak
    between the region that keeps nothing and the plain run."""
    transformers = pytest.importorskip("transformers")
    import torch

    import seqckpt

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attention_dropout=0.1,
        use_cache=False,
    )
    ids = torch.randint(0, 128, (2, 32))

    def loss(out: Any) -> torch.Tensor:
        return out.logits.float().logsumexp(-1).mean()

    def build() -> Any:
        return transformers.LlamaForCausalLM(config)

    routes = {
        "hf": example["use_seqckpt"],
        "blocks": seqckpt.checkpoint_blocks,
    }
    for route in routes.values():

        def kept(model: Any, route: Any = route) -> Any:
            assert len(seqckpt.keep_modules(model, "self_attn")) == 3
            return route(model)

        plain, keeping = example["compare"](build, {"input_ids": ids}, kept, loss)
        _, nothing = example["compare"](build, {"input_ids": ids}, route, loss)
        assert nothing < keeping < plain

    model = example["use_seqckpt"](build().train())
    calls = []
    for layer in model.model.layers:  # counts the attention's own forward
        forward = layer.self_attn.forward

        def counted(*args: Any, forward: Any = forward, **kwargs: Any) -> Any:
            calls.append(1)
            return forward(*args, **kwargs)

        layer.self_attn.forward = counted
    seqckpt.keep_modules(model, "self_attn")  # (wraps the counting forward)
    out = model(input_ids=ids)
    assert len(calls) == 3
    loss(out).backward()
    assert len(calls) == 3  # each layer recomputed, its attention served


@pytest.mark.slow
def test_validate_takes_real_whole_models() -> None:
    """seqckpt.validate on a timm ViT (a tensor sample) and an HF Llama (a
    dict sample: keywords, logits and loss in the output): bitwise, lighter."""
    import torch

    import seqckpt

    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = timm.create_model(
        "vit_tiny_patch16_224", num_classes=10, drop_rate=0.1, drop_path_rate=0.1
    )
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=64,
    )
    llama = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (8, 64))
    for model, sample, blocks in (
        (vit, torch.randn(2, 3, 224, 224), 12),
        (llama, {"input_ids": ids, "labels": ids}, 3),
    ):
        (row,) = seqckpt.validate(model.train(), sample=sample)
        assert row["bitwise_equal"] and row["ok"], row
        assert row["blocks"] == blocks

"""A wider sweep than ``real_models.py``: dozens of torchvision, timm, HF
transformers and diffusers models, PEFT adapters and an open_clip CLIP, each
trained one step plainly and one step with seqckpt from the same weights and
seed, under each chosen policy, and checked bitwise (outputs, every gradient,
every buffer) with ``real_models.compare``.

Vision models go through ``seqckpt.checkpoint_blocks(model, policy=...)`` (or,
where it finds no stack of repeated blocks, their ``features`` trunk becomes
one ``CheckpointedSequential``, or timm's own ``set_grad_checkpointing()`` runs
under ``seqckpt.replace_torch_checkpoint(policy=...)``); HF
models get ``seqckpt.checkpoint`` (with the policy) as their checkpoint
function through ``real_models.use_seqckpt``, or with ``--hf-route blocks``
``seqckpt.checkpoint_blocks`` on the model (public API only: each layer of
their ``nn.ModuleList`` is a region); diffusers models (UNet, VAE, DiT, SD3,
Flux) get ``seqckpt.checkpoint`` through their own
``enable_gradient_checkpointing(gradient_checkpointing_func=...)``, or
``checkpoint_blocks`` with ``--hf-route blocks``; PEFT models (LoRA, DoRA,
IA3, LoHa on a frozen Llama) go the HF way, the CLIP the vision way. Dropout,
stochastic depth, MoE router noise, BatchNorm, in-place activations and (two
torchvision models prepared for quantization-aware training) fake-quantizers
with their observers are left on where the model has them. Sizes are small:
this checks correctness, not speed.

Usage (with torchvision, timm, transformers, diffusers, peft and open_clip
installed; a missing package's models are skipped)::

    python examples/model_sweep.py                       # default policy only
    python examples/model_sweep.py --policies none,compute_heavy,values,everything
    python examples/model_sweep.py --only mixtral,swin   # names containing these
    python examples/model_sweep.py --only transformers --hf-route blocks

``values`` keeps nothing and compares fingerprints of every tensor the
recompute saves with the forward's (``determinism_check="values"``);
``everything`` keeps every op's output and checks the same. Exits 1 if any
model fails.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import seqckpt

sys.path.insert(0, str(Path(__file__).parent))
from real_models import compare, use_seqckpt  # noqa: E402

Case = tuple[str, Callable[[], nn.Module], Any, Callable[[Any], torch.Tensor], str]
POLICIES: dict[str, dict[str, Any]] = {
    "none": {},
    "compute_heavy": {"policy": "compute_heavy"},
    "values": {"determinism_check": "values"},  # the recompute fingerprinted
    "everything": {
        "policy": lambda op, *args, **kwargs: True,
        "determinism_check": "values",
    },
}


def _summed(out: Any) -> torch.Tensor:
    if isinstance(out, dict):  # segmentation heads, detection losses
        return sum(v.float().sum() for v in out.values())  # type: ignore[return-value]
    return out.float().sum()  # type: ignore[no-any-return]


def torchvision_cases() -> list[Case]:
    import torchvision.models as tvm
    from torchvision.models import detection, segmentation, video

    small = torch.randn(2, 3, 64, 64)
    cases: list[Case] = []
    for name in (
        "resnet18", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
        "regnet_y_400mf", "shufflenet_v2_x0_5", "vgg11_bn", "densenet121",
        "mnasnet0_5", "swin_t",
    ):  # fmt: skip
        build = functools.partial(getattr(tvm, name), num_classes=10)
        cases.append((f"torchvision {name}", build, small, _summed, "vision"))
    # MaxViT loops over nn.ModuleList stacks (224x224: its window partitions)
    cases.append(
        (
            "torchvision maxvit_t",
            functools.partial(tvm.maxvit_t, num_classes=10),
            torch.randn(2, 3, 224, 224),
            _summed,
            "vision",
        )
    )
    vit = functools.partial(
        tvm.VisionTransformer, image_size=32, patch_size=8, num_layers=3,
        num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10, dropout=0.1,
    )  # fmt: skip
    cases.append(
        ("torchvision vit (small)", vit, torch.randn(2, 3, 32, 32), _summed, "vision")
    )
    segment = {"num_classes": 4, "weights_backbone": None}
    for name in (
        "fcn_resnet50",
        "deeplabv3_mobilenet_v3_large",
        "lraspp_mobilenet_v3_large",
    ):
        build = functools.partial(getattr(segmentation, name), **segment)
        cases.append(
            (f"torchvision {name}", build, torch.randn(2, 3, 96, 96), _summed, "vision")
        )
    for name in ("mobilenet_v2", "resnet18"):
        build = functools.partial(_prepared_for_qat, name)
        cases.append((f"torchvision {name} (QAT)", build, small, _summed, "vision"))
    images = [torch.rand(3, 128, 128), torch.rand(3, 128, 128)]
    targets = [
        {
            "boxes": torch.tensor([[10.0, 10.0, 60.0, 70.0]]),
            "labels": torch.tensor([1]),
        },
        {
            "boxes": torch.tensor([[20.0, 30.0, 90.0, 100.0]]),
            "labels": torch.tensor([2]),
        },
    ]
    for name in (
        "fasterrcnn_mobilenet_v3_large_fpn",
        "retinanet_resnet50_fpn",
        "fcos_resnet50_fpn",
        "ssdlite320_mobilenet_v3_large",
    ):
        build = functools.partial(_Detector, getattr(detection, name), images, targets)
        cases.append((f"torchvision {name}", build, torch.empty(0), _summed, "vision"))
    # instance masks and keypoints: heads of their own after the box head
    masked = [
        {**t, "masks": _box_mask(t["boxes"][0]), "keypoints": _keypoints(t["boxes"][0])}
        for t in targets
    ]
    for name in ("maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"):
        build = functools.partial(_Detector, getattr(detection, name), images, masked)
        cases.append((f"torchvision {name}", build, torch.empty(0), _summed, "vision"))
    clips = torch.randn(2, 3, 8, 32, 32)  # (batch, channels, frames, height, width)
    for name in ("r3d_18", "r2plus1d_18", "mc3_18", "swin3d_t"):
        build = functools.partial(getattr(video, name), num_classes=5)
        cases.append((f"torchvision {name} (video)", build, clips, _summed, "vision"))
    return cases


def _box_mask(box: torch.Tensor) -> torch.Tensor:
    """A (1, 128, 128) instance mask filling ``box``."""
    mask = torch.zeros(1, 128, 128, dtype=torch.uint8)
    x0, y0, x1, y1 = box.int().tolist()
    mask[0, y0:y1, x0:x1] = 1
    return mask


def _keypoints(box: torch.Tensor) -> torch.Tensor:
    """17 visible keypoints (COCO's count) spread over ``box``'s diagonal."""
    steps = torch.linspace(0.1, 0.9, 17)
    x = box[0] + steps * (box[2] - box[0])
    y = box[1] + steps * (box[3] - box[1])
    return torch.stack([x, y, torch.ones(17)], dim=1)[None]


def _prepared_for_qat(name: str) -> nn.Module:
    """A torchvision quantizable model fused and prepared for quantization-aware
    training with the default (fused fake-quantize) configuration, its
    observers past their first batch (a second update moves them)."""
    from torchvision.models import quantization

    model = getattr(quantization, name)(weights=None, quantize=False, num_classes=10)
    model.train()
    model.fuse_model(is_qat=True)
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():  # torch.ao's deprecation notices
        warnings.simplefilter("ignore")
        torch.ao.quantization.prepare_qat(model, inplace=True)
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    return model


class _Detector(nn.Module):
    """A detection model in training mode: images and targets fixed, losses out."""

    def __init__(
        self, build: Callable[..., nn.Module], images: Any, targets: Any
    ) -> None:
        super().__init__()
        # (SSD models resize to their own fixed size)
        sizes = {} if "ssd" in build.__name__ else {"min_size": 128, "max_size": 128}
        self.model = build(weights=None, weights_backbone=None, num_classes=3, **sizes)
        self.images, self.targets = images, targets

    def forward(self, _: torch.Tensor) -> Any:
        return self.model(self.images, self.targets)


def timm_cases() -> list[Case]:
    import timm

    cases: list[Case] = []
    for name, extra in (
        ("efficientnet_b0", {"drop_path_rate": 0.1}),
        ("swin_tiny_patch4_window7_224", {"drop_path_rate": 0.1}),
        ("deit_tiny_patch16_224", {"drop_path_rate": 0.1, "drop_rate": 0.1}),
        ("mixer_s16_224", {}),
        ("regnety_002", {}),
        ("resnet26d", {"drop_path_rate": 0.05}),
        ("mobilevitv2_050", {}),
        ("poolformer_s12", {}),
        ("levit_128s", {}),
        ("coatnet_nano_rw_224", {}),
        ("convnext_atto", {"drop_path_rate": 0.1}),
        # blocks in nn.ModuleList stacks (a CheckpointedForward each)
        ("pvt_v2_b0", {"drop_path_rate": 0.1}),
        ("eva02_tiny_patch14_224", {"drop_path_rate": 0.1}),
    ):
        size = (
            224
            if any(s in name for s in ("swin", "deit", "mixer", "levit", "coat", "eva"))
            else 96
        )
        build = functools.partial(
            timm.create_model, name, pretrained=False, num_classes=10, **extra
        )
        cases.append(
            (f"timm {name}", build, torch.randn(2, 3, size, size), _summed, "vision")
        )
    return cases


def _sample_loss(out: Any) -> torch.Tensor:
    """diffusers' outputs hold the prediction as ``sample``."""
    sample = out.sample if hasattr(out, "sample") else out[0]
    return sample.float().square().mean()


def diffusers_cases() -> list[Case]:
    import diffusers as D

    small = {"norm_num_groups": 8, "block_out_channels": (32, 64)}
    unet = functools.partial(
        D.UNet2DConditionModel, sample_size=16, in_channels=4, out_channels=4,
        layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, **small,
    )  # fmt: skip
    vae = functools.partial(
        D.AutoencoderKL, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, **small,
    )  # fmt: skip
    dit = functools.partial(
        D.DiTTransformer2DModel, num_attention_heads=2, attention_head_dim=8,
        in_channels=4, out_channels=4, num_layers=2, sample_size=8, patch_size=2,
        num_embeds_ada_norm=10, dropout=0.1,
    )  # fmt: skip
    sd3 = functools.partial(
        D.SD3Transformer2DModel, sample_size=8, patch_size=2, in_channels=4,
        num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
        out_channels=4,
    )  # fmt: skip
    flux = functools.partial(
        D.FluxTransformer2DModel, patch_size=1, in_channels=8, num_layers=2,
        num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    t2 = torch.tensor([10, 20])
    return [
        ("diffusers UNet2DConditionModel", unet, {"sample": torch.randn(2, 4, 16, 16),
         "timestep": t2, "encoder_hidden_states": torch.randn(2, 5, 32)},
         _sample_loss, "diffusers"),
        ("diffusers AutoencoderKL", vae, {"sample": torch.randn(2, 3, 32, 32),
         "sample_posterior": True}, _sample_loss, "diffusers"),
        ("diffusers DiTTransformer2DModel", dit, {"hidden_states": torch.randn(2, 4, 8, 8),
         "timestep": t2, "class_labels": torch.tensor([0, 3])}, _sample_loss, "diffusers"),
        ("diffusers SD3Transformer2DModel", sd3, {"hidden_states": torch.randn(2, 4, 8, 8),
         "encoder_hidden_states": torch.randn(2, 5, 16),
         "pooled_projections": torch.randn(2, 8), "timestep": t2}, _sample_loss,
         "diffusers"),
        ("diffusers FluxTransformer2DModel", flux, {"hidden_states": torch.randn(1, 16, 8),
         "encoder_hidden_states": torch.randn(1, 4, 16),
         "pooled_projections": torch.randn(1, 8), "timestep": torch.tensor([1.0]),
         "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(4, 3)}, _sample_loss,
         "diffusers"),
    ]  # fmt: skip


def _loss_of(out: Any) -> torch.Tensor:
    """An HF model's loss (computed from the labels it was given)."""
    return out.loss.float()  # type: ignore[no-any-return]


def _logits_summed(out: Any) -> torch.Tensor:
    return out.logits.float().sum()  # type: ignore[no-any-return]


def transformers_cases() -> list[Case]:
    import transformers as T

    ids = torch.randint(0, 128, (2, 32))
    small = {
        "num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 64,
    }  # fmt: skip
    bert_like = {
        "num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
    }  # fmt: skip
    specs: list[tuple[str, str, str, dict[str, Any], bool]] = [
        # name, config class, model class, config, loss from labels
        ("bert", "BertConfig", "BertForMaskedLM", bert_like, False),
        ("roberta", "RobertaConfig", "RobertaForMaskedLM", bert_like, False),
        ("electra", "ElectraConfig", "ElectraForMaskedLM", {**bert_like, "embedding_size": 32}, False),
        ("deberta_v2", "DebertaV2Config", "DebertaV2ForMaskedLM", bert_like, False),
        ("distilbert", "DistilBertConfig", "DistilBertForMaskedLM",
         {"n_layers": 3, "dim": 32, "hidden_dim": 64, "n_heads": 2, "vocab_size": 128,
          "max_position_embeddings": 64}, False),
        ("gpt2", "GPT2Config", "GPT2LMHeadModel",
         {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64}, False),
        ("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
         {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64}, False),
        ("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {**bert_like}, False),
        ("opt", "OPTConfig", "OPTForCausalLM",
         {"num_hidden_layers": 3, "hidden_size": 32, "ffn_dim": 64, "num_attention_heads": 2,
          "vocab_size": 128, "max_position_embeddings": 64, "word_embed_proj_dim": 32}, False),
        ("falcon", "FalconConfig", "FalconForCausalLM",
         {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 128}, False),
        ("llama", "LlamaConfig", "LlamaForCausalLM", small, False),
        ("mistral", "MistralConfig", "MistralForCausalLM", small, False),
        ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", small, False),
        ("phi3", "Phi3Config", "Phi3ForCausalLM", {**small, "pad_token_id": 0}, False),
        ("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {**small, "head_dim": 8}, False),
        ("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", {**small, "head_dim": 8}, False),
        ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", small, False),
        ("mixtral (MoE)", "MixtralConfig", "MixtralForCausalLM",
         {**small, "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.1}, False),
        ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         {**small, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "head_dim": 8}, False),
        ("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
         {**small, "num_local_experts": 4, "num_experts_per_tok": 2}, False),
        ("jamba (hybrid)", "JambaConfig", "JambaForCausalLM",
         {**small, "num_hidden_layers": 4, "num_experts": 2, "num_experts_per_tok": 1,
          "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
          "expert_layer_offset": 1, "mamba_d_state": 4, "use_mamba_kernels": False}, False),
        ("mamba", "MambaConfig", "MambaForCausalLM",
         {"num_hidden_layers": 3, "hidden_size": 32, "state_size": 8, "vocab_size": 128}, False),
        ("t5", "T5Config", "T5ForConditionalGeneration",
         {"num_layers": 2, "num_decoder_layers": 2, "d_model": 32, "d_ff": 64, "num_heads": 2,
          "d_kv": 16, "vocab_size": 128, "decoder_start_token_id": 0}, True),
        ("bart", "BartConfig", "BartForConditionalGeneration",
         {"encoder_layers": 2, "decoder_layers": 2, "d_model": 32, "encoder_ffn_dim": 64,
          "decoder_ffn_dim": 64, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
          "vocab_size": 128, "max_position_embeddings": 64}, True),
    ]  # fmt: skip
    cases: list[Case] = []
    for name, config_class, model_class, settings, seq2seq in specs:
        if not hasattr(T, config_class) or not hasattr(T, model_class):
            continue  # an older transformers without this family
        config = getattr(T, config_class)(**settings)
        for attr in (  # dropout on wherever the family has it
            "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout_rate",
            "dropout", "attention_dropout", "hidden_dropout", "resid_pdrop",
            "embd_pdrop", "attn_pdrop",
        ):  # fmt: skip
            if hasattr(config, attr):
                setattr(config, attr, 0.1)
        inputs: dict[str, Any] = {"input_ids": ids}
        if seq2seq:
            inputs["labels"] = ids
        if seq2seq or "Causal" in model_class or "LMHead" in model_class:
            # a plain run with the cache computes differently (HF turns the
            # cache off under checkpointing): compare like with like
            inputs["use_cache"] = False
        loss = _loss_of if seq2seq else _logits_summed
        build = functools.partial(getattr(T, model_class), config)
        cases.append((f"transformers {name}", build, inputs, loss, "hf"))
    return cases + _transformers_other_inputs(T)


def _transformers_other_inputs(T: Any) -> list[Case]:
    """HF models fed images or audio features: ViT, Swin with stochastic depth
    (an out-of-place torch.rand in every block, then dropout) and Whisper."""
    images = {"pixel_values": torch.randn(2, 3, 32, 32)}
    vision = {"image_size": 32, "num_labels": 3, "hidden_dropout_prob": 0.1,
              "attention_probs_dropout_prob": 0.1}  # fmt: skip
    whisper = {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2,
        "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_mel_bins": 16,
        "max_source_positions": 20, "max_target_positions": 32, "vocab_size": 100,
        "decoder_start_token_id": 1, "pad_token_id": 0, "eos_token_id": 2,
        "bos_token_id": 1, "dropout": 0.1, "attention_dropout": 0.1,
    }  # fmt: skip
    specs: list[tuple[str, str, str, dict[str, Any], dict[str, Any], str]] = [
        ("vit", "ViTConfig", "ViTForImageClassification",
         {**vision, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 64, "patch_size": 8}, images, "logits"),
        ("swin (drop_path)", "SwinConfig", "SwinForImageClassification",
         {**vision, "patch_size": 2, "embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2],
          "window_size": 4, "drop_path_rate": 0.1}, images, "logits"),
        ("whisper", "WhisperConfig", "WhisperForConditionalGeneration", whisper,
         {"input_features": torch.randn(2, 16, 40), "use_cache": False,
          "labels": torch.randint(3, 100, (2, 8))}, "loss"),
    ]  # fmt: skip
    cases: list[Case] = []
    for name, config_class, model_class, settings, inputs, out in specs:
        if not hasattr(T, config_class) or not hasattr(T, model_class):
            continue
        build = functools.partial(
            getattr(T, model_class), getattr(T, config_class)(**settings)
        )
        loss = _loss_of if out == "loss" else _logits_summed
        cases.append((f"transformers {name}", build, inputs, loss, "hf"))
    return cases + _vision_language(T)


def _vision_language(T: Any) -> list[Case]:
    """Vision-language models (a vision tower and a language model, both
    checkpointed by HF's switch): Qwen2.5-VL (windowed vision blocks given
    ``cu_seqlens``), LLaVA (CLIP and Llama) and PaliGemma (SigLIP and Gemma).
    Four image tokens per sequence stand where the image goes."""
    if not all(
        hasattr(T, name)
        for name in ("Qwen2_5_VLConfig", "LlavaConfig", "PaliGemmaConfig")
    ):
        return []
    text = {
        "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_dropout": 0.1,
    }  # fmt: skip
    tower = {
        "image_size": 28, "patch_size": 14, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "attention_dropout": 0.1,
    }  # fmt: skip
    prompt = torch.randint(3, 100, (2, 16))
    ids = prompt.clone()
    ids[:, 2:6] = 150  # the image tokens
    qwen = T.Qwen2_5_VLConfig(
        text_config={
            **text,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "patch_size": 14, "temporal_patch_size": 2,
            "spatial_merge_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
        },
        image_token_id=150, video_token_id=151, vision_start_token_id=152,
        vision_end_token_id=153,
    )  # fmt: skip
    qwen_ids = ids.clone()
    qwen_ids[:, 1], qwen_ids[:, 6] = 152, 153  # vision start and end around them
    llava = T.LlavaConfig(
        text_config={**text, "model_type": "llama"},
        vision_config={**tower, "model_type": "clip_vision_model", "projection_dim": 32},
        image_token_id=150, vision_feature_layer=-1,
    )  # fmt: skip
    paligemma = T.PaliGemmaConfig(
        text_config={**text, "model_type": "gemma", "num_key_value_heads": 1, "head_dim": 16},
        vision_config={**tower, "model_type": "siglip_vision_model"},
        image_token_id=150, projection_dim=64,
    )  # fmt: skip
    pali_ids = prompt.clone()
    pali_ids[:, :4] = 150  # the image first, then the prompt
    images = torch.randn(2, 3, 28, 28)
    return [
        ("transformers qwen2_5_vl", functools.partial(
            T.Qwen2_5_VLForConditionalGeneration, qwen),
         {"input_ids": qwen_ids, "labels": qwen_ids,
          # a 4 x 4 grid of patches per image, 2 x 2 merged: four tokens
          "pixel_values": torch.randn(32, 3 * 2 * 14 * 14),
          "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]])}, _loss_of, "hf"),
        ("transformers llava", functools.partial(
            T.LlavaForConditionalGeneration, llava),
         {"input_ids": ids, "pixel_values": images, "labels": ids}, _loss_of, "hf"),
        ("transformers paligemma", functools.partial(
            T.PaliGemmaForConditionalGeneration, paligemma),
         {"input_ids": pali_ids, "pixel_values": images, "labels": pali_ids,
          "token_type_ids": (torch.arange(16) >= 8).long().expand(2, 16)},
         _loss_of, "hf"),
    ]  # fmt: skip


def peft_cases() -> list[Case]:
    """PEFT adapters on a small Llama whose base weights are frozen (only the
    adapters train): LoRA with dropout, DoRA, IA3 and LoHa with module and rank
    dropout. HF's switch is reached through the PeftModel."""
    import peft
    import transformers as T

    config = T.LlamaConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        max_position_embeddings=64, attention_dropout=0.1,
    )  # fmt: skip
    ids = torch.randint(0, 128, (2, 16))
    adapters = {
        "lora": lambda: peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
        "dora": lambda: peft.LoraConfig(
            r=4, lora_dropout=0.1, use_dora=True, target_modules=["q_proj", "v_proj"]
        ),
        "ia3": lambda: peft.IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"],
            feedforward_modules=["down_proj"],
        ),
        "loha": lambda: peft.LoHaConfig(
            r=4, module_dropout=0.1, rank_dropout=0.1, target_modules=["q_proj", "v_proj"]
        ),
    }  # fmt: skip

    def build(adapter: Callable[[], Any]) -> nn.Module:
        model: nn.Module = peft.get_peft_model(T.LlamaForCausalLM(config), adapter())
        return model

    return [
        (
            f"peft {name} (llama)",
            functools.partial(build, adapter),
            {"input_ids": ids, "labels": ids, "use_cache": False},
            _loss_of,
            "hf",
        )
        for name, adapter in adapters.items()
    ]


def open_clip_cases() -> list[Case]:
    """An open_clip CLIP (ViT image tower with patch dropout, text
    transformer) trained one step on its contrastive loss."""
    import open_clip

    vision = {
        "image_size": 32, "layers": 2, "width": 64, "head_width": 32,
        "patch_size": 8, "mlp_ratio": 2.0, "patch_dropout": 0.25,
    }  # fmt: skip
    text = {
        "context_length": 16,
        "vocab_size": 100,
        "width": 64,
        "heads": 2,
        "layers": 2,
    }
    build = functools.partial(
        _Contrastive,
        functools.partial(open_clip.CLIP, 32, vision, text, output_dict=True),
        torch.randn(2, 3, 32, 32),
        torch.randint(0, 100, (2, 16)),
    )
    return [("open_clip CLIP", build, torch.empty(0), _summed, "vision")]


class _Contrastive(nn.Module):
    """A CLIP-style model with its images and texts fixed, its loss out."""

    def __init__(self, build: Callable[[], nn.Module], images: Any, texts: Any) -> None:
        import open_clip

        super().__init__()
        self.model = build()
        self.images, self.texts = images, texts
        self.loss = open_clip.ClipLoss()

    def forward(self, _: torch.Tensor) -> Any:
        out = self.model(self.images, self.texts)
        return self.loss(
            out["image_features"], out["text_features"], out["logit_scale"]
        )


class UnderReplacement(nn.Module):
    """A model whose own code calls torch's checkpoint (timm's
    ``set_grad_checkpointing()``), run inside ``seqckpt.replace_torch_checkpoint``
    with the sweep's options, so those calls are seqckpt's."""

    def __init__(self, model: nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.options = options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with seqckpt.replace_torch_checkpoint(**self.options):
            return self.model(*args, **kwargs)


def checkpoint_vision(model: nn.Module, options: dict[str, Any]) -> nn.Module:
    """``checkpoint_blocks``; where it finds no stack of repeated blocks and
    says so (VGG's ``features`` mix single layers), the ``features`` trunk as
    one ``CheckpointedSequential``, as its warning suggests; failing that, a
    timm model's own ``set_grad_checkpointing()`` under
    ``replace_torch_checkpoint``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seqckpt.checkpoint_blocks(model, **options)
    none_found = any("found no stack" in str(w.message) for w in caught)
    features = getattr(model, "features", None)
    if none_found and isinstance(features, nn.Sequential):
        model.features = seqckpt.CheckpointedSequential.from_sequential(
            features, **options
        )
    elif none_found and hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
        return UnderReplacement(model, options)
    elif none_found:
        print(f"  ({type(model).__name__}: nothing found to checkpoint)")
    return model


def convert(
    kind: str, options: dict[str, Any], hf_route: str = "function"
) -> Callable[[nn.Module], nn.Module]:
    if kind == "vision":
        return lambda model: checkpoint_vision(model, options)
    if hf_route == "blocks":  # public API only: each layer of the ModuleList
        return lambda model: seqckpt.checkpoint_blocks(model, **options)
    if kind == "diffusers":  # diffusers' own checkpointing, with seqckpt's function
        return lambda model: _diffusers_own(model, options)
    return lambda model: use_seqckpt(model, **options)


def _diffusers_own(model: nn.Module, options: dict[str, Any]) -> nn.Module:
    enable: Any = model.enable_gradient_checkpointing  # type: ignore[operator]
    enable(gradient_checkpointing_func=functools.partial(seqckpt.checkpoint, **options))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policies", default="none", help=f"comma-separated, of {', '.join(POLICIES)}"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated parts of model names"
    )
    parser.add_argument(
        "--hf-route",
        choices=("function", "blocks"),
        default="function",
        help="HF transformers and diffusers models: seqckpt as their checkpoint "
        "function, or seqckpt.checkpoint_blocks on the model (their own "
        "checkpointing off)",
    )
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        parser.error(
            f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}"
        )
    only = [w for w in args.only.split(",") if w]
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cases: list[Case] = []
    for package, make in (
        ("torchvision", torchvision_cases),
        ("timm", timm_cases),
        ("transformers", transformers_cases),
        ("diffusers", diffusers_cases),
        ("peft", peft_cases),
        ("open_clip", open_clip_cases),
    ):
        if importlib.util.find_spec(package) is None:
            print(f"{package}: not installed, skipped")
            continue
        cases += make()
    failed = 0
    for name, build, inputs, loss, kind in cases:
        if only and not any(w in name for w in only):
            continue
        for policy in chosen:
            started = time.perf_counter()
            try:
                plain, ckpt = compare(
                    build, inputs, convert(kind, POLICIES[policy], args.hf_route), loss
                )
            except Exception as error:  # reported per model; the sweep goes on
                failed += 1
                print(f"{name:<48} {policy:<14} FAILED {type(error).__name__}: {error}")
                continue
            print(
                f"{name:<48} {policy:<14} bitwise equal, peak {plain / 2**20:6.2f} -> "
                f"{ckpt / 2**20:6.2f} MiB ({time.perf_counter() - started:4.1f} s)",
                flush=True,
            )
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

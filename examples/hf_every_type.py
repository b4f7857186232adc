"""Every model type the installed HF transformers offers for causal and masked
language modelling, sequence-to-sequence language modelling, image
classification, speech recognition (CTC) and audio classification, each at
one generic small config, trained one step plainly and one step through HF's
own checkpointing switch with seqckpt's function, and compared bitwise
(outputs, every gradient, every buffer; ``real_models.compare``). The same
switch with torch's checkpoint is run beside it, and its verdict printed for
reference.

A model whose switch does not reach HF's per-layer function (``TimmWrapper``
hands it to timm's ``set_grad_checkpointing()``, which calls torch's
checkpoint itself) runs under ``seqckpt.replace_torch_checkpoint`` instead.

Each model runs in a process of its own, with a memory cap and a time limit,
so a type that cannot be built or trained at the small config (many need
settings the generic one does not give) is counted as skipped, with the
reason, and the sweep goes on. Dropout stays on (training mode). Not in CI.

Usage (with transformers installed)::

    python examples/hf_every_type.py                      # every task, default policy
    python examples/hf_every_type.py --policies none,compute_heavy,values
    python examples/hf_every_type.py --task image-classification --only vit,swin
    python examples/hf_every_type.py --policies keep_attention   # seqckpt.keep

Exits 1 if any model that trains plainly fails with seqckpt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

import seqckpt

sys.path.insert(0, str(Path(__file__).parent))
from model_sweep import POLICIES, UnderReplacement  # noqa: E402
from real_models import compare, use_seqckpt  # noqa: E402

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
}
# One small value per size setting, applied wherever a config has an integer
# attribute of that name (and in its text config or decoder).
SMALL = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 2),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embedding_size"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "hidden_dim"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16), "word_embed_proj_dim": 32,
    **dict.fromkeys(("head_dim", "qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "v_head_dim": 8, "num_key_value_heads": 2, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "vocab_size": 128, "max_position_embeddings": 64,
    "n_positions": 64, "rotary_dim": 4, "image_size": 32, "patch_size": 4,
    "window_size": 4, "num_labels": 3,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
}  # fmt: skip
MEMORY_CAP = 8 * 2**30


def shrink(config: Any) -> Any:
    """Set every size the config has to the small one; cut per-layer lists
    to the layer count. Settings a config refuses are left as they are."""
    for key, value in SMALL.items():
        current = getattr(config, key, None)
        if isinstance(current, int) and not isinstance(current, bool):
            _try_set(config, key, value)
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention
        _try_set(
            config, "num_key_value_heads", getattr(config, "num_attention_heads", 4)
        )
    layers = getattr(config, "num_hidden_layers", 2)
    for key in ("layer_types", "layers_block_type", "block_types"):
        current = getattr(config, key, None)
        if isinstance(current, list):
            _try_set(config, key, current[:layers])
    for key in ("text_config", "decoder"):
        sub = getattr(config, key, None)
        if hasattr(sub, "to_dict"):
            shrink(sub)
    return config


def _try_set(config: Any, key: str, value: Any) -> None:
    # (a derived property or a validated field is left as it is)
    with contextlib.suppress(
        AttributeError, TypeError, ValueError, NotImplementedError
    ):
        setattr(config, key, value)


def _case(task: str, name: str) -> tuple[Callable[[], nn.Module], dict[str, Any]]:
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    config = shrink(configuration_auto.CONFIG_MAPPING[name]())
    model_class = getattr(transformers, getattr(modeling_auto, TASKS[task])[name])
    ids = torch.randint(3, 100, (2, 16))
    inputs: dict[str, Any]
    if task == "causal-lm":
        inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    elif task == "masked-lm":
        inputs = {"input_ids": ids, "labels": ids}
    elif task == "seq2seq-lm":  # (the decoder's inputs are made from the labels)
        if getattr(config, "decoder_start_token_id", None) is None:
            _try_set(config, "decoder_start_token_id", SMALL["decoder_start_token_id"])
        labels = torch.randint(3, 100, (2, 8))
        inputs = {"input_ids": ids, "labels": labels, "use_cache": False}
    elif task in ("ctc", "audio-classification"):  # 1 s of 16 kHz audio
        labels = torch.randint(3, 10, (2, 3)) if task == "ctc" else torch.tensor([0, 1])
        inputs = {"input_values": torch.randn(2, 16000), "labels": labels}
    else:
        size = getattr(config, "image_size", 32)
        side = min(size, 64) if isinstance(size, int) else 32  # (some give a pair)
        channels = getattr(config, "num_channels", 3)
        channels = channels if isinstance(channels, int) else 3
        inputs = {
            "pixel_values": torch.randn(2, channels, side, side),
            "labels": torch.tensor([0, 1]),
        }
    return (lambda: model_class(config)), inputs


def _torch_switch(model: nn.Module) -> nn.Module:
    model.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    return model


# Not a policy: every attention module kept whole in its layer's region
# (seqckpt.keep), the rest of the layer recomputed.
KEEP_ATTENTION = "keep_attention"


def keep_attention(model: nn.Module) -> int:
    """Give every outermost module whose class name ends in ``Attention`` a
    :class:`seqckpt.KeptForward`; returns how many."""
    kept: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and not any(
            module in set(k.modules()) for k in kept
        ):
            module.forward = seqckpt.KeptForward(module)  # type: ignore[method-assign]
            kept.append(module)
    KEPT.append(len(kept))
    return len(kept)


KEPT: list[int] = []  # how many keep_attention kept, per model it was given


def _seqckpt_switch(
    options: dict[str, Any], keep: bool = False
) -> Callable[[nn.Module], nn.Module]:
    def switch(model: nn.Module) -> nn.Module:
        if keep:
            keep_attention(model)
        use_seqckpt(model, **options)
        if not any(
            getattr(m, "gradient_checkpointing", False) for m in model.modules()
        ):
            return UnderReplacement(model, options)  # the switch is the model's own
        return model

    return switch


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def run_one(task: str, name: str, policy: str) -> dict[str, Any]:
    """One model under one policy, in this process: a dict for the report."""
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    result: dict[str, Any] = {"task": task, "name": name, "policy": policy}
    try:
        build, inputs = _case(task, name)
        torch.manual_seed(0)
        model = build().train()
        if not model.supports_gradient_checkpointing:
            return {**result, "status": "skipped", "why": "no gradient checkpointing"}
        _loss(model(**inputs)).backward()  # trains plainly at this config?
    except Exception as error:  # the generic config does not suit this type
        return {
            **result,
            "status": "skipped",
            "why": f"{type(error).__name__}: {error}",
        }
    try:
        compare(build, inputs, _torch_switch, _loss)
        result["torch"] = "bitwise"
    except Exception as error:  # torch's verdict is reported, not judged
        result["torch"] = f"{type(error).__name__}: {error}"
    try:
        keep = policy == KEEP_ATTENTION
        switch = _seqckpt_switch({} if keep else POLICIES[policy], keep)
        plain, checkpointed = compare(build, inputs, switch, _loss)
    except Exception as error:
        why = f"{type(error).__name__}: {error}"
        if isinstance(error, MemoryError) or "can't allocate memory" in why:
            return {**result, "status": "skipped", "why": f"over the memory cap: {why}"}
        return {**result, "status": "FAILED", "why": why}
    if KEPT:
        result["kept"] = KEPT[-1]
    return {**result, "status": "bitwise", "peaks": [plain, checkpointed]}


def _in_a_process(task: str, name: str, policy: str, timeout: float) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", task, name, policy]
    result = {"task": task, "name": name, "policy": policy, "status": "skipped"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**result, "why": f"over {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**result, "why": f"process ended ({done.returncode}): {last}"}
    parsed: dict[str, Any] = json.loads(lines[-1])
    return parsed


def _report(r: dict[str, Any]) -> str:
    head = f"{r['task']:<20} {r['name']:<28} {r['policy']:<14}"
    if r["status"] == "bitwise":
        plain, ckpt = r["peaks"]
        torch_word = "bitwise" if r["torch"] == "bitwise" else f"DIFFERS ({r['torch']})"
        kept = f" ({r['kept']} attention modules kept)" if "kept" in r else ""
        return (
            f"{head} bitwise equal, peak {plain / 2**20:6.2f} -> {ckpt / 2**20:6.2f} "
            f"MiB{kept}; torch's checkpoint: {torch_word}"
        )
    return f"{head} {r['status']}: {' '.join(r['why'].split())[:160]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=",".join(TASKS), help="comma-separated")
    parser.add_argument(
        "--policies",
        default="none",
        help=f"of {', '.join(POLICIES)}, or {KEEP_ATTENTION} (attention kept whole)",
    )
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--jobs", type=int, default=2, help="processes at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="s per model")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child process: one model, memory capped
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
        print(json.dumps(run_one(*args.one)))
        return 0
    from transformers.models.auto import modeling_auto

    tasks = [t for t in args.task.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    for word, chosen, known in (
        ("--task", tasks, TASKS),
        ("--policies", policies, [*POLICIES, KEEP_ATTENTION]),
    ):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"{word}: unknown {unknown}; choose from {', '.join(known)}")
    only = {w for w in args.only.split(",") if w}
    runs = [
        (task, name, policy)
        for task in tasks
        for name in getattr(modeling_auto, TASKS[task])
        if not only or name in only
        for policy in policies
    ]
    counts: Counter[tuple[str, str]] = Counter()
    torch_differs: list[str] = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for r in pool.map(lambda run: _in_a_process(*run, args.timeout), runs):
            print(_report(r), flush=True)
            counts[r["task"], r["status"]] += 1
            if r["status"] == "bitwise" and r["torch"] != "bitwise":
                torch_differs.append(f"{r['name']} ({r['policy']})")
    for task in tasks:
        print(
            f"{task}: {counts[task, 'bitwise']} bitwise, {counts[task, 'FAILED']} "
            f"failed, {counts[task, 'skipped']} skipped"
        )
    if torch_differs:
        print(
            f"torch's checkpoint differs from the plain run: {', '.join(torch_differs)}"
        )
    return 1 if any(status == "FAILED" for _, status in counts) else 0


if __name__ == "__main__":
    sys.exit(main())

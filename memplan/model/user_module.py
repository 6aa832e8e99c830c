"""The user's own nn.Module (a factory ``pkg.module:callable``) in a training step, the same way for the traced
step (under FakeTensorMode, memplan/activations/tracing/step.py) and for the harness's real ranks (memplan/harness/): built
in the step's dtype, fed by its input builder (or token ids when it starts with an embedding), its loss taken as
a training script takes it, and its blocks (the FSDP / ZeRO-3 units: the inventory's rule, meta_builder.py
_block_names) checkpointed for --recompute full with torch.utils.checkpoint (non-reentrant, as transformers'
gradient_checkpointing_enable)."""

from __future__ import annotations

from typing import Any, Callable

from memplan.errors import SettingsError
from memplan.inputs import quote


def is_user_module(config: dict[str, Any]) -> bool:
    return bool(config.get("factory"))


def build(config: dict[str, Any], batch: int, seq: int, dtype: str, recompute: str) -> tuple[Any, list[Any],
                                                                                            Callable[[Any], Any]]:
    """(model, its blocks, run(model) -> loss), under the caller's device context (FakeTensorMode in a trace)."""
    import torch

    from memplan.activations import is_checkpointed
    from memplan.model.meta_builder import call_factory

    # the parameters made in the trace's dtype, as from_config(dtype=...) makes transformers' (the default dtype
    # set around the factory's call; a module cast afterwards cannot swap fake parameters)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model, make_inputs = call_factory(config["factory"])
    finally:
        torch.set_default_dtype(before)
    blocks = blocks_of(model)
    for i, blk in enumerate(blocks):
        if is_checkpointed(recompute, i):  # full, every:N, layer-sac:N, op-sac
            checkpointed(blk, recompute)
    # floating inputs in the parameters' dtype (what a bf16 job feeds a bf16 model)
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        inputs = inputs_for(config["factory"], model, make_inputs, batch, seq)
    finally:
        torch.set_default_dtype(before)

    def run(m: Any) -> Any:
        out = m(**inputs) if isinstance(inputs, dict) else m(*inputs)
        return loss_of(out)

    return model, blocks, run


def checkpointed(block: Any, recompute: str = "full") -> None:
    """The block's forward in a non-reentrant checkpoint (with torchtitan's per-op policy for op-sac)."""
    from torch.utils.checkpoint import checkpoint

    from memplan.activations import OP_SAC

    forward = block.forward
    extra: dict[str, Any] = {}
    if recompute == OP_SAC:
        from memplan.model.meta_builder import op_sac_context_fn

        extra["context_fn"] = op_sac_context_fn()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = wrapped


def blocks_of(model: Any) -> list[Any]:
    from memplan.model.meta_builder import _block_names

    names = _block_names(model)
    return [m for n, m in model.named_modules() if n in names]


def inputs_for(spec: str, model: Any, make_inputs: Any, batch: int, seq: int, device: Any = None) -> Any:
    """The forward's inputs: the builder's (moved to ``device``), else token ids for a module that starts with
    an embedding (random ids below its vocabulary on a real device, zeros in a trace)."""
    import torch

    if make_inputs is not None:
        x = make_inputs(batch, seq)
        move = (lambda t: t.to(device) if device is not None and isinstance(t, torch.Tensor) else t)  # noqa: E731
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return tuple(move(t) for t in x) if isinstance(x, tuple) else (move(x),)
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if emb is not None:
        if device is None:
            return (torch.zeros(batch, seq, dtype=torch.long),)
        return (torch.randint(0, emb.num_embeddings, (batch, seq), generator=torch.Generator().manual_seed(1234)
                              ).to(device),)
    raise SettingsError(f"factory {quote(spec)}: memplan cannot guess this model's inputs; return (module, "
                        "lambda batch, seq: inputs) from the factory")


def loss_of(out: Any) -> Any:
    """The loss a training script takes from the output: its ``loss``; else a scalar output; else cross-entropy
    over the last dimension in fp32 (a language model's or a classifier's loss, upcast as transformers' loss
    functions upcast the logits); else the sum."""
    import torch
    import torch.nn.functional as F

    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, dict):
        out = out.get("loss") if out.get("loss") is not None else out.get("logits", next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise SettingsError(f"the model's output is a {type(out).__name__}, not a tensor memplan can take a loss of")
    if out.dim() == 0:
        return out
    if out.is_floating_point() and out.dim() >= 2:
        logits = out.float()
        target = torch.zeros(logits.shape[:-1], dtype=torch.long)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return out.float().sum()

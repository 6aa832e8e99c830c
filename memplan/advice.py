""""To fit" suggestions, computed: when a GPU size is given and the job does not fit, or fits with less than
HEADROOM_FRACTION of the GPU free, each single change a user can make is estimated on its own (the whole engine,
the caching allocator replayed) and those that fit are listed, cheapest first, with the bytes each saves.

Each change is the command's own options with that change applied (``job_with``; the CLI builds it: the
changed job's inventory and Settings), so a suggestion is exactly what `memplan estimate ... <its flags>` answers
(tested).

What each change costs, in the order listed (cheapest first):

1. sharding that keeps the parameters whole in compute (ZeRO-1 -> ZeRO-2, DDP -> FSDP SHARD_GRAD_OP): the
   gradients reduced, the parameters gathered once per step.
2. full sharding (ZeRO-3, FSDP FULL_SHARD): the parameters gathered in forward and again in backward.
   For both, and for every other change, the communication per optimizer step before and after is computed
   (memplan/comm.py: the framework's own collectives) and listed with the cost.
3. a smaller micro-batch with more gradient accumulation: the same global batch in more, smaller micro-steps
   (lower GPU utilisation per kernel; no change to the result).
4. selective recomputation: the attention core recomputed in backward (Korthikanti et al. 2022: 2-4% more
   compute at these sizes).
   Mixed precision where the job trains in fp32 (torch.autocast, DeepSpeed's or FSDP's bf16 with fp32 weights
   kept): bf16 matmuls, the weights' numerics as before.
5. 8-bit optimizer states (bitsandbytes' block-wise quantised Adam): the optimizer's numerics change. So do
   pure bf16 (model.to(bfloat16): weights, gradients and optimizer states in bf16, no fp32 copy, as
   fine-tuning recipes load a model) and, for a LoRA job, QLoRA (the frozen base stored 4-bit by bitsandbytes,
   packed into the recipe's parameter dtype where the framework shards it: bnb_4bit_quant_storage); the
   inventory is the changed job's own (memplan.model.lora.apply quantizes the base).
6. full recomputation: every block's forward again in backward, about 33% more compute (one forward is about a
   third of a step's FLOPs).
7. offload to the host (DeepSpeed ZeRO-Offload, FSDP CPUOffloadPolicy): the optimizer step runs on the CPU and
   gradients and weights cross PCIe every step; typically the slowest step of these.
8. more GPUs (sharded strategies only: replicated states do not shrink with the count): more hardware.

Not modelled, so never suggested: a chunked or fused cross-entropy (Liger's fused linear cross-entropy keeps a
chunk of the logits instead of all of them); with a large vocabulary the fp32 logits are often the largest
activation (--explain shows their share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import MemplanError

#: below this share of the GPU left free, a fitting job gets suggestions too
HEADROOM_FRACTION = 0.10


@dataclass(frozen=True)
class Change:
    label: str  #: what changes, as a person says it
    flags: tuple[str, ...]  #: the command-line flags that make it
    changes: dict[str, Any] = field(hash=False)  #: the command's options it sets
    cost: str
    rank: int  #: the cost's order (module docstring)


def reason(plan: Any) -> str | None:
    """Why suggestions are wanted: the job does not fit, or fits tightly; None: no GPU given, or room enough."""
    if plan.fits is None:
        return None
    if not plan.fits:
        return "does not fit"
    cap = plan.settings.cluster.gpu_memory_bytes
    if plan.headroom_bytes < HEADROOM_FRACTION * cap:
        return f"headroom under {HEADROOM_FRACTION:.0%} of the GPU"
    return None


_SHARD = "parameters gathered in forward and in backward"
_SAME_COMM = "gradients reduced, parameters gathered once per step"


def _sharding(plan: Any) -> list[Change]:
    s = plan.settings
    st, gpus = s.strategy, s.cluster.gpus
    if gpus < 2:
        return []
    out = []
    if st.framework == "deepspeed":
        for stage in (2, 3):
            if st.zero_stage is not None and st.zero_stage < stage:
                out.append(Change(f"ZeRO-{stage}", ("--stage", str(stage)), {"stage": stage, "strategy": None},
                                  _SHARD if stage == 3 else _SAME_COMM, 2 if stage == 3 else 1))
    elif st.name in ("ddp", "zero-optimizer", "fsdp-no-shard", "fsdp-grad-op", "hsdp"):
        for name in ("fsdp-grad-op", "fsdp-full"):
            if name != st.name:
                full = name == "fsdp-full"
                out.append(Change(f"FSDP {name.removeprefix('fsdp-')}", ("--strategy", name),
                                  {"strategy": name, "stage": None},
                                  _SHARD if full else _SAME_COMM + ", kept unsharded from forward to backward",
                                  2 if full else 1))
        if st.name in ("ddp", "zero-optimizer"):
            out.append(Change("DeepSpeed ZeRO-3", ("--strategy", "zero3"), {"strategy": "zero3", "stage": None},
                              _SHARD, 2))
    return out


def _micro_batches(plan: Any) -> list[Change]:
    """Smaller micro-batches that keep the global batch: each divisor of the micro-batch, the largest first."""
    s = plan.settings
    b, ga = s.micro_batch, s.grad_accum
    out = []
    for d in sorted((d for d in range(1, b) if b % d == 0), reverse=True):
        k = b // d
        out.append(Change(f"micro-batch {d}, grad-accum {ga * k}", ("--micro-batch", str(d), "--grad-accum",
                                                                    str(ga * k)),
                          {"micro_batch": d, "grad_accum": ga * k},
                          f"same global batch, {k}x the micro-steps (less work per kernel)", 3))
    return out


def _recompute(plan: Any) -> list[Change]:
    rc = plan.settings.recompute
    out = []
    if rc == "none":
        out.append(Change("recompute selective", ("--recompute", "selective"), {"recompute": "selective"},
                          "attention core recomputed in backward (~2-4% more compute)", 4))
    if rc != "full":
        out.append(Change("recompute full", ("--recompute", "full"), {"recompute": "full"},
                          "~33% more compute (every block's forward again in backward)", 6))
    return out


def _optimizer(plan: Any) -> list[Change]:
    from memplan import frameworks

    s = plan.settings
    if s.optimizer.name not in ("adam", "adamw"):
        return []
    if frameworks.model(s.strategy.memory_model).shaped_optimizer_why_not:  # FSDP2's DTensors
        return []
    return [Change("8-bit Adam states", ("--optimizer", "adam8bit"), {"optimizer": "adam8bit"},
                   "bitsandbytes 8-bit Adam: the optimizer's numerics change", 5)]


#: each framework's mixed precision that keeps fp32 weights (or an fp32 master copy): offered to an fp32 job
_MIXED = {"deepspeed": "deepspeed-bf16", "fsdp2": "fsdp-bf16", "fsdp1": "fsdp-bf16"}


def _precision(plan: Any) -> list[Change]:
    """bf16 where the job keeps fp32: the framework's mixed precision (from fp32), then pure bf16 (anything that
    keeps fp32 weights or states). A recipe the framework refuses (pure bf16 under DeepSpeed, bf16 on a card
    without it) is dropped when it is estimated."""
    s = plan.settings
    rc, fw = s.recipe, s.strategy.framework
    out = []
    if rc.name == "fp32":
        mixed = _MIXED.get(fw, "torch-amp")
        out.append(Change(f"mixed precision ({mixed})", ("--precision", mixed), {"precision": mixed},
                          "bf16 matmuls and activations, fp32 weights kept (numerics close to fp32)", 4))
    if rc.name != "pure-bf16" and (rc.param_bytes == 4 or rc.master_bytes or rc.state_bytes == 4):
        out.append(Change("pure bf16", ("--precision", "pure-bf16"), {"precision": "pure-bf16"},
                          "weights, gradients and optimizer states in bf16, no fp32 copy: the updates lose "
                          "precision (fine-tuning recipes load models so; pre-training keeps fp32 weights)", 5))
    return out


def _quantize(plan: Any) -> list[Change]:
    """QLoRA for a LoRA job whose base is not quantized: NF4, packed into the recipe's parameter dtype where the
    framework shards it (FourBitBase.shards_packed: FSDP2, ZeRO-3), else uint8, bitsandbytes' default."""
    from memplan import frameworks

    s = plan.settings
    if s.lora is None or s.lora.quantize:
        return []
    flags: tuple[str, ...] = ("--quantize-base", "nf4")
    changes: dict[str, Any] = {"quantize_base": "nf4"}
    if frameworks.model(s.strategy.memory_model).four_bit.shards_packed:
        flags += ("--quant-storage", s.recipe.stored_dtype)
        changes["quant_storage"] = s.recipe.stored_dtype
    return [Change("QLoRA (the base stored 4-bit)", flags, changes,
                   "bitsandbytes NF4 base: dequantized in every forward and backward (slower), the frozen "
                   "weights' numerics change", 5)]


def _offload(plan: Any) -> list[Change]:
    s = plan.settings
    st = s.strategy
    cost = "optimizer step on the CPU, PCIe transfers every step (usually the slowest)"
    if st.framework == "deepspeed" and st.zero_stage:
        out = []
        if not s.ds.offload_optimizer:
            out.append(Change("offload the optimizer to the host", ("--offload-optimizer",),
                              {"offload_optimizer": True}, cost, 7))
        if st.zero_stage == 3 and not s.ds.offload_param:
            out.append(Change("offload the optimizer and the parameters to the host",
                              ("--offload-optimizer", "--offload-param"),
                              {"offload_optimizer": True, "offload_param": True}, cost, 7))
        return out
    if st.name in ("fsdp-full", "fsdp-grad-op", "hsdp") and not s.torch.cpu_offload:
        return [Change("FSDP CPU offload", ("--cpu-offload",), {"cpu_offload": True}, cost, 7)]
    if st.framework == "torch":  # DDP or one GPU: DeepSpeed's ZeRO-Offload runs on any count, one GPU included
        return [Change("DeepSpeed ZeRO-Offload (ZeRO-2, optimizer on the host)",
                       ("--strategy", "zero2", "--offload-optimizer"),
                       {"strategy": "zero2", "stage": None, "offload_optimizer": True}, cost, 7),
                Change("DeepSpeed ZeRO-3 with optimizer and parameters on the host",
                       ("--strategy", "zero3", "--offload-optimizer", "--offload-param"),
                       {"strategy": "zero3", "stage": None, "offload_optimizer": True, "offload_param": True},
                       cost, 7)]
    return []


def _model_parallel(plan: Any) -> list[Change]:
    """Twice the pipeline stages, or twice the tensor-parallel ranks within a node, on the same GPUs (the
    data-parallel size halves): where the strategy runs them (memplan/parallel/layout.py layout_of). Estimated only where
    their ranks' activation profiles are cached (``_trace`` False: a suggestion never imports torch to trace)."""
    from memplan import parallel as par

    s = plan.settings
    lay = getattr(plan, "layout", None)
    p = (lay.settings.parallel if lay is not None else s.parallel) or par.Parallel()
    try:
        par.layout_of(s.strategy, 2)
    except MemplanError:
        return []
    c, out = s.cluster, []
    blocks = plan.inventory.dims.get("num_layers") or 0
    if c.gpus % (p.model_ranks * 2) == 0 and p.pp * 2 <= blocks:
        ga = max(s.grad_accum, p.pp * 2)
        out.append(Change(f"{p.pp * 2} pipeline stages", ("--pp", str(p.pp * 2), "--grad-accum", str(ga)),
                          {"pp": p.pp * 2, "grad_accum": ga, "_trace": False},
                          "a pipeline bubble, stage outputs sent between nodes", 6))
    if c.gpus % (p.model_ranks * 2) == 0 and p.tp * 2 <= c.ranks_per_node:
        out.append(Change(f"tensor parallelism over {p.tp * 2} GPUs", ("--tp", str(p.tp * 2)),
                          {"tp": p.tp * 2, "_trace": False},
                          "four all-reduces of each block's activations per micro-batch within a node", 6))
    seq = lay.settings.seq_len if lay is not None else s.seq_len
    if p.ep == 1 and c.gpus % (p.model_ranks * p.cp * 2) == 0 and seq % (4 * p.cp) == 0 and s.attention != "eager" \
            and par.layout_of(s.strategy, 1) == par.TORCHTITAN:
        out.append(Change(f"context parallelism over {p.cp * 2} GPUs", ("--cp", str(p.cp * 2)),
                          {"cp": p.cp * 2, "_trace": False},
                          "each attention's keys and values all-gathered over the CP ranks (ring attention)", 6))
    return out


def _more_gpus(plan: Any) -> list[Change]:
    from memplan.settings import MAX_GPUS

    s = plan.settings
    st, gpus = s.strategy, s.cluster.gpus
    if st.one_gpu or not (st.shard_optimizer or st.zero_stage):
        return []
    out = []
    n = gpus * 2
    while n <= min(MAX_GPUS, gpus * 64):
        out.append(Change(f"{n} GPUs", ("--gpus", str(n)), {"gpus": n},
                          f"{n // gpus}x the GPUs (more hardware)", 8))
        n *= 2
    return out


#: the kinds of change, each with whether only its first fitting change is kept (the least change of its kind:
#: the largest micro-batch, the fewest GPUs, the least offloaded) or every one that fits
GROUPS: tuple[tuple[Callable[[Any], list[Change]], bool], ...] = (
    (_sharding, False), (_micro_batches, True), (_recompute, False), (_optimizer, True), (_precision, True),
    (_quantize, True), (_model_parallel, False), (_offload, True), (_more_gpus, True))


def suggest(plan: Any, job_with: Callable[[dict[str, Any]], tuple[Any, Any]],
            limit: int | None = None) -> dict[str, Any] | None:
    """The suggestions for ``plan`` (None when none are wanted): every single change that fits, cheapest first,
    with its required bytes, headroom and the bytes it saves; ``tried``: how many changes were estimated.
    ``job_with(changes)``: the job with those command-line options changed, as (inventory, Settings): the
    inventory is the job's own unless the change makes another model (QLoRA quantizes the base). ``limit``: what
    "fits" means instead of the GPU's capacity (memplan check --max-fraction)."""
    from types import SimpleNamespace

    from memplan import accounting
    from memplan.accounting import job_communication as communication
    from memplan.units import fmt_bytes

    if plan.layout is not None:  # the most loaded rank's plan: the changes apply to the job as given
        plan = SimpleNamespace(settings=plan.layout.settings, inventory=plan.layout.inventory, fits=plan.fits,
                               headroom_bytes=plan.headroom_bytes, required_bytes=plan.required_bytes)

    if limit is not None:
        why = "over the limit" if plan.fits is not None and plan.required_bytes > limit else None
    else:
        why = reason(plan)
    if why is None:
        return None
    out, tried = [], 0
    want_margin = plan.fits and limit is None  # a fitting job: a change must leave HEADROOM_FRACTION free
    cap = plan.settings.cluster.gpu_memory_bytes
    need = limit if limit is not None else cap - (HEADROOM_FRACTION * cap if want_margin else 0)
    inv = plan.inventory
    comm_now = communication(inv, plan.settings)["total_bytes"]
    valid: list[tuple[int, Change]] = []  # every change the job's options take, in GROUPS order

    replays = [0]

    def evaluate(ch: Change) -> dict[str, Any] | None:
        """The change's estimate where it fits (and saves), else None; MemplanError where the options refuse it."""
        inv_ch, s = job_with(ch.changes)
        # the bound from below first (no allocator replay): most changes that cannot fit stop here
        (_, low), = accounting.required_bytes(inv_ch, s, (s.micro_batch,), lower_bound=True)
        if low > need:
            return None
        replays[0] += 1
        new = accounting.estimate(inv_ch, s)
        ok = bool(new.fits) and new.host_fits is not False and new.required_bytes <= need
        if not ok or new.required_bytes >= plan.required_bytes:
            return None
        cost, comm_after = ch.cost, communication(inv_ch, s)["total_bytes"]
        if comm_after != comm_now:
            cost += f"; communication {fmt_bytes(comm_now)} -> {fmt_bytes(comm_after)} per step"
        return {"change": ch.label, "flags": list(ch.flags), "rank": ch.rank, "cost": cost,
                "required_bytes": new.required_bytes, "headroom_bytes": new.headroom_bytes,
                "saves_bytes": plan.required_bytes - new.required_bytes, "communication_bytes": comm_after}

    for gi, (group, first_only) in enumerate(GROUPS):
        for ch in group(plan):
            tried += 1
            try:
                got = evaluate(ch)
            except MemplanError:
                continue  # a change the rest of the job's options refuse (e.g. a knob of another framework)
            valid.append((gi, ch))
            if got is None:
                continue
            out.append(got)
            if first_only:
                break
    out.sort(key=lambda x: (x["rank"], -x["saves_bytes"]))
    combination = None
    if not out:
        combination, more = _combination(valid, evaluate, plan.settings.cluster.gpus, replays)
        tried += more
    return {"reason": why, "headroom_target_fraction": HEADROOM_FRACTION, "changes": out, "tried": tried,
            "combination": combination,
            "not_modelled": ["a chunked or fused cross-entropy (e.g. Liger's fused linear cross-entropy)"]}


#: the most combinations a search replays the allocator for (those the bound from below rules out cost nothing)
MAX_COMBINATIONS = 24


def _combination(valid: list[tuple[int, Change]], evaluate: Callable[[Change], dict[str, Any] | None],
                 gpus: int = 0, replays: list[int] | None = None) -> tuple[dict[str, Any] | None, int]:
    """Where no single change fits: the cheapest combination of two or three changes of different kinds that
    does, as one command. Cheapest, as the planner ranks: the fewest GPUs first, then the dearest change's cost
    (module docstring's order), then the sum of the costs, then fewer changes, then the order the kinds are listed
    in (the least change of a kind first: the largest micro-batch). Two changes that set one option differently
    are not combined."""
    from itertools import combinations

    def merged(chs: tuple[Change, ...]) -> Change | None:
        changes: dict[str, Any] = {}
        for ch in chs:
            for k, v in ch.changes.items():
                if k in changes and changes[k] != v:
                    return None
                changes[k] = v
        return Change(" + ".join(c.label for c in chs), flags_once([f for c in chs for f in c.flags]), changes,
                      "; ".join(c.cost for c in chs), max(c.rank for c in chs))

    combos = [c for size in (2, 3) for c in combinations(range(len(valid)), size)
              if len({valid[i][0] for i in c}) == size]  # one change of each kind

    def key(c: tuple[int, ...]) -> tuple:
        n = max((valid[i][1].changes.get("gpus") or gpus for i in c), default=gpus)
        return (n, max(valid[i][1].rank for i in c), sum(valid[i][1].rank for i in c), len(c), c)

    combos.sort(key=key)
    replays = replays if replays is not None else [0]
    start, tried = replays[0], 0
    for c in combos:
        ch = merged(tuple(valid[i][1] for i in c))
        if ch is None:
            continue
        tried += 1
        try:
            got = evaluate(ch)
        except MemplanError:
            continue
        if got is not None:
            return got, tried
        if replays[0] - start >= MAX_COMBINATIONS:  # the allocator replayed this many times: stop
            break
    return None, tried


def flags_once(flags: list[str]) -> tuple[str, ...]:
    """Command-line flags with each option once: two changes of a combination that set the same option set it to
    the same value (merged() refuses the others), e.g. a smaller micro-batch's --grad-accum and more pipeline
    stages' own."""
    groups: list[tuple[str, ...]] = []
    for f in flags:
        if f.startswith("--") or not groups:
            groups.append((f,))
        else:
            groups[-1] = groups[-1] + (f,)
    seen: set[tuple[str, ...]] = set()
    out: list[str] = []
    for g in groups:
        if g not in seen:
            seen.add(g)
            out.extend(g)
    return tuple(out)

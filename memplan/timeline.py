"""The named moments of a training step, and the typed timeline each framework's buffer model returns.

A framework's buffer model (memplan/frameworks/) says what its buffers and its not-yet-reduced gradients hold at
named moments of the step; the activation profile (memplan/activations/profile.py) says what is saved at the same
moments; the engine (memplan/accounting.py) adds model states and takes the largest. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


#: what a rank holds, by category (the Plan's per-phase fields, the JSON's per_gpu keys), with their names
CATEGORIES: dict[str, str] = {"weights_bytes": "weights", "master_weights_bytes": "master weights",
                              "grads_bytes": "gradients", "optimizer_states_bytes": "optimizer states",
                              "activations_bytes": "activations", "buffers_bytes": "buffers"}
CATEGORY_KEYS = tuple(CATEGORIES)


class Moment(IntEnum):
    """Where in the step a moment falls, which fixes the activations alive then (profile.moment_activations;
    without a traced timeline, the bound that contains the moment). Values are the profile's own keys."""

    #: inside a block's backward, its own gradients growing while its activations are freed
    #: (profile.block_moments: the last block, the one before it, the first, the second)
    INSIDE_LAST_BLOCK_BACKWARD = 0
    INSIDE_PREVIOUS_BLOCK_BACKWARD = 1
    INSIDE_FIRST_BLOCK_BACKWARD = 2
    #: inside the second block's backward (index 1): one block's activations saved below it, every later block's
    #: gradients reduced, the first block prefetched (profile.block_moments' fourth)
    INSIDE_SECOND_BLOCK_BACKWARD = 3
    #: anywhere in the backward of a model traced at full depth, with every gradient made by then, as one GPU and
    #: DDP keep them (profile.block_moments' fifth, from tracing/step.py backward_grads: where blocks differ, a
    #: vision tower's and a language model's or an encoder's and a decoder's, the most alive need not fall inside
    #: the last, the one before it, the first or the second block)
    INSIDE_ANY_BLOCK_BACKWARD = 4
    #: everything saved but the last two blocks'
    SAVED_BUT_LAST_TWO = -1
    #: everything saved: all forward left alive, as backward starts (a backward-start moment)
    ALL_SAVED = -2
    #: forward, the embedding's output alone saved (the first all-gather copy-outs)
    EMBEDDING_OUTPUT = -3
    #: everything saved but the last block's
    SAVED_BUT_LAST = -4
    #: the last block's backward begins
    LAST_BLOCK_BACKWARD_BEGINS = -5
    #: the backward of the block before the last begins
    PREVIOUS_BLOCK_BACKWARD_BEGINS = -6
    #: the last block's forward begins
    LAST_BLOCK_FORWARD_BEGINS = -7
    #: the most alive inside the last block's forward
    INSIDE_LAST_BLOCK_FORWARD = -8
    #: the block before the last has finished its backward
    PREVIOUS_BLOCK_BACKWARD_ENDS = -9
    #: the loss's and the head's backward, the root's gradients so far (profile.loss_moment)
    LOSS_BACKWARD = -10
    #: a block parameter's gradient hook, with the hook's transient (profile.block_hooks)
    BLOCK_GRADIENT_HOOK = -11
    #: the last hook of a parameter outside the blocks before them (the final norm's)
    ROOT_LAST_HOOK_BEFORE_BLOCKS = -12
    #: the first block's backward begins (the last block backward runs; the others' activations freed)
    FIRST_BLOCK_BACKWARD_BEGINS = -13
    #: the backward's first gradient hook (a parameter outside the blocks: the head's weight, or the final norm's
    #: where the head is tied), the root's gradients made so far still whole (profile.root_first_hook)
    ROOT_FIRST_HOOK = -14

    @property
    def in_forward(self) -> bool:
        return self in (Moment.EMBEDDING_OUTPUT, Moment.LAST_BLOCK_FORWARD_BEGINS, Moment.INSIDE_LAST_BLOCK_FORWARD)

    @property
    def inside_block(self) -> bool:
        return self >= 0


@dataclass(frozen=True, slots=True)
class HookTransient:
    """What a gradient's reduce allocates at a parameter's hook (BLOCK_GRADIENT_HOOK), as a function of the
    parameter's elements: ``per`` bytes a partition element (the parameter over ``parts`` ranks); an fp64 norm
    taken ``chunk`` elements at a time (``chunk_per`` bytes an element, 0 without), or a copy ``after_per`` bytes an
    element made once the norm's chunks are freed, whichever is larger; and ``apart_per`` bytes an element of the
    whole gradient where it is larger than ``apart_over`` elements (kept in its own storage beside its reduce,
    not in the contiguous bucket)."""

    per: int = 0
    parts: int = 1
    chunk: int = 0
    chunk_per: int = 0
    after_per: int = 0
    apart_over: int = 0
    apart_per: int = 0
    #: reduce_bucket_size where the copies come at a bucket's reduce (0: each at its parameter's own hook): a
    #: hook that would overflow the bucket reduces it first, ``cat_per`` bytes a bucket element where it holds
    #: more than one gradient (ZeRO-3's reduce_scatter_coalesced torch.cat), then each of its gradients' copies
    #: one after another; ``lead`` elements are in it when the blocks' backward begins (the head's and the
    #: final norm's), the largest ``lead_largest``
    bucket: int = 0
    cat_per: int = 0
    lead: int = 0
    lead_largest: int = 0
    depth: int = 0  #: the rank's layer blocks (the hooks of the middle ones are the traced middle block's)
    #: bytes an element of the gradient whose hook triggers a reduce, alive beside it (not yet in the bucket)
    own_per: int = 0

    def bytes(self, numel: int) -> int:
        part = -(-numel // self.parts)
        out = self.per * part
        if self.chunk_per or self.after_per:
            out += max(self.chunk_per * (min(part, self.chunk) if self.chunk else part), self.after_per * part)
        if self.apart_per and numel > self.apart_over:
            out += self.apart_per * numel
        return out

    def tail(self, numels: list[int]) -> int:
        """The last reduce of backward (the epilogue's): the bucket filled with ``numels`` (every gradient in
        backward's order: the module's parameters last first), what is left in it at the end, its
        concatenation and its largest gradient's copies."""
        elems = count = largest = 0
        for numel in numels:
            if elems + numel > self.bucket and elems > 0:
                elems = count = largest = 0
            elems += numel
            count += 1
            largest = max(largest, self.bytes(numel))
        return (self.cat_per * elems if count > 1 else 0) + largest


#: no transient at the hooks
NO_HOOK_TRANSIENT = HookTransient()


@dataclass(frozen=True, slots=True)
class BufferMoment:
    """What a framework holds at one moment beyond model states and activations: its buffers (gathered
    parameters, buckets, reduce inputs, hook transients) and the gradients not yet reduced, per rank."""

    buffers: int
    grads: int
    at: Moment


@dataclass(frozen=True, slots=True)
class StepMoment:
    """A moment of the step as the engine evaluates it: grads and buffers with the persistent ones included,
    and their sum with the model states (``total``), activations still to add."""

    grads: int
    buffers: int
    total: int
    at: Moment


@dataclass(frozen=True)
class BufferTimeline:
    """A framework's buffers at the step's fixed phases and its named moments (per rank, bytes).

    The phases: forward's end (the loss included), the loss backward, the last block's backward (its grads
    complete and being reduced), backward's end, and what the model keeps between steps.
    """

    #: allocated at setup and kept: DDP's buckets, ZeRO-3's ipg bucket, ZeRO-Offload's device-side grad buffer
    persistent: int = 0
    #: allocated in every backward and kept to its end (ZeRO-1/2's ipg bucket)
    backward: int = 0
    #: allocated in the first micro-step's backward and kept through every later micro-step's forward and
    #: backward, released before the optimizer step (ZeRO-1's ipg bucket under gradient accumulation)
    micro_steps_held: int = 0
    #: gathered parameters when forward ends, at the loss, at the most in forward, after the last block's
    #: backward, at backward's end
    gathered_forward_end: int = 0
    gathered_loss: int = 0
    gathered_forward_most: int = 0
    gathered_backward: int = 0
    gathered_end: int = 0
    #: at backward's end, where the framework models it as one moment: (buffers, grads not yet reduced)
    end: tuple[int, int] | None = None
    #: buffers of the reduce at backward's end (ZeRO-1 without overlap_comm: grads_in_partition)
    end_epilogue: int = 0
    moments: tuple[BufferMoment, ...] = ()
    #: the block moments count only the gradients whose hook has not taken them yet (ZeRO-3)
    grads_held: bool = False
    #: the first gradient hook's gradients are among the persistent ones where gradients persist across
    #: micro-steps: kept in param.grad, a later micro-step's added into them before the hook runs (AccumulateGrad;
    #: ZeRO-1 without reduction in its hooks), so ROOT_FIRST_HOOK adds none of its own
    first_hook_grads_persist: bool = False
    #: what a parameter's gradient hook allocates (BLOCK_GRADIENT_HOOK)
    hook_transient: HookTransient = NO_HOOK_TRANSIENT
    assumptions: dict[str, Any] = field(default_factory=dict)

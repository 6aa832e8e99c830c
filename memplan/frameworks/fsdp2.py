"""FSDP2, torch.distributed.fsdp.fully_shard (torch/distributed/fsdp/_fully_shard, torch 2.13), and its NO_SHARD
and HSDP rows: the root kept unsharded, each block's all-gather output, copies and prefetch, the reduce-scatter
input, and the reshard after forward (True, False or a group size)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memplan import layouts
from memplan.errors import SettingsError
from memplan.frameworks.common import LOSS, FourBitBase, FrameworkModel, Grads, Job
from memplan.model.inventory import ROOT_BLOCK, ParamInventory
from memplan.precision import Recipe, float8_gathered
from memplan.settings import Settings
from memplan.settings import reshard_after_forward as requested_reshard_after_forward
from memplan.timeline import BufferMoment, BufferTimeline, Moment
from memplan.model import wrap_units
from memplan.units import ceil_div


def pinned_host(inv: ParamInventory, s: Settings, n: int) -> list[int]:
    """CPUOffloadPolicy(pin_memory=True): each parameter's shard and its gradient's, pinned (_fsdp_param.py)."""
    if not (s.torch.cpu_offload and s.torch.cpu_offload_pin_memory):
        return []
    rc, out = s.recipe, []
    for t in inv.tensors:
        rows = t.shape[0] if t.shape else 1
        shard = ceil_div(rows, n) * (t.numel // rows if rows else 0)
        out += [rc.param_bytes * shard] + ([rc.reduced_grad_bytes * shard] if t.trainable else [])
    return out


def wrap_why_not(inv: ParamInventory, s: Settings) -> str | None:
    """Why --fsdp-wrap cannot wrap this model as asked (None: it can). block+embeddings needs the parameters
    outside the blocks to be one input embedding before them and the final norm and head after them, untied
    (torchtitan's layout: a tied weight cannot belong to two fully_shard units)."""
    policy = wrap_units.policy_of(s)
    if policy is not None:
        split = wrap_units.split_tied(inv, policy)
        if split:
            return (f"--fsdp-wrap {s.torch.fsdp_wrap}: the tied weight {split[0]} would be in two fully_shard units "
                    f"({split[1]} and {split[2]}), which fully_shard refuses (\"shared with a parameter already "
                    "managed by another FSDP group\"); choose another size, or block")
        return None
    if s.torch.fsdp_wrap != "block+embeddings":
        return None
    if any(t.tied_names for t in inv.tensors):
        return ("--fsdp-wrap block+embeddings: the model ties its input and output embeddings, and a tied weight "
                "cannot be sharded by two fully_shard units (torchtitan unties them); use block or none")
    seen_block, before = False, []
    for t in inv.tensors:
        seen_block = seen_block or t.block != ROOT_BLOCK
        if t.block == ROOT_BLOCK and not seen_block:
            before.append(t)
    if len(before) != 1 or before[0].category != "embedding" or not seen_block:
        names = ", ".join(t.name for t in before) or "none"
        return ("--fsdp-wrap block+embeddings: expected one input embedding before the blocks (torchtitan's "
                f"units), found {names}; use block or none")
    return None


def root_reshards(s: Settings, raf: bool | int) -> bool:
    """Whether the root unit is resharded after forward: only when fully_shard(model) is given the blocks'
    reshard_after_forward (--fsdp-root-reshard same, Accelerate's fsdp2_prepare_model); without the argument
    FSDPState._lazy_init sets the root's post_forward_mesh_info to None (_fsdp_state.py: "For the root, do not
    reshard after forward"). torchtitan's units (block+embeddings) leave the root nothing to hold."""
    return raf is True and s.torch.fsdp_root_reshard == "same" and s.torch.fsdp_wrap != "block+embeddings"


def unshard_bytes(rc: Recipe) -> int:
    """Bytes per element of an unsharded parameter and of its unsharded gradient: FSDP2 all-gathers into
    MixedPrecisionPolicy.param_dtype, else the parameters' own dtype (_fsdp_param.py init_dtype_attrs), and
    autograd's gradients come out in that dtype. fsdp-bf16: bf16; torch-amp (no policy; autocast casts inside
    the ops) and fp32: fp32; pure-bf16: bf16. The recipe's grad_bytes is that dtype for every recipe."""
    return rc.grad_bytes


def gathers(job: Job) -> layouts.GatherSizes:
    """The gathered sizes FSDP2's buffers are made of, in unsharded elements of param_dtype. Under float8's
    all-gather a float8 weight's element is one byte, 1/cb of a param_dtype element (its padded elements over cb:
    exact, a float8 weight's dims being multiples of 16): _get_all_gather_input_metadatas then all-gathers the
    unit's mixed dtypes as bytes (uint8), its all_gather_outputs and unsharded weights are float8, and the copy-in
    holds each float8 shard (fsdp_pre_all_gather) beside the others' flat param_dtype cast. Gradients keep their
    sizes (autograd's are param_dtype)."""
    g = job.gathers
    f8 = float8_gathered(job.inv, job.s)
    if not f8:
        return g
    cb = unshard_bytes(job.s.recipe)
    less: dict[str, int] = {}
    order: list[str] = []
    for t in job.inv.tensors:
        if t.group != ROOT_BLOCK and t.group not in order:
            order.append(t.group)
        if t.name in f8:
            padded = layouts._tensor_shard(t, job.n) * layouts.tensor_group(t, job.n)
            less[t.group] = less.get(t.group, 0) + padded - padded // cb
    blocks = tuple(b - less.get(k, 0) for b, k in zip(g.block_numels, order))
    return replace(g, block_numels=blocks, total_blocks=sum(blocks), root=g.root - less.get(ROOT_BLOCK, 0),
                   largest_block=max(blocks, default=g.root),
                   trainable_block_numels=g.trainable_block_numels or g.block_numels)


def reshard_after_forward(job: Job) -> bool | int:
    """reshard_after_forward as FSDP2 applies it: the strategy's default unless given; False without sharding;
    a group size of 1 keeps whole parameters (False), the shard group's size reshards fully (True)
    (_fsdp_init.py _get_post_forward_mesh_info)."""
    st, n = job.s.strategy, job.n
    raf = requested_reshard_after_forward(job.s)
    if not st.shard_params:
        return False
    if not isinstance(raf, bool):
        if raf < 1 or n % raf:
            raise SettingsError(f"reshard_after_forward={raf} must divide the shard group({n})")
        return False if raf == 1 else True if raf == n else raf
    return raf


def buffers(job: Job, grads: Grads) -> BufferTimeline:
    """Per rank, with B the largest block:
    - the root group (embeddings, final norm, head) is not resharded after forward (fully_shard's
      reshard_after_forward=None means False for the root), so it stays unsharded until its backward;
    - forward: a block's all-gather output is kept (FSDPCommContext.all_gather_state) until the next
      block's copy-out, and the last one until the root's post-forward, i.e. through the loss when the
      model computes it; so mid-forward two blocks are unsharded (copy + all-gather output);
    - backward: a block's pre-backward prefetches the next block's all-gather; its post-backward
      reshards it, frees the previous block's reduce-scatter input (reduce_scatter_max_input_buffers
      = 1), copies its unsharded grads into a reduce-dtype reduce-scatter input (foreach_reduce) and
      frees them; the head's grads (and a tied embedding's) wait for the root's reduce at the end.
    With a shard group of one (NO_SHARD) the unsharded copies have nothing to
    reshard to and stay until the block's backward. Each term was checked against the harness's
    allocator timeline (fsdp-full, 2 and 4 blocks; docs/accuracy.md).
    """
    if job.s.torch.fsdp_wrap == "none" or wrap_units.root_only(job.inv):
        return _root_only(job, grads)
    g, raf = gathers(job), reshard_after_forward(job)
    u = _units(job)
    if g.expert_world:
        if not job.s.rank.pipeline_stage:
            return _nested_experts(job, grads, u, raf)
        # a pipeline rank: torchtitan's apply_fsdp gives the experts units their block's reshard_after_forward,
        # False under pipelining ("reshard_after_forward = not pp_enabled"), so every unit, the experts' among
        # them, stays unsharded from its first forward to REDUCE_GRAD, as the blocks do in _kept (options.py
        # _with_parallel refuses the rest)
    h = _kept(u) if raf is False else _resharded(u, raf, g.block_numels)
    if g.expert_world and u.flat and len(g.block_numels) >= 2:
        # the first forward's copy-outs with the experts their own units (B_i then X_i): at B_last's, the previous
        # unit's all-gather output (X_(last-1)'s; B_(last-1)'s where the experts' group is one rank, which
        # gathers nothing) beside B_last's; at X_last's, B_last's beside its own
        xs, last = g.block_experts, len(g.block_numels) - 1
        bs = tuple(t - x for t, x in zip(g.block_numels, xs))
        flatx = g.expert_world > 1
        before = xs[last - 1] if flatx else bs[last - 1]
        h = replace(h, fwd_last=u.root + h.kept + u.cb * (bs[last] + max(before, xs[last] if flatx else 0)))
    end, inside_first = _end(u, job, grads.end)
    moments = [LOSS, *_forward_moments(u, h, raf), *_backward_moments(u, h, raf, job.n), inside_first,
               *_embedding_prefetch(u, grads.end, grads.end - inside_first.grads)]
    if h.prefetch_root and not u.be:  # with everything forward left alive (the traced live bytes after forward)
        moments.append(BufferMoment(h.prefetch_root, 0, Moment.ALL_SAVED))
    if root_reshards(job.s, raf) and not u.be:
        # resharded at the root's post-forward, unsharded again by backward's first hook (_pre_backward) with
        # everything forward left alive: its all-gather output beside its copies (more ranks), or one
        # parameter's cast beside the copies (one rank, a compute dtype unlike the stored one)
        cast = 0
        if not u.flat and job.s.recipe.param_bytes != u.cb:
            cast = u.cb * max((t.numel for t in job.inv.tensors if t.block == ROOT_BLOCK), default=0)
        again = 2 * u.root + u.copy_in(g.root) if u.flat else u.root + cast
        moments.append(BufferMoment(again, 0, Moment.ALL_SAVED))
    if h.head_bwd:
        # the head unit's backward, its grads made (at the activations of backward's start, everything forward
        # left alive: an upper bound, the loss's fp32 tensors are freed by then and the head's grad of the logits
        # is half their size)
        moments.append(BufferMoment(h.head_bwd, u.gb * u.thead, Moment.ALL_SAVED))
    return BufferTimeline(gathered_forward_end=h.forward_end, gathered_loss=h.loss, end=end, moments=tuple(moments),
                          assumptions={"reshard_after_forward": raf, "largest_gathered_block_numel": g.largest_block,
                                       "root_reshard_after_forward": root_reshards(job.s, raf)})


def _nested_experts(job: Job, grads: Grads, u: _Units, raf: bool | int) -> BufferTimeline:
    """Expert parallelism: each MoE block's experts module is an FSDP2 unit of its own inside the block's, over the
    experts' shard group of e = dp x tp / ep ranks (transformers' apply_fully_sharded_data_parallelism and
    torchtitan's apply_fsdp: fully_shard(experts, efsdp mesh, reshard_after_forward=True) before the block's),
    so the block's unit B holds the rest. The units' order is FSDP2's: forward B_i then X_i (post-forward X_i then
    B_i); backward in reverse post-forward order, each pre-backward prefetching the next unit (B_i's prefetches
    X_i, X_i's prefetches B_(i-1)), each post-backward resharding, freeing the previous reduce-scatter input
    (reduce_scatter_max_input_buffers = 1) and filling its own. With e = 1 the experts have no all-gather: their
    unsharded weights are cast one parameter at a time from the shard (wait_for_unshard's world-1 path), nothing
    prefetched. Simulated over every block; each block's moments are labelled with its inside-block moment (the
    last, the one before it, the second, the first: profile.block_moments adds that block's activations and
    gradients at their worst, an upper bound for each of its moments). Measured: harness, mixtral 2 blocks, ep 2
    (docs/accuracy.md)."""
    if raf is not True or u.be:
        raise SettingsError("--ep: modelled with the blocks resharded after forward (fsdp-full's default) and "
                            "--fsdp-wrap block")
    g, n, cb, gb, rb = job.gathers, job.n, u.cb, u.gb, u.rb
    e = g.expert_world
    flat, flatx = n > 1, e > 1
    pf, pfx = int(flat), int(flatx)
    xs = g.block_experts
    bs = tuple(t - x for t, x in zip(g.block_numels, xs))
    sx = g.block_expert_shards
    sb = tuple(t - x for t, x in zip(g.block_shards, sx))
    nb = len(bs)
    # the world-1 unshard casts one parameter at a time when the shard's dtype differs from the compute dtype
    cast = cb * g.largest_expert_tensor if not flatx and job.s.recipe.param_bytes != cb else 0
    # experts sharded on dim 1 (layouts.shard_dim): foreach_all_gather_copy_out copies each into an empty_like
    # temporary of its all-gather output, then torch.cat's its chunks along dim 1 into the output
    # (_fsdp_collectives.py: "Copy to a temporary and then chunk-cat"), the temporaries freed after: one more
    # experts' unsharded size at their copy-out (the reduce's own chunk-cat, one gradient at a time, stays below
    # the reduce-scatter input's fp32)
    d1 = int(g.experts_on_dim1 and flatx)
    root, hg = u.root, u.head_grads
    last = nb - 1
    M = Moment
    moments: list[BufferMoment] = [LOSS]
    # forward: the embedding's unit and block 0's B copied out; the last block's B then its experts copied out
    # (B's all-gather output held through the experts' copy-out; the unit before B, the previous experts, held
    # through B's); inside the last block, its B and its experts unsharded, the experts' output held to the
    # root's post-forward
    moments.append(BufferMoment(root + u.fwd_out + (1 + pf) * cb * bs[0], 0, M.EMBEDDING_OUTPUT))
    before = pfx * cb * xs[last - 1] if nb >= 2 else (pf * cb * 0)
    moments.append(BufferMoment(root + max(before + (1 + pf) * cb * bs[last],
                                           (1 + pf) * cb * bs[last] + (1 + pfx + d1) * cb * xs[last] + cast),
                                0, M.LAST_BLOCK_FORWARD_BEGINS))
    moments.append(BufferMoment(root + cb * bs[last] + max(pf * cb * bs[last], (1 + pfx + d1) * cb * xs[last]),
                                0, M.INSIDE_LAST_BLOCK_FORWARD))
    forward_end = root + (cb * xs[last] if flatx else pf * cb * bs[last])
    loss = root + pf * cb * bs[last]  # the root's pre-backward prefetches the last unit: the last block's B
    if u.cin:
        moments.append(BufferMoment(root + pf * (cb * bs[last] + u.copy_in(bs[last])), 0, M.ALL_SAVED))
    labels = {last: M.INSIDE_LAST_BLOCK_BACKWARD, last - 1: M.INSIDE_PREVIOUS_BLOCK_BACKWARD,
              0: M.INSIDE_FIRST_BLOCK_BACKWARD}
    if nb >= 4:
        labels[1] = M.INSIDE_SECOND_BLOCK_BACKWARD
    shards = held = 0
    base = root + hg
    for i in range(last, -1, -1):
        b, x = cb * bs[i], cb * xs[i]
        nxt = pf * cb * bs[i - 1] if i else 0
        nxt_in = pf * u.copy_in(bs[i - 1]) if i else 0
        at = [
            (base + held + (1 + pf) * b, shards),  # B_i copied out of its prefetched all-gather
            (base + held + b + pfx * (x + u.copy_in(xs[i], e)), shards),  # B_i's pre-backward prefetches X_i
            (base + held + b + (1 + pfx + d1) * x + cast, shards),  # X_i copied out
            (base + held + b + x + nxt + nxt_in, shards),  # X_i's pre-backward prefetches B_(i-1); its backward
        ]
        # X_i's post-backward: resharded, the previous input freed, its grads into its reduce-scatter input (the
        # CPU chunk_cat temporary), then its reduced shard; its input held to the next reduce
        at.append((base + b + nxt + rb * xs[i] + u.chunk_tmp, shards))
        shards += rb * sx[i]
        held = rb * xs[i]
        # the rest of the block's backward, and B_i's post-backward (resharded, X_i's input freed, its own filled):
        # the experts' unsharded grads are gone (reduced), which profile.block_moments still counts at their
        # worst; where its worst falls after them, they are taken out here (gx: their elements, unpadded)
        gx = gb * g.block_expert_numels[i]
        at.append((base + b + nxt + held - gx, shards))
        at.append((base + nxt + rb * bs[i] + u.chunk_tmp - gx, shards))
        shards += rb * sb[i]
        held = rb * bs[i]
        if i in labels:
            buf, grd = max(at, key=lambda m: m[0] + m[1])
            moments.append(BufferMoment(buf, grd, labels[i]))
    # the root's reduce at backward's end: its grads, its unsharded parameters with block 0's input, or its own
    # input; every block's shard reduced, the root's missing
    troot = u.troot
    end = (gb * troot + max(root + held, rb * troot) + u.root_chunk_tmp, rb * ceil_div(troot, n))
    return BufferTimeline(gathered_forward_end=forward_end, gathered_loss=loss, end=end, moments=tuple(moments),
                          assumptions={"reshard_after_forward": raf, "largest_gathered_block_numel": g.largest_block,
                                       "experts_shard_group": e})


@dataclass(frozen=True)
class _Units:
    """The sizes FSDP2's buffers are made of, per rank: unsharded bytes of the root and of blocks by position (a
    model's blocks may differ: dense then MoE), the grad and reduce dtypes, and what a world of one skips."""

    root: int  #: the root unsharded (embeddings, final norm, head), bytes
    last: int  #: elements of the last block, the one before it, the one before that; the first and the second
    prev: int
    prev2: int
    first: int
    second: int
    nblocks: int
    blocks: int  #: elements of all blocks
    cb: int  #: bytes per unsharded element (MixedPrecisionPolicy.param_dtype, as the grads autograd makes)
    gb: int
    rb: int  #: bytes per element of the reduce-scatter input (reduce_dtype)
    head_grads: int  #: from the head's backward to the root's reduce
    flat: bool  #: all-gathers go through a flat output buffer (more than one rank)
    pf: int  #: 1 where a prefetch allocates (an all-gather), else 0
    chunk_tmp: int  #: the CPU chunk_cat temporary of the largest gradient (0 on CUDA)
    root_chunk_tmp: int
    #: the same blocks' trainable elements (what their gradients and reduce-scatter inputs hold: foreach_reduce
    #: takes the parameters with a gradient, _fsdp_param_group.py post_backward); equal to last, prev, first,
    #: second unless parameters are frozen (LoRA)
    tlast: int = 0
    tprev: int = 0
    tfirst: int = 0
    tsecond: int = 0
    tthird: int = 0  #: the third block's trainable elements (its reduce-scatter input, inside the second's backward)
    #: the last, previous and first blocks' trainable elements unpadded: what their unsharded gradients hold
    #: (the t* sizes are padded on dim 0 as the reduce-scatter input is; 0: the same as those)
    glast: int = 0
    gprev: int = 0
    gfirst: int = 0
    #: the reduced grad shards of the blocks after the second (present inside the second block's backward)
    mid_shards: int = 0
    troot: int = 0  #: the root's trainable elements
    #: bytes per element of an all-gather's copy-in source: with a MixedPrecisionPolicy that casts (param_dtype
    #: set and unlike the stored dtype), _get_param_all_gather_inputs first casts the whole shard into one flat
    #: param_dtype buffer (flat_foreach_copy_input) that lives through the all-gather (0: no cast)
    cin: int = 0
    #: --fsdp-wrap block+embeddings (torchtitan's units): the input embedding its own unit (resharded after
    #: forward as the blocks are), the final norm with the head one unit not resharded after forward; nothing in
    #: the root. ``root`` is then what the embedding's unit keeps between its forward and its backward (its
    #: post-forward share), ``head_grads`` 0 (the head's unit reduces right after its own backward).
    be: bool = False
    emb: int = 0  #: the embedding unit unsharded, bytes
    temb: int = 0  #: its trainable elements
    head: int = 0  #: the norm + head unit unsharded, bytes
    thead: int = 0  #: its trainable elements
    emb_pf: int = 0  #: the embedding's all-gather output, prefetched by the first block's pre-backward
    emb_chunk: int = 0  #: the CPU chunk_cat temporaries of the two units' reduces
    head_chunk: int = 0

    @property
    def fwd_out(self) -> int:
        """The all-gather output still held at the first block's copy-out: the root's, or the embedding's."""
        return 0 if not self.flat else self.emb if self.be else self.root

    def end_out(self, last: int) -> int:
        """Unsharded at forward's end beyond the root and the blocks kept: the last block's all-gather output
        (held to the root's post-forward), or the head unit unsharded with its all-gather output."""
        if self.be:
            return self.head * (2 if self.flat else 1)
        return self.cb * last if self.flat else 0

    @property
    def head_held(self) -> int:
        """The head unit, unsharded from its forward to its post-backward (reshard_after_forward False)."""
        return self.head if self.be else 0

    @property
    def head_rs(self) -> int:
        """The head unit's reduce-scatter input, held until the last block's reduce-scatter waits on it."""
        return self.rb * self.thead if self.be else 0

    @property
    def head_shard(self) -> int:
        """The head unit's reduced gradient shard, present from its reduce on."""
        return self.rb * ceil_div(self.thead, self.n) if self.be else 0

    def copy_in(self, numel: int, world: int = 0) -> int:
        """The cast copy of one block's shard alive during its all-gather over ``world`` ranks (default: the
        shard group; a reshard_after_forward group size for a block in its post-forward shards)."""
        world = world or self.n
        return self.cin * ceil_div(numel, world) if world else 0

    n: int = 0
    #: a pipeline stage (Settings.rank.pipeline_stage): the loss runs after the root's post-forward (the last block's
    #: all-gather output already freed) and before its pre-backward (nothing prefetched yet)
    outside: bool = False


def _units(job: Job) -> _Units:
    s, rc, g, gg = job.s, job.s.recipe, gathers(job), job.grad_gathers
    # FSDP2 unshards into MixedPrecisionPolicy.param_dtype (else the parameters' dtype), and autograd's unsharded
    # grads come out in that same dtype: the recipe's grad_bytes (fsdp-bf16: bf16; torch-amp, fp32: fp32, with
    # autocast making its own bf16 copies from the unsharded fp32 weights). With a shard group of one (NO_SHARD)
    # FSDP2 still copies each parameter into its unsharded buffer, in any dtype (wait_for_unshard's world_size ==
    # 1 path: alloc_storage + copy_), measured with fsdp-bf16 and torch-amp (docs/accuracy.md).
    cb = gb = unshard_bytes(rc)
    rb = rc.reduced_grad_bytes
    sizes = g.block_numels or (0,)
    tsizes = g.grad_block_numels or (0,)
    gsizes = g.unsharded_grad_block_numels or (0,)
    nblocks = len(g.block_numels)
    # all-gathers with more than one rank go through a flat output buffer. In forward the output is kept
    # (FSDPCommContext.all_gather_state) until the next block's wait_for_unshard returns: the local
    # `prev_all_gather_state` holds it through that block's copy-out, so at a copy-out three are live:
    # the previous output, this one and its copies; the last one is held to the root's post-forward, so
    # through the loss. In backward a block's output is freed right after its own copy-out.
    # (_fsdp_param_group.py wait_for_unshard; measured: MoE blocks, docs/accuracy.md)
    flat = job.n > 1
    # foreach_reduce copies the unsharded grads into the reduce-scatter input with torch._chunk_cat; CUDA
    # has a fused kernel, the CPU composite pads each grad into a temporary in the grad dtype first
    # (measured: DeepSeek's 9,437,184-element expert weight, an 18,874,368-byte temporary)
    # (only when the reduce dtype differs: an fp32 grad is copied straight into the fp32 input; measured
    # with mixtral's fp32 recipe)
    cpu_chunk = s.cluster.device == "cpu" and gb != rb
    # the all-gather's cast copy-in (_fsdp_collectives.py _get_param_all_gather_inputs, the foreach fast path
    # taken when FSDPParam.param_dtype is set, i.e. the policy's param_dtype differs from the stored dtype
    # (_fsdp_param.py init_dtype_attrs), and parameters are not offloaded): one flat buffer of the shard in
    # param_dtype, alive through foreach_all_gather (measured: LoRA fsdp-full, the last block's pre-backward
    # prefetching the one before it was -1.40% without it)
    cin = cb if flat and rc.param_bytes != cb and not s.torch.cpu_offload else 0
    be: dict[str, Any] = {}
    root = cb * g.root
    head_grads = gb * gg.root_head
    if s.torch.fsdp_wrap == "block+embeddings":
        emb, temb = g.root - g.root_head, gg.root - gg.root_head
        raf = reshard_after_forward(job)
        # what the embedding's unit keeps after its forward: nothing, a 1/raf share, or all of it
        root = 0 if raf is True else cb * emb if raf is False else cb * ceil_div(emb, raf)
        head_grads = 0
        be = dict(be=True, emb=cb * emb, temb=temb, head=cb * g.root_head, thead=gg.root_head,
                  emb_pf=cb * emb if flat and raf is not False else 0,
                  emb_chunk=gb * temb if cpu_chunk else 0,
                  head_chunk=gb * gg.head_largest_tensor if cpu_chunk else 0)
    return _Units(root=root, **be, last=sizes[-1], prev=sizes[-2] if nblocks >= 2 else 0,
                  prev2=sizes[-3] if nblocks >= 3 else 0, first=sizes[0], second=sizes[1] if nblocks >= 2 else 0,
                  nblocks=nblocks, blocks=g.total_blocks, cb=cb, gb=gb, rb=rb, head_grads=head_grads, flat=flat,
                  # a prefetch (unshard) allocates only where there is an all-gather: with a shard group of one,
                  # unshard() records an empty result and wait_for_unshard() allocates and copies when the block
                  # runs (_fsdp_param_group.py, world_size == 1; measured with the harness: gpt2 at 1 rank was
                  # +5.35%)
                  pf=1 if flat else 0,
                  chunk_tmp=gb * gg.largest_tensor if cpu_chunk else 0,
                  root_chunk_tmp=gb * gg.root_largest_tensor if cpu_chunk else 0,
                  tlast=tsizes[-1], tprev=tsizes[-2] if nblocks >= 2 else 0, tfirst=tsizes[0],
                  tsecond=tsizes[1] if nblocks >= 2 else 0, tthird=tsizes[2] if nblocks >= 3 else 0,
                  glast=gsizes[-1], gprev=gsizes[-2] if nblocks >= 2 else 0, gfirst=gsizes[0],
                  mid_shards=rb * sum(ceil_div(t, job.n) for t in tsizes[2:]) if job.n else 0,
                  troot=gg.root, cin=cin, n=job.n, outside=s.rank.pipeline_stage)


@dataclass(frozen=True)
class _Held:
    """What is unsharded at the step's moments, given the reshard after forward (bytes)."""

    kept: int  #: blocks (or their shares) kept after forward
    share_last: int  #: the last block's share among them, and the one before it's
    share_prev: int
    forward_end: int
    loss: int
    fwd_last: int  #: the last block's copy-out in forward
    unshard_last: int  #: its copy-out in backward (0: nothing gathered in backward)
    inside_last: int  #: inside the last block's backward
    last_end: int  #: the last block at the end of its backward
    unshard_prev: int
    inside_two: int  #: inside the block before it
    #: a block's pre-backward after its copy-out, prefetching the block before it (all-gather output and cast
    #: copy-in): the last block's, and the one before it's (0: nothing gathered in backward)
    prefetch_last: int = 0
    prefetch_prev: int = 0
    #: the root's pre-backward (everything forward left alive): the last block's prefetch, output and copy-in
    prefetch_root: int = 0
    #: block+embeddings: the head unit's pre-backward and backward, after the loss's: the head unit unsharded, the
    #: last block prefetched (output and copy-in), the head's grads being made
    head_bwd: int = 0


def _kept(u: _Units) -> _Held:
    """reshard_after_forward False (SHARD_GRAD_OP): every block stays unsharded until its backward."""
    kept = u.cb * u.blocks
    return _Held(
        kept=kept, share_last=0, share_prev=0,
        forward_end=u.root + kept + (0 if u.outside else u.end_out(u.last)), loss=u.root + u.head_held + kept,
        head_bwd=u.root + u.head_held + kept if u.be else 0,
        # every block before the last unsharded, and its all-gather output
        fwd_last=u.root + kept + u.cb * (u.prev + u.last) if u.flat else 0,
        unshard_last=0, unshard_prev=0,
        inside_last=u.root + u.head_grads + kept + u.head_rs,
        # all blocks unsharded and the last one's grads; then (resharded) its reduce-scatter input
        last_end=(u.root + u.head_grads + kept + u.gb * u.glast + max(u.head_rs, u.rb * u.tlast - u.cb * u.last)
                  + u.chunk_tmp),
        # one block fewer unsharded, the last block's reduce-scatter input
        inside_two=u.root + u.head_grads + kept - u.cb * u.last + u.rb * u.tlast)


def _resharded(u: _Units, raf: bool | int, block_numels: tuple[int, ...]) -> _Held:
    """reshard_after_forward True, or a group size: every block keeps a 1/raf share after forward
    (to_sharded_post_forward clones it); a block's share is freed when backward unshards it, after the copy-out
    (_fsdp_param.py to_unsharded)."""
    cb, root, hg = u.cb, u.root, u.head_grads
    if raf is True:
        kept = share_last = share_prev = 0
    else:
        kept = cb * layouts.ceil_sum(block_numels, raf)
        share_last, share_prev = cb * ceil_div(u.last, raf), cb * ceil_div(u.prev, raf)
    prefetched = u.pf * cb * u.prev
    copies = 2 if u.flat else 1
    world = raf if raf is not True else u.n  # a block in its post-forward shards all-gathers over raf ranks
    return _Held(
        kept=kept, share_last=share_last, share_prev=share_prev,
        forward_end=root + kept + (0 if u.outside else u.end_out(u.last)),
        # the loss backward: the root's pre-backward has prefetched the last block's all-gather (the head unit's
        # pre-backward, where it is its own unit)
        # (its own unit's pre-backward runs after the loss's backward: no prefetch yet, see head_bwd; nor under
        # pipelining, whose loss runs outside the root and before its backward)
        loss=root + u.head_held + (0 if u.be or u.outside else u.pf * cb * u.last) + kept,
        # the last block's copy-out in forward: the previous block's all-gather output, its own, its copies
        fwd_last=root + kept - share_last + cb * (u.prev + 2 * u.last) if u.flat else 0,
        # the last block's copy-out in backward (its all-gather prefetched at the loss): output and copies
        unshard_last=root + hg + kept + copies * cb * u.last + u.head_rs,
        # inside the last block's backward: itself, the next block prefetched by its pre-backward
        inside_last=root + hg + kept - share_last + prefetched + cb * u.last + u.head_rs,
        # at the end of its backward: that, and its grads; then resharded, its reduce-scatter input (the head
        # unit's input waited on and freed first: post_backward_rs_wait)
        last_end=(root + hg + kept - share_last + prefetched + u.gb * u.glast
                  + max(cb * u.last + u.head_rs, u.rb * u.tlast) + u.chunk_tmp),
        # the block before it, copied out of its prefetched all-gather: the last block's reduce-scatter input
        # still held (reduce_scatter_max_input_buffers = 1) and the next block prefetched after
        unshard_prev=root + hg + kept - share_last + copies * cb * u.prev + u.rb * u.tlast,
        # inside the block before it: itself, the next prefetched (if any), the last block's input
        inside_two=root + hg + kept - share_last - share_prev + cb * (u.prev + u.pf * u.prev2) + u.rb * u.tlast,
        # the last block's pre-backward, after its copy-out: _backward_prefetch all-gathers the block before it
        # (_fsdp_param_group.py pre_backward), its output and cast copy-in alive together
        prefetch_last=(root + hg + kept - share_last + cb * u.last + u.head_rs
                       + u.pf * (cb * u.prev + u.copy_in(u.prev, world)) if u.nblocks >= 2 else 0),
        # and the block before it's, the last block's reduce-scatter input still held
        prefetch_prev=(root + hg + kept - share_last - share_prev + cb * u.prev
                       + u.pf * (cb * u.prev2 + u.copy_in(u.prev2, world)) + u.rb * u.tlast if u.nblocks >= 3 else 0),
        # the root's pre-backward prefetches the last block (its output then held through the loss: `loss`)
        prefetch_root=root + u.head_held + kept + u.pf * (cb * u.last + u.copy_in(u.last, world)) if u.cin else 0,
        head_bwd=root + u.head_held + kept + u.pf * (cb * u.last + u.copy_in(u.last, world)) if u.be else 0)


def _forward_moments(u: _Units, h: _Held, raf: bool | int) -> list[BufferMoment]:
    # the first block's copy-out: the root's all-gather output is held through it (the root stays unsharded:
    # fully_shard's default for the root), with block 0's output and copies
    out = [BufferMoment(u.root + u.fwd_out + (2 if u.flat else 1) * u.cb * u.first, 0,
                        Moment.EMBEDDING_OUTPUT)]
    if u.nblocks >= 2:
        out.append(BufferMoment(h.fwd_last, 0, Moment.LAST_BLOCK_FORWARD_BEGINS))
    # inside the last block's forward: its copies and its all-gather output (held to the root's post-forward);
    # with raf False every block before it unsharded too
    out.append(BufferMoment(u.root + h.kept - h.share_last + (u.cb * u.last if u.flat else 0)
                            + (u.cb * u.last if raf is not False else 0), 0, Moment.INSIDE_LAST_BLOCK_FORWARD))
    return out


def _backward_moments(u: _Units, h: _Held, raf: bool | int, n: int) -> list[BufferMoment]:
    out = []
    hs = u.head_shard  # the head unit's reduced shard (block+embeddings): present all through the blocks' backward
    if u.be:
        # the head unit's post-backward: resharded, its grads copied into its reduce-scatter input (on CPU through
        # the chunk_cat temporary), then its reduced shard; the last block prefetched by its pre-backward (where
        # it was resharded after forward)
        prefetched = u.pf * u.cb * u.last if raf is not False else 0
        out.append(BufferMoment(u.root + h.kept + prefetched + (u.gb + u.rb) * u.thead
                                + max(0, u.head_chunk - hs), hs, Moment.LAST_BLOCK_BACKWARD_BEGINS))
    if h.unshard_last:
        out.append(BufferMoment(h.unshard_last, hs, Moment.LAST_BLOCK_BACKWARD_BEGINS))
    if h.prefetch_last:
        out.append(BufferMoment(h.prefetch_last, hs, Moment.LAST_BLOCK_BACKWARD_BEGINS))
    # the last block's reduce: its activations and the loss's gone, as when the next block's begins
    out.append(BufferMoment(h.last_end, hs, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    # inside a block's backward its unsharded grads grow while its activations are freed: the profile follows
    # both (block_moments); the grads are counted at the unsharded grad dtype
    out.append(BufferMoment(h.inside_last, hs, Moment.INSIDE_LAST_BLOCK_BACKWARD))
    if u.nblocks < 2:
        return out
    # and the last block's reduced grad shard
    last_shard = u.rb * ceil_div(u.tlast, n) + hs
    if h.unshard_prev:
        out.append(BufferMoment(h.unshard_prev, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    if h.prefetch_prev:
        out.append(BufferMoment(h.prefetch_prev, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_BEGINS))
    # the block before, its grads complete
    out.append(BufferMoment(h.inside_two + u.gb * u.gprev, last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_ENDS))
    if u.chunk_tmp:
        # then resharded, the last block's input freed, its own input filled: the CPU temporary (SHARD_GRAD_OP:
        # both blocks resharded after their backward, the rest still unsharded; measured with the harness:
        # llama-3-8b fsdp-bf16 was +1.25..+2.86% counting them unsharded)
        after_two = (h.kept - u.cb * (u.last + u.prev) if raf is False
                     else h.kept - h.share_last - h.share_prev + u.pf * u.cb * u.prev2)
        out.append(BufferMoment(u.root + u.head_grads + after_two + u.gb * u.gprev + u.rb * u.tprev + u.chunk_tmp,
                                last_shard, Moment.PREVIOUS_BLOCK_BACKWARD_ENDS))
    out.append(BufferMoment(h.inside_two, last_shard, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD))
    if u.nblocks >= 4:
        out.append(_inside_second(u, raf))
    return out


def _inside_second(u: _Units, raf: bool | int) -> BufferMoment:
    """Inside the second block's backward (index 1, of four or more): itself unsharded, the first block's
    all-gather prefetched by its pre-backward (or, not resharded after forward, still whole; with a group size,
    its share still held), the third block's reduce-scatter input (reduce_scatter_max_input_buffers = 1), and
    every later block's reduced shard; one block's activations below it. Where a block's sharded gradients
    outweigh its activations (few ranks, short sequences, recompute), memory grows block by block through
    backward, and this is its most loaded block: the first has nothing left to prefetch. Measured with the
    harness: llama-7b with 4 blocks under fsdp-full peaked here (op-sac: -1.66%, full recompute: -0.34% without
    this moment; docs/accuracy.md)."""
    cb = u.cb
    if raf is False:
        unsharded = cb * (u.first + u.second)
    else:
        share = 0 if raf is True else cb * ceil_div(u.first, raf)
        unsharded = share + cb * (u.second + u.pf * u.first)
    return BufferMoment(u.root + u.head_grads + unsharded + u.rb * u.tthird, u.head_shard + u.mid_shards,
                        Moment.INSIDE_SECOND_BLOCK_BACKWARD)


def _end(u: _Units, job: Job, grads_end: int) -> tuple[tuple[int, int], BufferMoment]:
    """Backward's end as (buffers, grads not yet reduced), the larger of: the first block at the end of its
    backward (itself, its grads, the next block's reduce-scatter input; the reduced shards of all blocks but it
    and the root), and the root's reduce (its grads, and either its unsharded params with the first block's
    reduce-scatter input or, resharded, its own reduce-scatter input; every block's shard reduced); and the
    moment inside the first block's backward. With the embedding its own unit (block+embeddings), the unit
    reduced last is the embedding's: the first block's pre-backward prefetches it (its all-gather output held
    through that block's backward), its copy-out unshards it, its reduce follows its backward."""
    n, first, tfirst = job.n, u.first, u.tfirst
    # held through the first block's backward, unsharded at the last unit's reduce, and that unit's elements
    held, unsharded, troot = ((u.root + u.emb_pf, u.emb, u.temb) if u.be
                              else (u.root + u.head_grads, u.root, u.troot))
    root_chunk = u.emb_chunk if u.be else u.root_chunk_tmp
    gfirst = u.gfirst or tfirst  # its unsharded gradients (unpadded)
    first_block = (held + u.cb * first + u.gb * gfirst
                   + (u.rb * u.tsecond if u.nblocks >= 2 else max(0, u.rb * tfirst - u.cb * first)),
                   u.rb * (ceil_div(troot, n) + ceil_div(tfirst, n)))
    # then resharded, its own reduce-scatter input filled (on CPU through the chunk_cat temporary)
    first_fill = (held + u.gb * gfirst + u.rb * tfirst + u.chunk_tmp, first_block[1])
    root_reduce = (u.gb * troot + max(unsharded + u.rb * tfirst, u.rb * troot) + root_chunk,
                   u.rb * ceil_div(troot, n))
    ends = [first_block, first_fill, root_reduce]
    if u.be and u.emb_pf:  # the embedding's copy-out: its all-gather output and its unsharded copy
        ends.append((u.root + u.emb_pf + u.emb + u.rb * tfirst, root_reduce[1]))
    end = max(ends, key=lambda m: m[0] - m[1])
    # inside the first block's backward: itself unsharded, the second block's reduce-scatter input
    inside = BufferMoment(held + u.cb * first + (u.rb * u.tsecond if u.nblocks >= 2 else 0),
                          grads_end - first_block[1], Moment.INSIDE_FIRST_BLOCK_BACKWARD)
    return end, inside


def _embedding_prefetch(u: _Units, grads_end: int, first_missing: int) -> list[BufferMoment]:
    """block+embeddings: the first block's pre-backward, after its copy-out, all-gathers the embedding's unit
    (_backward_prefetch): its output and its cast copy-in alive together."""
    if not (u.be and u.emb_pf):
        return []
    emb_numel = u.emb // u.cb if u.cb else 0
    return [BufferMoment(u.root + u.cb * u.first + (u.rb * u.tsecond if u.nblocks >= 2 else 0) + u.emb_pf
                         + u.copy_in(emb_numel), grads_end - first_missing, Moment.FIRST_BLOCK_BACKWARD_BEGINS)]


def _root_only(job: Job, grads: Grads) -> BufferTimeline:
    """Only the root fully_shard-ed (--fsdp-wrap none): one parameter group, all-gathered at the root's
    pre-forward and never resharded before its post-backward (reshard_after_forward=None is False for the root,
    _fully_shard.py). Its all-gather output is held (FSDPCommContext.all_gather_state) until the root's
    post-forward, i.e. through the loss the model computes; every gradient stays unsharded until the root's
    post-backward, which runs in the final callback (the root's inputs need no gradient): the gradients saved,
    the parameters resharded, the reduce-scatter input filled (_fsdp_param_group.py post_backward,
    foreach_reduce). Measured with the harness (docs/accuracy.md)."""
    u = _units(job)
    g, gg = gathers(job), job.grad_gathers
    total = g.root + g.total_blocks
    ttotal = gg.root + sum(g.grad_block_numels)
    root = u.cb * total
    flat = u.cb * total if u.flat else 0
    hg = u.head_grads
    tsizes = g.grad_block_numels or (0,)
    # the blocks' unsharded grads, accumulated in backward: those after the block being run
    after_last = 0
    after_prev = u.gb * tsizes[-1] if len(tsizes) >= 2 else 0
    after_first = u.gb * sum(tsizes[1:])
    moments = [LOSS,
               BufferMoment(root + flat, 0, Moment.EMBEDDING_OUTPUT),
               BufferMoment(root + flat, 0, Moment.INSIDE_LAST_BLOCK_FORWARD),
               BufferMoment(root + hg + after_last, 0, Moment.INSIDE_LAST_BLOCK_BACKWARD)]
    if len(tsizes) >= 2:
        moments.append(BufferMoment(root + hg + after_prev, 0, Moment.INSIDE_PREVIOUS_BLOCK_BACKWARD))
    cpu_chunk = job.s.cluster.device == "cpu" and u.gb != u.rb
    chunk = u.gb * max(gg.largest_tensor, gg.root_largest_tensor) if cpu_chunk else 0
    end = (u.gb * ttotal + max(root, u.rb * ttotal) + chunk, u.rb * ceil_div(ttotal, job.n))
    inside_first = BufferMoment(root + hg + after_first, grads.end - end[1], Moment.INSIDE_FIRST_BLOCK_BACKWARD)
    moments.append(inside_first)
    return BufferTimeline(gathered_forward_end=root + flat, gathered_loss=root, end=end, moments=tuple(moments),
                          assumptions={"reshard_after_forward": False, "fsdp_wrap": job.s.torch.fsdp_wrap,
                                       "largest_gathered_block_numel": total})


def _casts_packed(rc: Recipe) -> str | None:
    """A MixedPrecisionPolicy whose param_dtype differs from the stored dtype casts every float shard before the
    all-gather (_fsdp_param.py init_dtype_attrs), the packed 4-bit codes too."""
    if unshard_bytes(rc) == rc.param_bytes:
        return None
    return ("FSDP2's MixedPrecisionPolicy(param_dtype=bf16) would cast the packed 4-bit codes as numbers before the "
            "all-gather; FSDP-QLoRA loads the model in bf16 with --quant-storage bfloat16 and keeps it there "
            "(--precision pure-bf16: Accelerate 1.15's fsdp2_prepare_model does not upcast a model with Params4bit)")


MODEL = FrameworkModel(name="fsdp2", replay="memplan.frameworks.fsdp2_replay", buffers=buffers,
                       half_autocast_why_not="Accelerate's FSDP preparation upcasts a half-precision model to fp32 for its "
                                             "MixedPrecisionPolicy (fsdp2_prepare_model): the Trainer's bf16 there is "
                                             "fsdp-bf16",
                       
                       cpu_offload_policy=True, offloads_each_reduced_grad=True, wrap_why_not=wrap_why_not,
                       units=wrap_units.units_for,
                       # each parameter its own DTensor shard: one no loss reads gets no gradient (FSDPParamGroup
                       # post_backward reduces the parameters whose unsharded grad is not None), so no state
                       unreached=lambda s: ("tensor", "no gradient and no optimizer state"),
                       # measured (torch 2.13, gloo, 2 ranks): transformers' Adafactor fails in its first step
                       # (torch.zeros(grad_shape[:-1]).to(grad) is a plain tensor beside DTensor grads: "aten.add_
                       # got mixed torch.Tensor and DTensor"), and so do bitsandbytes' optimizer kernels
                       shaped_optimizer_why_not="FSDP2 hands the optimizer DTensor shards, which transformers' "
                                                "Adafactor and bitsandbytes' optimizers cannot step (they mix "
                                                "plain tensors with DTensors: measured with torch 2.13); "
                                                "--fsdp-version 1, zero1-3 or ddp can run it",
                       pinned_host=pinned_host, four_bit=FourBitBase(
                           # Accelerate 1.15 fsdp2_prepare_model: each non-float Params4bit goes to fully_shard as
                           # ignored_params (DTensor cannot hold it)
                           uint8="kept whole on every GPU: a uint8 storage cannot be sharded, and Accelerate 1.15's "
                                 "fsdp2_prepare_model passes each non-float Params4bit to fully_shard as "
                                 "ignored_params (--quant-storage bfloat16 shards it)",
                           packed="which FSDP2 shards like the other frozen weights, each QuantState (absmax, code) "
                                  "kept whole on every GPU (Linear4bit's forward restores it from the module after "
                                  "the all-gather: fix_4bit_weight_quant_state_from_module)",
                           shards_packed=True, loaded_whole=True, cast_why=_casts_packed))

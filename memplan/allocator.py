"""PyTorch's CUDA caching allocator, replayed: what ``torch.cuda.max_memory_reserved`` reaches for a sequence of
allocations and frees. No torch here.

A job runs out of memory when the caching allocator cannot reserve a new segment, so the fit verdict needs the
*reserved* peak, which the allocated peak does not give: freed blocks stay cached in their segments, a segment
can only serve requests that fit in one of its free blocks, and blocks never span segments.

The algorithm is the native allocator's (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator):

- ``round_size``: every request is rounded up to 512 bytes (kMinBlockSize), or to a power-of-two division with
  ``roundup_power2_divisions``;
- two pools per stream: small (requests up to 1 MiB, kSmallSize) and large;
- ``get_free_block``: best fit, the smallest cached block of the same stream and pool that is large enough
  (std::set ordered by (stream, size, address)); with ``max_split_size_mb``, blocks at least that large serve
  only requests at least that large and within 20 MiB (kLargeBuffer) of them;
- ``get_allocation_size``: a new segment (cudaMalloc) of 2 MiB for small requests, 20 MiB for requests under
  10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- ``should_split``: a block is split when the remainder is at least 512 bytes (small pool, expandable segments)
  or, in the large pool, more than 1 MiB and the request is below max_split_size;
- ``free_block``: a freed block merges with free neighbours of its segment and returns to its pool;
- ``garbage_collection_threshold``: (with a memory fraction set) cached blocks not reused for a while are
  released before a new segment is reserved; ``release_cached_blocks`` (torch.cuda.empty_cache, or the
  retry after a failed cudaMalloc) frees every segment that holds no allocated block.
- ``expandable_segments`` (ExpandableSegment, find_expandable_block, map_block, unmap_block): one reserved
  address range per stream and pool, mapped by pages (2 MiB small, 20 MiB large). A request no cached block
  serves maps pages at the lowest unmapped range whose free and unmapped run (with the free block before it) is
  long enough, merged with the free neighbours; best fit ranks a free block by the size it could grow to
  (get_free_block's ``expandable_size``: its own plus the unmapped range after it), so the free block at the
  end of the mapped pages is taken only when no other is large enough; ``release_cached_blocks`` unmaps the
  whole pages inside every free block (release_blocks -> unmap_block), which leaves holes later requests map
  again.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import SettingsError

MIN_BLOCK = 512  #: kMinBlockSize
SMALL_SIZE = 1 << 20  #: kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20  #: kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  #: kLargeBuffer: the segment for requests between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  #: kMinLargeAlloc
ROUND_LARGE = 2 << 20  #: kRoundLarge

@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """PYTORCH_CUDA_ALLOC_CONF's settings that decide the device's bytes (memplan/allocator_conf.py parses the text
    exactly as PyTorch does; a setting the replay does not model is refused there)."""

    max_split_size: int | None = None  #: bytes; None: unlimited (SIZE_MAX)
    #: max_non_split_rounding_mb: how much larger than a request at least max_split_size a cached block may be
    max_non_split_rounding: int = LARGE_BUFFER
    #: one power of two for every size, or the 16 intervals' (1 MiB, 2 MiB, ... 32 GiB and above)
    roundup_power2_divisions: int | tuple[int, ...] = 0
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    #: the process's cap as a fraction of the device's memory (torch.cuda.set_per_process_memory_fraction's)
    per_process_memory_fraction: float = 1.0
    text: str = ""  #: what was parsed, for the output

    @staticmethod
    def parse(text: str | None) -> AllocatorConfig:
        """Parse "key:value,key:value" as PyTorch does (memplan/allocator_conf.py): what PyTorch refuses is an error
        naming it; a setting PyTorch honours that the replay does not model is refused too."""
        if not text or not text.strip():
            return AllocatorConfig()
        from memplan.allocator_conf import parse

        got = parse(text)
        if got["backend"] == "cudaMallocAsync":
            raise SettingsError("allocator config backend:cudaMallocAsync (CUDA's own pool) is not modelled")
        if got["large_segment_size"] != LARGE_BUFFER:
            raise SettingsError("allocator config large_segment_size_mb (the segment size for requests of 1-10 MiB) "
                                "is not modelled; the replay takes PyTorch's 20 MiB")
        if got["throw_on_cudamalloc_oom"]:
            raise SettingsError("allocator config throw_on_cudamalloc_oom:True (an OOM raised before cudaMalloc when "
                                "the device looks full) is not modelled")
        div = got["roundup_power2_divisions"]
        assert isinstance(div, tuple)
        return AllocatorConfig(max_split_size=got["max_split_size"],  # type: ignore[arg-type]
                               max_non_split_rounding=got["max_non_split_rounding"],  # type: ignore[arg-type]
                               roundup_power2_divisions=div[0] if len(set(div)) == 1 else div,
                               garbage_collection_threshold=got["garbage_collection_threshold"],  # type: ignore
                               expandable_segments=got["expandable_segments"],  # type: ignore[arg-type]
                               per_process_memory_fraction=got["per_process_memory_fraction"],  # type: ignore
                               text=text.strip())

    def divisions(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size): the interval of ``size`` (powers of two from
        1 MiB; below it the first, from 32 GiB the last)."""
        d = self.roundup_power2_divisions
        if isinstance(d, int):
            return d
        return d[min(max(size.bit_length() - 1 - 20, 0), len(d) - 1)]

    @property
    def rounds(self) -> bool:
        """Some size is rounded to power-of-two divisions."""
        d = self.roundup_power2_divisions
        return (d > 1) if isinstance(d, int) else any(x > 1 for x in d)

    def round_size(self, size: int) -> int:
        """round_size: 512-byte blocks, or the next of ``roundup_power2_divisions`` steps between powers of two
        (roundup_power2_next_division)."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        d = self.divisions(size)
        if d > 1 and size > MIN_BLOCK * d:
            floor = 1 << (size.bit_length() - 1)
            if floor == size:
                return size
            step = floor >> (d.bit_length() - 1)
            if step == 0:
                return floor << 1
            return -(-size // step) * step
        return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """get_allocation_size: the segment a request that no cached block serves reserves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


#: an expandable segment's address space in pages (PyTorch reserves 9/8 of the device's memory; any range far
#: beyond what a run maps ranks and serves the same)
ADDRESS_PAGES = 1 << 16


def _expandable_size(b: _Block) -> int:
    """get_free_block's expandable_size: a free block's size and the unmapped range right after it."""
    nb = b.next
    return b.size + nb.size if nb is not None and not nb.mapped else b.size


#: orders Allocator.over across the allocators of one replay (the first refused is the one a limit stops at)
_OVER_COUNT = itertools.count()


class _Block:
    """A block of a segment: handed out (allocated), cached in its pool (cached), or neither (being split)."""

    __slots__ = ("ptr", "size", "stream", "small", "segment", "allocated", "cached", "prev", "next", "mapped",
                 "gc_base")

    def __init__(self, ptr: int, size: int, stream: int, small: bool, segment: int, prev: _Block | None = None,
                 next: _Block | None = None) -> None:  # noqa: A002
        self.ptr, self.size, self.stream, self.small, self.segment = ptr, size, stream, small, segment
        self.allocated = False
        self.cached = False
        self.prev, self.next = prev, next
        self.mapped = True  #: False: an unmapped range of an expandable segment (never cached, never handed out)
        #: its pool's get_free_block calls when it was cached (BlockPool::insert_into_blocks: gc_count_base)
        self.gc_base = 0


@dataclass
class Allocator:
    """The native caching allocator over one device's requests; ``reserved`` and ``peak_reserved`` are what
    torch.cuda.memory_reserved / max_memory_reserved report, ``allocated`` / ``peak_allocated`` likewise."""

    config: AllocatorConfig = field(default_factory=AllocatorConfig)
    reserved: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    peak_allocated: int = 0
    segments: int = 0
    #: the device bytes the allocator can hold: cudaMalloc (or mapping a page) fails past them (the card's capacity
    #: less what lies outside the allocator: the CUDA context, NCCL's buffers); None: unlimited
    device_limit: int | None = None
    #: per_process_memory_fraction's allowed_memory_maximum (fraction x the card's total); None: no fraction set
    fraction_limit: int | None = None
    #: cache flushes: a reservation that failed, then release_cached_blocks (a synchronising cudaFree of every
    #: free segment) and a retry (stats.num_alloc_retries)
    retries: int = 0
    #: the retries of each step (Run.end_step)
    step_retries: list[int] = field(default_factory=list)
    #: the first reservation the limits refused, as (when: a count across allocators, the reserved peak and the
    #: allocated peak a replay without limits would have had once it made that reservation); None: none refused
    over: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        #: (small, stream) -> the pool's cached blocks as (size, ptr, block), sorted: best fit is the first entry
        #: at least as large (free blocks of a pool never share an address, so the block is never compared)
        self._free: dict[int, list[tuple[int, int, _Block]]] = {}  # key: stream * 2 + small
        self._ids = itertools.count()
        # cudaMalloc hands out segments from the top of the address space down (seen in every recorded
        # stream); the address only breaks ties between cached blocks of one size (the lowest first)
        self._next_ptr = 1 << 47
        #: addresses to give the next new segments (a replay uses the recorded ones)
        self.addresses: list[tuple[int, int]] = []
        self._segment_heads: dict[int, _Block] = {}
        #: expandable segments: (small, stream) -> the unmapped ranges as (address, block), sorted
        #: (BlockPool::unmapped, ordered by stream then address); segment -> (its base address, its page)
        self._unmapped: dict[tuple[bool, int], list[tuple[int, _Block]]] = {}
        self._pages: dict[int, tuple[int, int]] = {}
        c = self.config
        #: garbage collection runs only with a memory fraction (DeviceCachingAllocator::malloc:
        #: allowed_memory_maximum.has_value() && garbage_collection_threshold() > 0)
        self._gc = self.fraction_limit is not None and c.garbage_collection_threshold > 0
        self._gc_calls = [0, 0]  #: get_free_blocks_call_count of the large and the small pool
        self._capped = self.device_limit is not None or self.fraction_limit is not None
        self._plain = not c.rounds and c.max_split_size is None and not c.expandable_segments and not self._gc

    # ---- pools ----
    def _insert(self, b: _Block) -> None:
        key = b.stream * 2 + b.small
        lst = self._free.get(key)
        if lst is None:
            lst = self._free[key] = []
        insort(lst, (b.size, b.ptr, b))
        b.cached = True
        b.gc_base = self._gc_calls[b.small]

    def _is_cached(self, b: _Block) -> bool:
        """Free and in its pool (a block handed out, or split off and handed out, is not)."""
        return b.cached

    def _remove(self, b: _Block) -> None:
        lst = self._free[b.stream * 2 + b.small]
        del lst[bisect_left(lst, (b.size, b.ptr))]
        b.cached = False

    def _best_fit(self, size: int, small: bool, stream: int) -> _Block | None:
        if self._gc:  # get_free_block: the pool's call count, the blocks' age (only while collection is on)
            self._gc_calls[small] += 1
        lst = self._free.get(stream * 2 + small)
        if not lst:
            return None
        j = bisect_left(lst, (size,))
        if j == len(lst):
            return None
        if self.config.expandable_segments:
            # get_free_block: "for the purposes of best fit we consider its size to be the size it can expand to"
            while j + 1 < len(lst) and _expandable_size(lst[j + 1][2]) < _expandable_size(lst[j][2]):
                j += 1
        b = lst[j][2]
        mss = self.config.max_split_size
        if mss is not None:
            if size < mss <= b.size:
                return None
            if size >= mss and b.size >= size + self.config.max_non_split_rounding:
                return None
        del lst[j]
        b.cached = False
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        mss = self.config.max_split_size
        return (mss is None or size < mss) and remaining > SMALL_SIZE

    # ---- requests ----
    def malloc(self, size: int, stream: int = 0) -> _Block:
        """A request of ``size`` bytes on ``stream``: the block that serves it."""
        if self._plain:
            return self._malloc_plain(size, stream)
        size = self.config.round_size(size)
        small = size <= SMALL_SIZE
        b = self._best_fit(size, small, stream)
        if b is None:
            b = self._grow(size, small, stream)
        if self._should_split(b, size):
            rest = _Block(b.ptr + size, b.size - size, stream, small, b.segment, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        b.allocated = True
        self.allocated += b.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b

    def _malloc_plain(self, size: int, stream: int = 0) -> _Block:
        """malloc with the default configuration (no max_split_size, roundup divisions, expandable segments or
        garbage collection): the same steps as malloc, inlined (the replay's hot path)."""
        size = MIN_BLOCK if size < MIN_BLOCK else (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK
        small = size <= SMALL_SIZE
        key = stream * 2 + small
        lst = self._free.get(key)
        b = None
        if lst:
            j = bisect_left(lst, (size,))
            if j < len(lst):
                b = lst.pop(j)[2]
                b.cached = False
        if b is None:
            alloc = (SMALL_BUFFER if small else LARGE_BUFFER if size < MIN_LARGE_ALLOC
                     else -(-size // ROUND_LARGE) * ROUND_LARGE)
            if self._capped and not self._room(alloc):
                b = self._grow(size, small, stream)
                lst = self._free.get(key)
            else:
                b = self._new_segment(alloc, small, stream)
        remaining = b.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(b.ptr + size, remaining, stream, small, b.segment, b, b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            if lst is None:
                lst = self._free[key] = []
            insort(lst, (remaining, rest.ptr, rest))
            rest.cached = True
            rest.gc_base = self._gc_calls[small]
        b.allocated = True
        self.allocated += b.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b

    def free(self, b: _Block) -> None:
        """The block's memory is reusable (free_completed): merged with free neighbours, back to its pool."""
        b.allocated = False
        self.allocated -= b.size
        lst = self._free.get(b.stream * 2 + b.small)
        if lst is None:
            lst = self._free[b.stream * 2 + b.small] = []
        nb = b.prev
        if nb is not None and nb.cached:  # _remove, inlined: a neighbour is in the same pool
            del lst[bisect_left(lst, (nb.size, nb.ptr))]
            nb.cached = False
            b.ptr, b.size, b.prev = nb.ptr, nb.size + b.size, nb.prev
            if nb.prev is not None:
                nb.prev.next = b
            else:
                self._segment_heads[b.segment] = b
        nb = b.next
        if nb is not None and nb.cached:
            del lst[bisect_left(lst, (nb.size, nb.ptr))]
            nb.cached = False
            b.size, b.next = b.size + nb.size, nb.next
            if nb.next is not None:
                nb.next.prev = b
        insort(lst, (b.size, b.ptr, b))
        b.cached = True
        b.gc_base = self._gc_calls[b.small]

    def empty_cache(self) -> None:
        """release_cached_blocks: every segment with no allocated block goes back to CUDA; with expandable segments
        (release_blocks -> unmap_block) the whole pages inside every free block are unmapped, and a segment left
        with nothing mapped is released."""
        if self.config.expandable_segments:
            for key in sorted(self._free):
                for _, _, b in list(self._free[key]):
                    self._unmap(b)
            return
        for seg, head in list(self._segment_heads.items()):
            if head.prev is None and head.next is None and self._is_cached(head):
                self._remove(head)
                self.reserved -= head.size
                self.segments -= 1
                del self._segment_heads[seg]

    # ---- segments ----
    def _new_segment(self, size: int, small: bool, stream: int) -> _Block:
        seg = next(self._ids)
        if self.addresses and self.addresses[0][1] == size:
            ptr = self.addresses.pop(0)[0]
        else:
            self._next_ptr -= size + (1 << 30)
            ptr = self._next_ptr
        b = _Block(ptr, size, stream, small, seg)
        self._segment_heads[seg] = b
        self.reserved += size
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return b

    # ---- expandable segments ----
    def _expand(self, size: int, small: bool, stream: int) -> _Block:
        """try_allocate_expandable_block: find_expandable_block, then map pages until the candidate holds
        ``size``; the candidate leaves the free pool."""
        c = self._find_expandable(size, small, stream)
        if not c.mapped:
            c = self._map(c, min(c.size, size))
        while c.size < size:  # free -> unmapped -> *: map_block maps some of the unmapped and merges the free
            nxt = c.next
            assert nxt is not None  # _find_expandable found a run of free and unmapped blocks of `size` bytes
            c = self._map(nxt, min(size - c.size, nxt.size))
        self._remove(c)
        return c

    def _find_expandable(self, size: int, small: bool, stream: int) -> _Block:
        """find_expandable_block: the lowest unmapped range (or the free block right before it) from which free
        and unmapped blocks run for ``size`` bytes; else a new segment, one unmapped range of the address space."""
        holes = self._unmapped.setdefault((small, stream), [])
        for _, c in holes:
            if c.prev is not None and c.prev.cached:
                c = c.prev
            run = 0
            b: _Block | None = c
            while run < size and b is not None and (b.cached or not b.mapped):
                run += b.size
                b = b.next
            if run >= size:
                return c
        seg = next(self._ids)
        page = SMALL_BUFFER if small else LARGE_BUFFER
        space = page * ADDRESS_PAGES
        self._next_ptr -= space + (1 << 30)
        c = _Block(self._next_ptr, space, stream, small, seg)
        c.mapped = False
        self._segment_heads[seg] = c
        self._pages[seg] = (c.ptr, page)
        self.segments += 1
        insort(holes, (c.ptr, c))
        return c

    def _map(self, b: _Block, size: int) -> _Block:
        """map_block: the pages covering ``size`` bytes at the start of the unmapped ``b``; the rest stays
        unmapped after it; the mapped block merges with free neighbours and joins the free pool."""
        page = self._pages[b.segment][1]
        mapped = -(-size // page) * page
        if self.device_limit is not None and self.reserved + mapped > self.device_limit:
            raise _NoRoom()  # the pages cannot be made (cuMemCreate fails): map_block returns false
        holes = self._unmapped[(b.small, b.stream)]
        del holes[bisect_left(holes, (b.ptr,))]
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.ptr + mapped, b.size - mapped, b.stream, b.small, b.segment, prev=b, next=b.next)
            rest.mapped = False
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = mapped
            insort(holes, (rest.ptr, rest))
        self._absorb_free_neighbours(b)
        self._insert(b)
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return b

    def _unmap(self, b: _Block) -> None:
        """unmap_block: the whole pages inside the free ``b`` are unmapped; what is left before and after them
        stays free; the unmapped range merges with unmapped neighbours; a segment with nothing mapped left is
        released (release_expandable_segment)."""
        base, page = self._pages[b.segment]
        begin = base + -(-(b.ptr - base) // page) * page
        end = base + (b.ptr + b.size - base) // page * page
        if begin >= end:
            return
        self._remove(b)
        if begin > b.ptr:
            before = _Block(b.ptr, begin - b.ptr, b.stream, b.small, b.segment, prev=b.prev, next=b)
            if b.prev is not None:
                b.prev.next = before
            else:
                self._segment_heads[b.segment] = before
            b.prev = before
            self._insert(before)
        if end < b.ptr + b.size:
            after = _Block(end, b.ptr + b.size - end, b.stream, b.small, b.segment, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = after
            b.next = after
            self._insert(after)
        b.ptr, b.size, b.mapped = begin, end - begin, False
        self.reserved -= b.size
        holes = self._unmapped[(b.small, b.stream)]
        for nb in (b.prev, b.next):
            if nb is not None and not nb.mapped:
                del holes[bisect_left(holes, (nb.ptr,))]
                self._merge(b, nb)
        if b.prev is None and b.next is None:
            del self._segment_heads[b.segment], self._pages[b.segment]
            self.segments -= 1
            return
        insort(holes, (b.ptr, b))

    def _absorb_free_neighbours(self, b: _Block) -> None:
        for nb in (b.prev, b.next):
            if nb is not None and nb.cached:
                self._remove(nb)
                self._merge(b, nb)

    def _merge(self, b: _Block, nb: _Block) -> None:
        """try_merge_blocks(b, nb): ``b`` takes in its neighbour ``nb``."""
        if nb is b.prev:
            b.ptr, b.prev = nb.ptr, nb.prev
            if nb.prev is not None:
                nb.prev.next = b
            else:
                self._segment_heads[b.segment] = b
        else:
            b.next = nb.next
            if nb.next is not None:
                nb.next.prev = b
        b.size += nb.size

    # ---- a new segment, under the device's limits ----
    def _room(self, alloc: int) -> bool:
        """alloc_block's checks before cudaMalloc: the fraction's allowed maximum, then the device's free bytes."""
        if self.fraction_limit is not None and self.reserved + alloc > self.fraction_limit:
            return False
        return self.device_limit is None or self.reserved + alloc <= self.device_limit

    def _alloc_block(self, size: int, small: bool, stream: int) -> _Block | None:
        """alloc_block: a new segment (or, with expandable segments, pages mapped), or None where the device or
        the fraction has no room for it."""
        alloc = allocation_size(size)
        if self.fraction_limit is not None and self.reserved + alloc > self.fraction_limit:
            return None  # checked with the whole allocation size, expandable segments too
        if self.config.expandable_segments:
            try:
                return self._expand(size, small, stream)
            except _NoRoom:
                return None
        if self.device_limit is not None and self.reserved + alloc > self.device_limit:
            return None
        return self._new_segment(alloc, small, stream)

    def _grow(self, size: int, small: bool, stream: int) -> _Block:
        """DeviceCachingAllocator::malloc once no cached block serves the request (c10/cuda/CUDACachingAllocator.cpp):
        garbage collection where a fraction and a threshold are set; alloc_block; else
        release_available_cached_blocks (with max_split_size: the oversize free blocks, largest first) and again;
        else release_cached_blocks (every free segment back to CUDA: a synchronising flush, counted in
        ``retries``) and again; else the CUDA out-of-memory error (OutOfMemory)."""
        if self._gc:
            self._garbage_collect()
        b = self._alloc_block(size, small, stream)
        if b is None and self.over is None:
            self._note_over(size, small, stream)
        if b is None and self._release_available(size, small, stream):
            b = self._alloc_block(size, small, stream)
        if b is None:
            self.empty_cache()
            self.retries += 1
            b = self._alloc_block(size, small, stream)
        if b is None:
            raise OutOfMemory(self, size)
        return b

    def _note_over(self, size: int, small: bool, stream: int) -> None:
        """``over``: the segment a replay without limits makes here (alloc_block's cudaMalloc), the block it hands
        out of it (split as malloc splits it), and the peaks they give."""
        alloc = allocation_size(size)
        whole = _Block(0, alloc, stream, small, -1)
        held = size if self._should_split(whole, size) else alloc
        self.over = (next(_OVER_COUNT), max(self.peak_reserved, self.reserved + alloc),
                     max(self.peak_allocated, self.allocated + held))

    def _release_available(self, size: int, small: bool, stream: int) -> bool:
        """release_available_cached_blocks: only with max_split_size set; the smallest free whole segment of the
        pool at least max(size, max_split_size), else the oversize ones from the largest down until enough are
        freed (a split or expandable block is never released)."""
        mss = self.config.max_split_size
        if mss is None:
            return False
        lst = self._free.get(stream * 2 + small) or []
        want = max(size, mss)
        j = bisect_left(lst, (want,))
        if j < len(lst) and not self._expandable(lst[j][2]):
            self._release(lst[j][2])
            return True
        released = 0
        k = min(j, len(lst)) - 1
        while k >= 0 and released < want and lst[k][0] >= mss:
            b = lst[k][2]
            k -= 1
            if not self._expandable(b):
                released += b.size
                self._release(b)
        return released >= want

    def _expandable(self, b: _Block) -> bool:
        return b.segment in self._pages

    def _release(self, b: _Block) -> None:
        """release_block: a free block that is its whole segment goes back to CUDA (a split one cannot)."""
        if b.prev is not None or b.next is not None:
            return
        self._remove(b)
        self.reserved -= b.size
        self.segments -= 1
        del self._segment_heads[b.segment]

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: past garbage_collection_threshold x the fraction's maximum, free the large
        pool's whole free segments whose age (get_free_block calls since they were cached) is at least the
        average, again until the excess is reclaimed or none is freed."""
        assert self.fraction_limit is not None
        threshold = int(self.config.garbage_collection_threshold * self.fraction_limit)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        calls = self._gc_calls[0]
        blocks = [b for key in sorted(k for k in self._free if k % 2 == 0) for _, _, b in self._free[key]
                  if b.prev is None and b.next is None]
        total_age, count = sum(calls - b.gc_base for b in blocks), len(blocks)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age = total_age / count
            freed = False
            for b in [b for key in sorted(k for k in self._free if k % 2 == 0) for _, _, b in self._free[key]]:
                if b.prev is None and b.next is None and not self._expandable(b) and calls - b.gc_base >= age:
                    freed = True
                    reclaimed += b.size
                    total_age -= calls - b.gc_base
                    count -= 1
                    self._release(b)


class OutOfMemory(Exception):
    """The CUDA out-of-memory error: no segment could be reserved for a request after every flush and retry."""

    def __init__(self, allocator: Allocator, size: int) -> None:
        super().__init__(size)
        self.allocator = allocator
        self.size = size


class _NoRoom(Exception):
    """Mapping an expandable segment's pages would pass the device's limit."""


def replay(events: Iterable[Sequence[Any]], config: AllocatorConfig | None = None) -> Allocator:
    """Replay a recorded allocator event stream ([action, address, size, stream] per event, as
    torch.cuda.memory._snapshot()'s device_traces give them): every ``alloc`` is served by this model's
    decisions, every ``free_completed`` returns its block; a ``segment_free`` (``segment_unmap`` with expandable
    segments) the model did not make itself is an empty_cache() (DeepSpeed calls it) and releases the free
    segments (unmaps the free pages)."""
    a = Allocator(config or AllocatorConfig())
    a.addresses = [(addr, size) for action, addr, size, _ in events if action == "segment_alloc"]
    live: dict[int, _Block] = {}
    for action, addr, size, stream in events:
        if action == "alloc":
            live[addr] = a.malloc(size, stream)
        elif action == "free_completed":
            b = live.pop(addr, None)
            if b is not None:
                a.free(b)
        elif action in ("segment_free", "segment_unmap"):
            a.empty_cache()
    return a

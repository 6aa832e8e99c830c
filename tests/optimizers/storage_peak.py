"""A dispatch mode that counts every storage an op makes until it dies (the tests that hold memplan's step models
to the bytes torch's own code allocates: test_muon.py, test_apollo.py, test_galore.py, test_muon_aux_adam.py), and
the helpers those tests share (ListInventory, storage_step_peaks, profiler_peaks, low_rank_states). Needs torch; import it after
pytest.importorskip("torch")."""

from __future__ import annotations

import weakref
from typing import Any


def storage_peak() -> Any:
    """A fresh counter: ``with counter:`` counts; ``counter.cur`` the live bytes it saw made, ``counter.peak`` the
    most at once (``reset_peak()`` starts a new maximum from what is live), ``counter.outside`` storages not to
    count (made before: a gradient's ``.data`` is a new tensor on an old storage)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class StoragePeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.cur = self.peak = 0
            self.seen: set[int] = set()
            self.outside: set[int] = set()

        def reset_peak(self) -> None:
            self.peak = self.cur

        def _gone(self, key: int, n: int) -> None:
            self.seen.discard(key)
            self.cur -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if key and key not in self.seen and key not in self.outside:
                        self.seen.add(key)
                        self.cur += st.nbytes()
                        self.peak = max(self.peak, self.cur)
                        weakref.finalize(st, self._gone, key, st.nbytes())
            return out

    return StoragePeak()


def profiler_peaks(step: Any, steps: int, before: Any = None) -> list[int]:
    """Each call of ``step`` (``before`` run first, outside the measure), its most live CPU allocator bytes beyond
    what was live when it began: every block c10's CPU allocator hands out, kernels' own included (the harness's
    instrument, memplan/harness/measure.py), where storage_peak sees ops' outputs only."""
    import json
    import tempfile

    import torch

    from memplan.harness.measure import live_totals

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(steps):
            if before is not None:
                before()
            with torch.profiler.record_function(f"memplan-test-step-{i}"):
                step()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        events = json.load(open(fh.name))["traceEvents"]
    totals = live_totals(events, global_totals=False)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("memplan-test-step-"))
    peaks = []
    for a, b in spans:
        start = next((v for t, v in reversed(totals) if t < a), 0)
        peaks.append(max((v for t, v in totals if a <= t <= b), default=start) - start)
    return peaks


class ListInventory:
    """An inventory of the given tensors only (the step models read ``inv.tensors``)."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors


def storage_step_peaks(model: Any, opt: Any, steps: int = 3) -> list[int]:
    """Each of ``steps`` optimizer steps' most live storage bytes beyond what existed before it (storage_peak),
    fresh random gradients before each; the parameters' and gradients' own storages are not counted (``.data``
    of a gradient is a new tensor on its storage)."""
    import torch

    count = storage_peak()
    peaks = []
    torch.manual_seed(0)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        count.outside = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)}
        base = count.cur
        count.reset_peak()
        with count:
            opt.step()
        peaks.append(count.peak - base)
    return peaks


def low_rank_states(inv: Any, targets: tuple[bool, ...], rank: int, nbytes: int, per_matrix: int = 0) -> int:
    """A low-rank optimizer's states (GaLore, APOLLO): AdamW's two per plain tensor; per projected matrix [m, n]
    its projection ([r, n] for m >= n, else [m, r]) and two low-rank moments, plus ``per_matrix`` bytes."""
    out = 0
    for t, projected in zip(inv.tensors, targets):
        if not projected:
            out += 2 * nbytes * t.numel
            continue
        m, n = t.shape
        out += nbytes * (rank * n + 2 * m * rank if m >= n else m * rank + 2 * rank * n) + per_matrix
    return out

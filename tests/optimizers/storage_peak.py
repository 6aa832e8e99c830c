"""A dispatch mode that counts every storage an op makes until it dies (the tests that hold memplan's step models
to the bytes torch's own code allocates: test_muon.py, test_apollo.py). Needs torch; import it after
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

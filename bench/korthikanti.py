"""Saved-for-backward bytes of one GPT-2 block, grouped by the op that made each storage, against Korthikanti
et al. (2022)'s 34sbh + 5as^2b (docs/accuracy.md, "The GPT-2 block against Korthikanti").

    python bench/korthikanti.py [--seq 1024] [--attention eager|sdpa] [--device cuda|cpu]

Traces like memplan/activations/tracing/ (fake tensors, saved_tensors_hooks, bf16, micro-batch 1) at depths 1 and 2; the
block is the difference. ``--device cuda`` swaps in CUDA's 1-byte dropout mask (memplan.activations.substitutes.cuda_dropout);
``cpu`` keeps ATen's CPU dropout, whose mask has the input's dtype.
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def saved_by_op(config: dict, layers: int, seq: int, attention: str) -> collections.Counter:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import AutoModelForCausalLM

    from memplan.model.scaling import scale_config
    from memplan.model.meta_builder import hf_config

    made: dict[int, tuple[tuple, object]] = {}  # storage id -> (op, dtype, shape), weakref to the storage

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if id(st) not in made or made[id(st)][1]() is None:  # ids are reused once a storage dies
                        made[id(st)] = ((func.__name__, str(t.dtype).replace("torch.", ""), tuple(t.shape)),
                                        weakref.ref(st))
            return out

    saved: dict[int, tuple[int, tuple]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(hf_config(scale_config(config, layers=layers)[0]),
                                                 attn_implementation=attention, dtype=torch.bfloat16)
        model.train()
        params = {id(p.untyped_storage()) for p in model.parameters()}

        def pack(t):  # noqa: ANN001, ANN202
            st = t.untyped_storage()
            if id(st) not in params:
                saved.setdefault(id(st), (st.nbytes(), made[id(st)][0] if id(st) in made else ("input", "", ())))
            return t

        with Made(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.transformer(input_ids=torch.zeros(1, seq, dtype=torch.long))
    out: collections.Counter = collections.Counter()
    for nbytes, key in saved.values():
        out[key] += nbytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--attention", choices=("eager", "sdpa"), default="eager")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()

    import torch.nn.functional as F

    from memplan.model import sources
    from memplan.activations.substitutes import cuda_dropout as _cuda_dropout

    if args.device == "cuda":
        F.dropout = _cuda_dropout()
    config = sources.resolve("gpt2").config
    block = saved_by_op(config, 2, args.seq, args.attention)
    block.subtract(saved_by_op(config, 1, args.seq, args.attention))
    total = 0
    for key, nbytes in sorted(block.items(), key=lambda kv: -kv[1]):
        if nbytes:
            print(f"{nbytes:>14,}  {key}")
            total += nbytes
    s, b, h, a = args.seq, 1, config["n_embd"], config["n_head"]
    print(f"block total {total:,}; Korthikanti 34sbh + 5as^2b = {34 * s * b * h + 5 * a * s * s * b:,}; "
          f"sbh = {s * b * h:,}; as^2b = {a * s * s * b:,}")


if __name__ == "__main__":
    main()

"""Saved-for-backward bytes of one GPT-2 block, grouped by the op that made each storage, against Korthikanti
et al. (2022)'s 34sbh + 5as^2b (docs/accuracy.md, "The GPT-2 block against Korthikanti").

    python bench/korthikanti.py [SEQ] [ATTENTION eager|sdpa] [cuda|cpu]

Traces like memplan/tracing.py (fake tensors, saved_tensors_hooks, bf16), at depths 1 and 2; the block is the
difference. "cuda" swaps in CUDA's 1-byte dropout mask (memplan.tracing._cuda_dropout).
"""

import json, sys, collections
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM
from memplan.model import sources
from memplan.model.meta_builder import hf_config
from memplan.harness.spec import scale_config
s_len, b = int(sys.argv[1]) if len(sys.argv) > 1 else 1024, 1
base = sources.resolve("gpt2").config

import torch.nn.functional as F
from memplan.tracing import _cuda_dropout
if len(sys.argv) > 3 and sys.argv[3] == "cuda":
    F.dropout = _cuda_dropout()
def run(layers):
    cfg = hf_config(scale_config(base, layers=layers)[0])
    made = {}
    class M(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    k = id(t.untyped_storage())
                    if k not in made or made[k][1]() is None:
                        made[k] = ((func.__name__, str(t.dtype).replace("torch.", ""), tuple(t.shape)), __import__("weakref").ref(t.untyped_storage()))
            return out
    saved = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=(sys.argv[2] if len(sys.argv) > 2 else "sdpa"), dtype=torch.bfloat16)
        model.train()
        params = {id(p.untyped_storage()) for p in model.parameters()}
        def pack(t):
            st = t.untyped_storage()
            if id(st) not in params:
                saved.setdefault(id(st), (st.nbytes(), made[id(st)][0] if id(st) in made else ("input", "", ())))
            return t
        ids = torch.zeros(b, s_len, dtype=torch.long)
        with M():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h = model.transformer(input_ids=ids).last_hidden_state
    agg = collections.Counter()
    for k, (n, (op, dt, shp)) in saved.items():
        agg[(op, dt, shp)] += n
    return agg

one, two = run(1), run(2)
diff = collections.Counter(two); diff.subtract(one)
tot = 0
for k, v in sorted(diff.items(), key=lambda kv: -kv[1]):
    if v:
        print(f"{v:>14,}  {k}"); tot += v
h, a = 768, 12
kor = s_len * b * h * 34 + 5 * a * s_len * s_len * b
print(f"block total {tot:,}; Korthikanti 34sbh + 5as^2b = {kor:,}; sbh = {s_len*b*h:,}; as^2b = {a*s_len*s_len*b:,}")

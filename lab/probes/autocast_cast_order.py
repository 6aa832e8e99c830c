"""The order in which PyTorch's AutocastCUDA kernels cast their arguments, probed on this machine (no GPU).

    python lab/probes/autocast_cast_order.py

memplan.activations.substitutes.CudaAutocast runs each op's real AutocastCUDA kernel on fake CUDA tensors and records its
_to_copy calls. The record's order shows the compiled kernels cast right to left (C++ leaves the evaluation order of
a call's arguments unspecified; GCC on x86-64 evaluates them right to left): linear casts its bias, then its weight,
then its input. CudaAutocast._apply still casts left to right, so a GPU torch-amp trace makes each input's bf16
copy before the weight's, the reverse of the run: bench/gpu/traces/phi2_ddp_amp (recorded on the H100) first parts
from the replay there (the 13,107,200 B weight cast before the input's). Casting in the recorded order lines the
stream up to the loss (its first difference moves from the 56th to the 531st allocation over 1 MiB), but it changes
the shipped torch-amp GPU profiles' event order, which must then be traced again: not done yet (session 23).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from memplan.activations.substitutes import CudaAutocast

    with CudaAutocast("bfloat16") as ca:
        x = torch.randn(4, 8)
        w = torch.randn(16, 8, requires_grad=True)
        b = torch.randn(16, requires_grad=True)
        m = torch.randn(2, 4, 8)
        probes = {"linear(input, weight, bias)": (torch.ops.aten.linear.default, (x, w, b)),
                  "linear(input, weight)": (torch.ops.aten.linear.default, (x, w)),
                  "matmul(input, other)": (torch.ops.aten.matmul.default, (x, w.t())),
                  "addmm(bias, mat1, mat2)": (torch.ops.aten.addmm.default, (b, x, w.t())),
                  "bmm(input, mat2)": (torch.ops.aten.bmm.default, (m, m.transpose(1, 2)))}
        for name, (op, args) in probes.items():
            casts, _ = ca._probe(op, args, {})
            print(f"{name:30} casts arguments in the order {list(casts)}")


if __name__ == "__main__":
    main()

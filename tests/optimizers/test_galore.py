"""GaLore (--optimizer galore-adamw): galore-torch's GaLoreAdamW step, its allocations counted on the real step."""

from __future__ import annotations

import pytest
from test_apollo import _inventory, _model

from memplan import options
from memplan.errors import SettingsError
from memplan.precision import GALORE_RANK, galore_states, galore_step, get_recipe, low_rank_tensors, step_events_peak
from memplan.request import JobRequest

torch = pytest.importorskip("torch")

from storage_peak import low_rank_states  # noqa: E402


def _measured_peaks(model, dtype, gap: int) -> list[int]:
    """Each of three steps' most live CPU allocator bytes beyond what was live before it (the profiler, as the
    harness measures: torch.linalg.svd's own column-major copy and MKL's block are inside the kernel, where a
    dispatch-level counter does not see them), the param groups as transformers' Trainer makes them
    (harness/setup.py galore_optimizer). LAPACK's work array is a std::vector: not the allocator's."""
    from storage_peak import profiler_peaks

    from memplan.harness.setup import galore_optimizer

    model = model.to(dtype)
    opt = galore_optimizer(model)
    for g in opt.param_groups[1:]:
        g["update_proj_gap"] = gap
    torch.manual_seed(0)

    def grads() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)

    return profiler_peaks(opt.step, 3, grads)


@pytest.mark.parametrize("dtype,recipe", [("float32", "fp32"), ("bfloat16", "pure-bf16")])
def test_galore_step_is_galore_torch_s(dtype, recipe):
    """The first step (states made, the SVD projections), an update step after it (update_proj_gap 1: the SVD
    again, the new projection replacing the old) and a plain step: galore_step's peak equals the real step's to
    the byte. The model has square (q, o) and wide and tall (up, down) matrices: both of GaLore's sides, and fp32
    keeps the whole Vh or U its projection is a view of. To the byte but for the 1-byte bools of the SVD's error
    check and the step's 0-dim scalars (under 16 bytes). The projections' bf16 GEMMs allocate oneDNN's scratch
    on this CPU's instruction set where it has one for the shapes (kernels.py cpu_gemm_scratch: none on AVX512-BF16
    or AMX here; fp32 copies on plain AVX512), as the engine counts it (precision.per_tensor_step_scratch)."""
    pytest.importorskip("galore_torch")  # in the test extra (pip install -e ".[test]")
    from memplan.activations.kernels import cpu_gemm_scratch, host_cpu_isa

    model = _model()
    inv = _inventory(model)
    rc = get_recipe(recipe)
    isa = host_cpu_isa()

    def gemm(m: int, n: int, k: int) -> int:
        return cpu_gemm_scratch(isa, m, n, k, "bfloat16")

    first, update, plain = (step_events_peak(galore_step(inv, rc, first=f, update=u, cpu=True,
                                                         gemm=gemm if dtype == "bfloat16" else None))
                            for f, u in ((True, True), (False, True), (False, False)))
    m_update = _measured_peaks(_model(), getattr(torch, dtype), gap=1)
    m_plain = _measured_peaks(_model(), getattr(torch, dtype), gap=1000)
    assert 0 <= m_update[0] - first < 16 and 0 <= m_plain[0] - first < 16
    assert 0 <= m_update[1] - update < 16 and 0 <= m_update[2] - update < 16
    assert 0 <= m_plain[1] - plain < 16 and 0 <= m_plain[2] - plain < 16


@pytest.mark.parametrize("dtype,recipe", [("float32", "fp32"), ("bfloat16", "pure-bf16")])
def test_galore_states_are_what_the_optimizer_keeps(dtype, recipe):
    """After the first step: the states and projections the real optimizer holds, to the byte."""
    pytest.importorskip("galore_torch")
    from memplan.harness.setup import galore_optimizer

    model = _model().to(getattr(torch, dtype))
    opt = galore_optimizer(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    held = {}
    for st in opt.state.values():
        for v in st.values():
            tensors = [v] if isinstance(v, torch.Tensor) else [v.ortho_matrix] if hasattr(v, "ortho_matrix") else []
            for t in tensors:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert galore_states(_inventory(model), get_recipe(recipe)) == sum(held.values())


def test_galore_groups_and_states(inventories):
    """llama-7b in bf16: the attention and MLP weights projected (rank 128: the projection [r, n] or [m, r] and the
    low-rank moments), the rest plain AdamW."""
    inv = inventories("llama-7b")
    s = options.resolve(inv, JobRequest.of(gpus=1, precision="pure-bf16", optimizer="galore-adamw",
                                           activations="analytic")).settings
    assert galore_states(inv, s.recipe) == low_rank_states(inv, low_rank_tensors(inv), GALORE_RANK, 2)


def test_galore_refused_on_sharded_parameters_and_without_targets(inventories):
    with pytest.raises(SettingsError, match="GaLore projects each whole matrix"):
        options.resolve(inventories("llama-7b"), JobRequest.of(gpus=8, strategy="fsdp-full", optimizer="galore",
                                                               activations="analytic"))
    with pytest.raises(SettingsError, match="No target modules found"):
        options.resolve(inventories("gpt2"), JobRequest.of(gpus=1, optimizer="galore-adamw", activations="analytic"))

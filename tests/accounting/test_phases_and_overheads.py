"""The plan's phases and moments read against the activation profile, and the memory beside the model (CUDA context, cuBLAS workspaces, cluster checks)."""

import pytest
from toy import PSI, TOY, settings

from memplan import accounting as A
from memplan.errors import SettingsError
from memplan.precision import get_optimizer, get_recipe
from memplan.request import JobRequest
from memplan.strategies import get_strategy
from memplan.timeline import Moment

M = Moment


def test_offload_moves_states_to_host():
    plan = A.estimate(TOY, settings("zero3", 8, ds={"param_persistence_threshold": 0, "offload_optimizer": True}))
    assert plan.peak.optimizer_states_bytes == 0 and plan.peak.master_weights_bytes == 0
    # master + Adam states (12 bytes) and the fp32 + bf16 grad partitions (6 bytes) per element, 8 ranks a node
    assert plan.host_bytes_per_node == 8 * (18 * PSI // 8)


def test_overheads_separate_and_cpu_has_none():
    gpu = A.estimate(TOY, settings("zero2", 8))
    assert gpu.overhead_bytes > 0 and gpu.required_bytes == gpu.peak_bytes + gpu.overhead_bytes
    cpu = A.estimate(TOY, A.Settings(**{**settings("zero2", 8).__dict__,
                                          "cluster": A.Cluster(gpus=8, gpus_per_node=8, device="cpu")}))
    assert cpu.overhead_bytes == 0


@pytest.mark.parametrize("kw,match", [({"gpus": 0}, "at least 1"), ({"gpus": 12, "gpus_per_node": 8}, "multiple"),
                                      ({"gpus": 2, "device": "tpu"}, "cuda or cpu")])
def test_bad_cluster(kw, match):
    with pytest.raises(SettingsError, match=match):
        A.Cluster(**kw)


def test_bad_sizes():
    with pytest.raises(SettingsError, match="micro-batch"):
        settings("ddp", 1, micro_batch=0)


def test_cublas_workspaces_are_inside_the_peak_on_cuda_only():
    # two handles (forward thread, autograd thread), each with its workspace from the caching allocator, kept
    ws = 32 * 1024 * 1024
    base = A.estimate(TOY, settings("fsdp-full", 4))
    cuda = A.estimate(TOY, settings("fsdp-full", 4, blas_workspace_bytes=ws))
    assert [c.buffers_bytes - b.buffers_bytes for b, c in zip(base.phases, cuda.phases)] == [2 * ws] * 5
    assert cuda.between_steps_bytes - base.between_steps_bytes == 2 * ws
    cpu = A.Settings(strategy=get_strategy("fsdp-full"), recipe=get_recipe("fsdp-bf16"),
                     optimizer=get_optimizer("adamw"), cluster=A.Cluster(gpus=4, device="cpu"))
    assert "blas_workspace" not in A.estimate(TOY, cpu).assumptions


def test_gpu_presets_carry_pytorchs_default_cublas_workspace():
    from memplan.model.sources import gpu_presets

    for name, g in gpu_presets().items():
        assert g.blas_workspace_bytes == A.default_blas_workspace(g.arch), name
    assert A.default_blas_workspace("sm90") == 32 * 1024 * 1024
    assert A.default_blas_workspace("sm80") == 8 * 1024 * 1024 + 128 * 1024
    assert A.default_blas_workspace("gfx942") == 128 * 1024 * 1024


def test_cublas_workspace_from_the_gpu_preset_or_the_option():
    from memplan import options

    inv = TOY
    h100 = options.resolve(inv, JobRequest.of(gpus=8, stage=3, gpu="h100-80g")).settings.cluster.blas_workspace_bytes
    a100 = options.resolve(inv, JobRequest.of(gpus=8, stage=3, gpu="a100-80g")).settings.cluster.blas_workspace_bytes
    assert (h100, a100) == (32 * 1024 * 1024, 4096 * 1024 * 2 + 16 * 1024 * 8)
    given = options.resolve(inv, JobRequest.of(gpus=8, stage=3, gpu="h100-80g", blas_workspace_bytes=4096 * 1024))
    assert given.settings.cluster.blas_workspace_bytes == 4096 * 1024
    bare = options.resolve(inv, JobRequest.of(gpus=8, stage=3))
    assert bare.settings.cluster.blas_workspace_bytes == 32 * 1024 * 1024
    assert any("cuBLAS workspace" in n for n in bare.notes)


class _StubProfile:
    """An activation profile with chosen numbers at each named moment (activations.TracedProfile's interface)."""

    source = "stub"
    includes_autocast_copies = True

    def __init__(self):
        self._memo = {}

    def terms(self, recompute, b):
        from memplan.activations import Terms

        return Terms(forward=10 * b, backward_start=1000 * b, saved_less_block=50 * b, left_at_end=0, block=5 * b)

    def block_moments(self, b, width, held):
        return ((100 * b, 10), (50 * b, 10), (20 * b, 10))

    def moment_activations(self, b):
        return {-5: 7 * b, -12: 3 * b}

    def loss_moment(self, b, width):
        return (300 * b, 40)

    def block_hooks(self, b):
        return (((5 * b, 64), (9 * b, 16)), ((1, 8),), ())


def test_moment_kinds_read_the_profile_exactly():
    # each named moment on a stub profile: the head's GEMM at the recipe's grad width, the offload hook at the
    # hook that tops activations + per-element transient x partition, block moments with their grads, named
    # moments as read
    from dataclasses import replace

    M = Moment
    s = replace(settings("zero3", 4, ds={"param_persistence_threshold": 0, "offload_optimizer": True,
                                         "reduce_bucket_size": 70}),
                activation_profile=_StubProfile(), micro_batch=2)
    vals = {e.moment.at: (e.activations, e.own_bytes) for e in A.evaluate_moments(TOY, s)}
    assert vals[M.LOSS_BACKWARD] == (600, 2 * 40)
    # the bucket (70 elements) takes the 64-element gradient, the 16-element one overflows it: its reduce at that
    # hook (activations 18, its own 16-element gradient beside), the 64-element gradient's partition copied back
    # on the GPU (2) and in fp64 (8)
    assert vals[M.BLOCK_GRADIENT_HOOK] == (18, 2 * 16 + (2 + 8) * (64 // 4))
    assert vals[M.ROOT_LAST_HOOK_BEFORE_BLOCKS] == (6, 0)
    assert vals[M.INSIDE_LAST_BLOCK_BACKWARD] == (200, 20) and vals[M.INSIDE_FIRST_BLOCK_BACKWARD] == (40, 20)
    assert [e.moment for e in A.evaluate_moments(TOY, s)] == list(A.timeline(TOY, s).moments)


def test_backward_start_is_the_loss_moment_where_block_moments_are_evaluated():
    # the profile's backward-start term is the most alive anywhere in backward (with recompute: inside a block);
    # where the blocks' own moments are evaluated, the loss moment alone is the backward-start phase
    from dataclasses import replace

    class Stub(_StubProfile):
        def block_moments(self, b, width, held):
            return ((900 * b, 10), (800 * b, 10), (700 * b, 10))

        def moment_activations(self, b):
            return {}

        def block_hooks(self, b):
            return ()

    for strategy, covered in (("zero3", True), ("ddp", True), ("zero0", True)):
        s = replace(settings(strategy, 4), activation_profile=Stub(), recompute="full", micro_batch=2,
                    cluster=A.Cluster(gpus=4, device="cpu"))
        start = A.estimate(TOY, s).phases[1]
        assert start.name == "backward-start"
        if covered:
            grads = A.timeline(TOY, s).grads["backward-start"]
            assert start.activations_bytes == 600 and start.grads_bytes == grads + s.recipe.grad_bytes * 40
        else:
            assert start.activations_bytes == 2000  # stage 0 evaluates no block moments: the whole term stays

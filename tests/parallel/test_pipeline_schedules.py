"""memplan/parallel/schedules.py's action lists against torch's own (torch.distributed.pipelining._schedule_visualizer
get_schedule_ops: the schedule classes' pipeline_order, built with mock stages, no process group)."""

import pytest

from memplan.parallel import schedules
from memplan.errors import SettingsError

torch_vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")



def _kind(t) -> str:
    return {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}[t.name]


CASES = [(s, pp, m, 1) for s in ("gpipe", "1f1b") for pp in (2, 3, 4, 8) for m in (pp - 1, pp, pp + 1, 2 * pp,
                                                                                    3 * pp + 2)]
CASES += [(s, pp, m, v) for s in ("interleaved", "interleaved-zb", "looped-bfs") for pp in (2, 3, 4, 8)
          for m in (pp - 1, pp, pp + 1, 2 * pp, 4 * pp, 3 * pp + 2) for v in (2, 3, 4)]
CASES += [(s, pp, m, 2) for s in ("zbv", "dualpipev") for pp in (2, 3, 4, 8)
          for m in (pp, 2 * pp - 1, 2 * pp, 2 * pp + 3, 4 * pp)]


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_action_lists_are_torchs(schedule, pp, m, v):
    try:
        schedules.check(schedule, pp, m, v)
    except SettingsError:
        if schedule != "1f1b":  # Schedule1F1B checks in its constructor, which get_schedule_ops does not reach
            with pytest.raises(ValueError):
                torch_vis.get_schedule_ops(schedules.TORCH_NAMES[schedule], pp, m, v)
        return
    theirs = []
    for rank_ops in torch_vis.get_schedule_ops(schedules.TORCH_NAMES[schedule], pp, m, v):
        ops = []
        for a in rank_ops:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                if sub.computation_type.name not in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"):
                    continue  # REDUCE_GRAD, after every backward
                ops.append((sub.stage_index, _kind(sub.computation_type), sub.microbatch_index))
        theirs.append(ops)
    ours = [list(schedules.rank_actions(schedule, pp, m, v, r)) for r in range(pp)]
    if schedule == "1f1b":
        # Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1 (forward_mb += 1 before its
        # first use when there is no warm-up); _step_microbatches, which is what runs, forwards 0, 1, ... there
        assert ours[-1] == [(pp - 1, k, i) for i in range(m) for k in "FB"]
        ours, theirs = ours[:-1], theirs[:-1]
    assert ours == theirs


def test_names():
    assert schedules.canonical("Interleaved1F1B") == "interleaved"
    assert schedules.canonical("zero-bubble") == "zbv"
    assert schedules.canonical("DualPipeV") == "dualpipev"
    assert schedules.canonical("nope") is None


def test_held_moments_one_f_one_b():
    # rank 0 of 4 holds 4 micro-batches at its first backward, then 4 through the steady state, then fewer
    held = [h[0][0] for h in schedules.held_moments("1f1b", 4, 8, 1, 0)]
    assert held == [4, 4, 4, 4, 4, 3, 2, 1]
    assert [h[0][0] for h in schedules.held_moments("gpipe", 4, 8, 1, 3)] == [8, 7, 6, 5, 4, 3, 2, 1]


def test_backward_moments_know_the_stages_accumulated():
    # looped BFS, 2 ranks of 2 stages, 4 micro-batches: rank 0 runs every forward of stage 0, then of stage 2,
    # then the backwards of stage 2 (its accumulators from the first on), then those of stage 0
    got = schedules.backward_moments("looped-bfs", 2, 4, 2, 0)
    assert [m[:3] for m in got] == schedules.held_moments("looped-bfs", 2, 4, 2, 0)
    assert [(m[1], m[3]) for m in got] == [(1, (False, False))] + [(1, (False, True))] * 3 + \
        [(0, (False, True))] + [(0, (True, True))] * 3
    # a split backward accumulates at its weight step (W), not at the input step (I)
    zb = schedules.backward_moments("zbv", 2, 4, 2, 1)
    assert zb[0] == ((2, 2), 1, "I", (False, False)) and all(m[2] == "I" for m in zb)


def test_deepspeeds_train_schedule_runs_the_same_1f1b():
    # DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/schedule.py TrainSchedule, read off its steps(): the
    # ForwardPass and BackwardPass commands of each stage) runs 1F1B's order, and runs fewer micro-batches than
    # stages too, which torch's Schedule1F1B refuses: each stage's warm-up capped at the micro-batches
    def order(pp, m, r):
        return "".join(k for _, k, _ in schedules.rank_actions("1f1b", pp, m, 1, r))

    assert [order(4, 2, r) for r in range(4)] == ["FFBB", "FFBB", "FFBB", "FBFB"]
    assert [order(3, 5, r) for r in range(3)] == ["FFFBFBFBBB", "FFBFBFBFBB", "FBFBFBFBFB"]
    assert [order(4, 8, r) for r in range(4)] == ["FFFFBFBFBFBFBBBB", "FFFBFBFBFBFBFBBB", "FFBFBFBFBFBFBFBB",
                                                  "FBFBFBFBFBFBFBFB"]
    assert schedules.rank_actions("1f1b", 4, 2, 1, 0) == ((0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1))

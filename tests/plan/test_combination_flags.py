

def test_a_combination_names_each_option_once():
    # a smaller micro-batch and more pipeline stages both set --grad-accum (to the same value: merged() refuses
    # two values): the combined command names it once
    from memplan.advice import flags_once

    assert flags_once(["--micro-batch", "2", "--grad-accum", "16", "--pp", "16", "--grad-accum", "16"]) == (
        "--micro-batch", "2", "--grad-accum", "16", "--pp", "16")
    assert flags_once(["--cpu-offload", "--stage", "3", "--cpu-offload"]) == ("--cpu-offload", "--stage", "3")

"""Context parallelism (--cp): the layout's shards and sequence, the ring's traffic and the bad inputs."""

from __future__ import annotations

import json
import re

import pytest

from memplan import accounting, options, parallel as par
from memplan.comm import model_parallel
from memplan.errors import SettingsError
from memplan.model import sources
from memplan.request import JobRequest

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 512, "num_hidden_layers": 2, "vocab_size": 1000,
         "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def _inv(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    return sources.build_inventory(sources.resolve(str(path)), builder="analytic")


def _settings(inv, p, **kw):
    kw.setdefault("strategy", "fsdp-full")
    return options.resolve(inv, JobRequest.of(activations="analytic", device="cpu", parallel=p, **kw)).settings


def test_parameters_over_dp_x_cp_and_a_sequence_share(tmp_path):
    """torchtitan folds cp into the FSDP mesh: the model states of cp x dp ranks are those of as many
    data-parallel ranks; each rank computes seq / cp tokens of each sequence."""
    inv = _inv(tmp_path)
    plain = accounting.estimate(inv, _settings(inv, None, gpus=8, seq_len=1024))
    cp = accounting.estimate(inv, _settings(inv, par.Parallel(cp=4), gpus=8, seq_len=4096))
    for k in ("weights_bytes", "optimizer_states_bytes"):
        assert getattr(cp.peak, k) == getattr(plain.peak, k)
    lay = cp.layout
    assert lay.dp == 8 and lay.ranks[0][2].seq_len == 1024 and lay.report()["dp"] == 2
    assert lay.report()["cp"] == 4


def test_the_analytic_profile_adds_the_rings_bound(tmp_path):
    """Without a trace, the ring's transient (parallel.ring_attention) is added on top of seq / cp tokens'
    activations: forward 4K + 2 cp K + Q + 2 Qf + 2 lse for a key of K bytes and a query of Q."""
    fwd, bwd = par.ring_attention({"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}, par.Parallel(cp=4), 1024, 2)
    K, Q = 1024 * 2 * 64 * 2, 1024 * 4 * 64 * 2
    assert fwd == 4 * K + 8 * K + Q + 4 * Q + 2 * 4 * 1024 * 4
    assert bwd == 2 * Q + 2 * 2 * K + 6 * K + 8 * K + Q + 6 * 2 * K
    assert par.ring_attention({"hidden_size": 256, "num_heads": 4}, par.Parallel(), 1024, 2) == (0, 0)


@pytest.mark.parametrize("kw,msg", [
    (dict(gpus=6, p=par.Parallel(cp=4)), "not a multiple of tp(1) x pp(1) x cp(4) = 4"),
    (dict(gpus=4, p=par.Parallel(cp=4), seq_len=1004), "--cp 4 does not divide the sequence: --seq-len 1004"),
    (dict(gpus=4, p=par.Parallel(cp=2), stage=3, strategy=None), "--cp with --strategy zero3"),
    (dict(gpus=4, p=par.Parallel(cp=2), attention="eager"), "--attention eager has none"),
    (dict(gpus=4, p=par.Parallel(cp=0)), "--cp must be at least 1"),
])
def test_bad_context_layouts(tmp_path, kw, msg):
    inv = _inv(tmp_path)
    p = kw.pop("p")
    with pytest.raises(SettingsError, match=re.escape(msg)):
        _settings(inv, p, **kw)


def test_ring_traffic(tmp_path):
    """Per attention layer and micro-batch: k and v all-gathered over the CP ranks in forward and backward
    ((cp - 1) x 2K sent each), and the fp32 dk, dv passed on at each of the cp backward steps."""
    inv = _inv(tmp_path)
    s = _settings(inv, par.Parallel(cp=4), gpus=8, seq_len=4096, micro_batch=2, grad_accum=3)
    lay = accounting.estimate(inv, s).layout
    rows = {x["op"]: x for x in model_parallel(lay, 0)}
    K = 2 * 1024 * 2 * 64 * 2
    assert rows["all-gather"]["times_per_step"] == 3 * 2 * 2 and rows["all-gather"]["group_size"] == 4
    assert rows["all-gather"]["bytes_per_gpu"] == 3 * 2 * 2 * 3 * 2 * K
    assert rows["send"]["times_per_step"] == 3 * 2 * 4 and rows["send"]["bytes_per_gpu"] == 3 * 2 * 4 * 2 * 2 * K

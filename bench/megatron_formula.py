"""memplan's Megatron-DeepSpeed layout against Megatron-LM's own theoretical memory formula, for the first pipeline
stage of large tensor x pipeline layouts (issue 17's cross-check), each difference explained.

    python bench/megatron_formula.py          # prints the markdown table docs/accuracy.md carries

Megatron's formula (megatron/training/theoretical_memory_usage.py, NVIDIA/Megatron-LM main): weights and optimizer
= the most loaded shard's parameters ((blocks / pp + embedding) / tp) x (18 bytes, or 6 + 12 / dp with the
distributed optimizer); activations of the first stage with sequence parallelism and selective recompute = s b h
(18 + 4 ffn / h) per block x all blocks x (in-flight factor min(1, m / pp)), / tp (Korthikanti et al. 2022, Table
2), plus the embedding's input and dropout; it takes all num_layers blocks with pp micro-batches in flight (each
holding layers / pp blocks), i.e. pp x layers / pp. memplan: `memplan estimate MODEL --gpus N --tp T --pp P
--stage 1 --sp --recompute selective --grad-accum M --seq-len S --activations analytic` (DeepSpeed ZeRO-1 is the
distributed optimizer's counterpart), the first pipeline rank's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # model, gpus, tp, pp, micro-batches, seq
    ("llama-3-70b", 512, 8, 8, 16, 8192),
    ("llama-3.1-405b", 1024, 8, 16, 32, 8192),
    ("llama-2-70b", 256, 8, 4, 8, 4096),
]


def megatron(config: dict, tp: int, pp: int, dp: int, m: int, seq: int, mb: int = 1) -> dict[str, float]:
    """Megatron-LM's compute_weight_and_optimizer_memory and compute_activation_memory (SP + selective), for a
    llama-style config (SwiGLU, RMSNorm, GQA, untied embeddings), the vocabulary padded to 128 x tp."""
    h, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads", heads)
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    padded = -(-vocab // (128 * tp)) * 128 * tp
    attn = 2 * h * h * ((1 + groups / heads) * 1.0)
    per_layer = 2 * h * (ffn * 3 / 2 + 1) + attn
    block = per_layer * layers + h  # + the final RMSNorm
    embedding = h * padded
    most_loaded = (block / pp + embedding) / tp
    weights_and_optimizer = most_loaded * (6 + 12 / dp)
    act = seq * mb * h * (18 + 4 * ffn / h) * layers
    act += 8 * seq * mb * pp + seq * mb * h * pp
    act *= min(1, m / pp)
    return {"params": most_loaded, "states": weights_and_optimizer, "activations": act / tp}


def memplan(model: str, gpus: int, tp: int, pp: int, m: int, seq: int) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-m", "memplan", "estimate", model, "--gpus", str(gpus), "--tp", str(tp),
                        "--pp", str(pp), "--stage", "1", "--sp", "--recompute", "selective", "--grad-accum", str(m),
                        "--seq-len", str(seq), "--activations", "analytic", "--json"],
                       capture_output=True, text=True, cwd=ROOT, check=True)
    d = json.loads(r.stdout)
    first = d["parallel"]["ranks"][0]
    return {"params": first["params"], "grads": first["grads_bytes"],
            "states": first["weights_bytes"] + first["master_weights_bytes"] + first["optimizer_states_bytes"],
            "activations": first["activations_bytes"], "in_flight": first["micro_batches_in_flight"],
            "dp": d["parallel"]["dp"]}


def main() -> None:
    from memplan.model import sources

    print("| model, layout | params on the first stage (memplan / Megatron) | weights + grads + optimizer, GiB "
          "(memplan / Megatron) | activations, GiB (memplan / Megatron) |")
    print("|---|---:|---:|---:|")
    for model, gpus, tp, pp, m, seq in CASES:
        cfg = sources.resolve(model).config
        mine = memplan(model, gpus, tp, pp, m, seq)
        theirs = megatron(cfg, tp, pp, mine["dp"], m, seq)
        g = 2 ** 30
        print(f"| {model}, tp {tp} x pp {pp} x dp {mine['dp']}, {m} micro-batches of 1 x {seq} | "
              f"{mine['params']:,} / {theirs['params']:,.0f} | {(mine['states'] + mine['grads']) / g:.2f} / "
              f"{theirs['states'] / g:.2f} | {mine['activations'] / g:.2f} / {theirs['activations'] / g:.2f} |")


if __name__ == "__main__":
    main()

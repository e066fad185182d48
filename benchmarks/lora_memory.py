"""A text rank's peak memory with LoRA against full fine-tuning, on the same ~1B language model (CPU, measured).

Why: ``docs/memory.md`` prices a LoRA module at 2 bytes per frozen base parameter (bf16, no gradient, no optimizer
state) plus the adapters' full optimizer state, against 8 (pure bf16, ``train.precision=bf16``) or 16
(``fp32_master``) bytes per parameter of full fine-tuning. This runs the real ``LanguageEngine`` (build,
materialize, one forward/backward of a synthetic text sample, the optimizer step), each variant in a fresh
process, and reports the process's peak resident memory (``ru_maxrss``) and the engine's bytes by kind.

    .venv/bin/python benchmarks/lora_memory.py            # ~1B: hidden 2048, 20 layers, vocab 32000
    .venv/bin/python benchmarks/lora_memory.py --layers 4  # smaller, for a quick look

Variants: ``full_bf16`` (full fine-tuning, bf16 weights, gradients and AdamW state: the leanest full run);
``lora_r16`` (``text.lora.r=16`` on every Linear, the base frozen in bf16, the adapters float32 with float32
gradients and AdamW state under bf16 autocast). Full fine-tuning under ``fp32_master`` (16 B/param) is left out:
on this 24 GiB machine it does not fit beside other work; its weight bytes are twice ``full_bf16``'s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time
from dataclasses import replace

VARIANTS = {
    "full_bf16": ["train.precision=bf16", "train.dtype=bfloat16"],
    "lora_r16": ["train.precision=fp32_master", "train.dtype=bfloat16", "text.lora.r=16", "text.lora.alpha=32"],
}


def model_config(hidden: int, layers: int, vocab: int):
    from dhp.models.qwen2_5_vl.config import preset

    cfg = preset("tiny")
    heads = hidden // 128
    text = replace(cfg.text, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 8),
                   vocab_size=vocab, mrope_section=(16, 24, 24), tie_word_embeddings=False)
    return replace(cfg, text=text, vision=replace(cfg.vision, out_hidden_size=hidden))


def measure(variant: str, hidden: int, layers: int, vocab: int, tokens: int, queue: mp.Queue) -> None:
    """One variant in this (fresh) process: build the engine, one training step, then report."""
    import torch

    from dhp.config import load_config
    from dhp.engine import LanguageEngine
    from dhp.models.registry import get_family
    from dhp.plan.measure import GroupJob, materialized, synthetic_samples

    torch.set_num_threads(2)
    family = get_family("qwen2_5_vl")
    model_cfg = model_config(hidden, layers, vocab)
    cfg = load_config(None, ["runtime.backend=local", "train.optimizer=adamw", *VARIANTS[variant]])
    (sample,) = synthetic_samples(GroupJob(module="text", text_tokens=tokens, device="cpu"), model_cfg, family)
    sample = materialized(sample)
    start = time.perf_counter()
    eng = LanguageEngine(family, model_cfg, cfg, load=lambda i, pixels=False: sample)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _, n, _ = eng.forward_backward([0], {})
    eng.finish_gradients(1.0 / max(n, 1))
    eng.step(1.0)
    eng.forward_backward([0], {})  # a second step: the optimizer state exists now
    eng.finish_gradients(1.0 / max(n, 1))
    eng.step(1.0)

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    params = list(eng.module.parameters())
    state = [v for s in eng.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    queue.put({
        "variant": variant, "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in eng.trainable),
        "weights_gib": nbytes(params) / 2**30, "optimizer_state_gib": nbytes(state) / 2**30,
        "peak_rss_after_build_gib": built / 2**20, "peak_rss_gib": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 2**20, "seconds": time.perf_counter() - start,
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=512, help="text tokens of the training sample")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")  # a fresh process per variant: its peak RSS is its own
    rows = []
    for variant in args.variants.split(","):
        queue = ctx.Queue()
        proc = ctx.Process(target=measure, args=(variant, args.hidden, args.layers, args.vocab, args.tokens, queue))
        proc.start()
        rows.append(queue.get())
        proc.join()
        print(json.dumps(rows[-1]))
    if len(rows) == 2:
        ratio = rows[1]["peak_rss_gib"] / rows[0]["peak_rss_gib"]
        print(f"peak RSS: {rows[1]['variant']} / {rows[0]['variant']} = {ratio:.2f}")


if __name__ == "__main__":
    main()

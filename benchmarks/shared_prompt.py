"""n requests with one prompt, admitted together, with prefix caching: computed once or n times.

    python benchmarks/shared_prompt.py [--copies 8] [--prompt-len 512] [--max-tokens 16] [--rounds 3]

With the prefix cache on, a waiting request whose next prompt block a running request is
computing waits for it and reuses it (``BlockManager.prefix_in_flight``). This times the same
burst with that wait and with it switched off (every copy then computes the whole prompt in
the first step), in alternating rounds on one engine config, and reports wall time per burst,
engine steps and prefix-cache hit blocks. CPU, the benchmarks' synthetic hidden-512 llama.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.summary import median  # noqa: E402
from runtime.bench.synthetic import LlamaShape, build_random_llama  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.request import SamplingParams  # noqa: E402


def burst(model_dir: Path, copies: int, prompt: list[int], max_tokens: int, wait_for_shared: bool) -> dict[str, float]:
    from runtime.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", enable_prefix_caching=True, max_num_seqs=max(copies, 8),
                                    max_num_batched_tokens=max(2048, copies * len(prompt)), max_model_len=len(prompt) + max_tokens + 16))  # fmt: skip
    try:
        if not wait_for_shared:
            engine.block_manager.prefix_in_flight = lambda seq_id, seed, tokens: False  # the behaviour before the wait existed
        for i in range(copies):
            engine.add_request(f"c{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        wall = time.perf_counter() - start
        return {"wall_s": wall, "steps": engine.steps, "hit_blocks": engine.snapshot()["prefix_cache_hit_blocks"]}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=8, help="requests with the same prompt (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of both variants (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=512, help="the synthetic llama's hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="its decoder layers (default: %(default)s)")
    a = p.parse_args(argv)
    for name in ("copies", "prompt_len", "max_tokens", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    shape = LlamaShape.sized(a.hidden, a.layers)
    shape = LlamaShape(**{**shape.__dict__, "max_position_embeddings": max(shape.max_position_embeddings, a.prompt_len + a.max_tokens + 16)})
    prompt = [random.Random(0).randrange(3, shape.vocab_size) for _ in range(a.prompt_len)]
    with tempfile.TemporaryDirectory(prefix="shared-prompt-") as scratch:
        model_dir = build_random_llama(Path(scratch) / "model", shape, seed=0)
        burst(model_dir, 1, prompt[:8], 1, True)  # warm-up: allocator and thread pools
        results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for r in range(a.rounds):
            for wait in ([True, False] if r % 2 == 0 else [False, True]):
                results[wait].append(burst(model_dir, a.copies, prompt, a.max_tokens, wait))
    for wait, label in ((True, "wait for a shared block in flight"), (False, "compute it in every copy")):
        runs = results[wait]
        walls = ", ".join(f"{x['wall_s']:.3f}" for x in runs)
        print(f"{label:<34} wall {walls} s; steps {runs[0]['steps']}; hit blocks {runs[0]['hit_blocks']}")
    speedup = median([off["wall_s"] / on["wall_s"] for on, off in zip(results[True], results[False])])
    print(f"{a.copies} copies of a {a.prompt_len}-token prompt: waiting is {speedup:.2f}x faster (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Adapter lifetimes under a random interleaving of engine events (seeded, on ``LLMEngine`` directly).

Registering adapters of mixed ranks, submitting requests (some on the base model, many sharing
long prompt prefixes so the prefix cache hits), hot-updating a name to new weights, updating it
back to an older version (the same content: the same version, revived), overwriting a folder in
place and registering it again, unregistering, re-registering, checking a request and changing its
name before adding it, aborting and stepping, with one or two device slots whose rows do not hold
two rank-16 adapters, and a host tier smaller than the number of names, so placements evict,
versions are read back from disk and the host drains a busy entry for another's read. Checked:

- every output of a request names the version current when it was checked, and its greedy tokens
  (fp32) equal those of the same prompt run alone on that version: the version it was bound to
  served every token, whatever happened to its name meanwhile, and no KV of another version, of
  another adapter or of the base model was reused;
- while requests are in flight: a running request's version holds a device slot, a live request's
  version is still known to the registry and demanded in the pool, the host holds every device
  resident, and a version no longer current stays on the host while requests are bound to it;
- no exception but the documented refusals (``UnknownAdapterError`` for a name not registered, or
  a checked version gone before it was added), and no request ends in "error" but one whose
  version's folder was rewritten while it waited for a read from it ("changed on disk", docs/api.md);
- at the end: the engine is idle (``idle_problems``), only current versions remain in the registry
  and the pool, and every registered name then serves its current version.

The CI size runs a few seeds; ``-m slow`` runs many more, longer ones, on random engine sizes.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import pytest

from runtime.request import AdapterRef, SamplingParams, UnknownAdapterError
from tests.engine_helpers import clone_adapter, copy_adapter, make_engine, random_prompt, run_alone
from tests.faults.conftest import idle_problems

NAMES = ("p", "q", "r", "s")
VERSIONS_PER_NAME = 3
RANKS = (4, 8, 16)
SOURCES = ("a", "b", "c", "d")  # target sets: attention only, all attention, MLP only, mixed (rsLoRA)
MAX_TOKENS = 7
BLOCK = 4


@pytest.fixture(scope="module")
def version_folders(tiny_adapters, tmp_path_factory) -> dict[str, list[Path]]:
    """name -> folders of distinct random weights, mixed ranks and targets (never rewritten)."""
    root = tmp_path_factory.mktemp("stress_versions")
    rng = random.Random(1234)
    folders: dict[str, list[Path]] = {}
    for n, name in enumerate(NAMES):
        folders[name] = [
            clone_adapter(Path(tiny_adapters[rng.choice(SOURCES)]), root / f"{name}{k}", seed=100 * n + k, r=rng.choice(RANKS))
            for k in range(VERSIONS_PER_NAME)
        ]
    return folders


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts in families that share 3 to 5 full KV blocks, exact duplicates among them, and a few loners."""
    rng = random.Random(99)
    out = []
    for family in range(3):
        stem = random_prompt(rng, BLOCK * (3 + family) + rng.randrange(BLOCK))
        out += [stem + random_prompt(rng, rng.randint(1, 6)) for _ in range(3)]
        out.append(list(stem))  # a stem alone: its own blocks but the last are another prompt's
    out += [random_prompt(rng, rng.randint(2, 20)) for _ in range(3)]
    return out


class References:
    """Greedy tokens of each (adapter folder, prompt) run alone: one request at a time on an engine
    without prefix caching, each folder registered under a name of its own (computed on demand)."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = make_engine(model_dir, max_loras=1, max_cpu_loras=64, max_lora_rank=16, max_num_batched_tokens=64)
        self._names: dict[Path, str] = {}
        self._tokens: dict[tuple[Optional[Path], tuple[int, ...]], tuple[int, ...]] = {}
        self._count = 0

    def tokens(self, folder: Optional[Path], prompt: list[int]) -> tuple[int, ...]:
        key = (folder, tuple(prompt))
        if key not in self._tokens:
            name = None
            if folder is not None:
                if folder not in self._names:
                    self._names[folder] = f"ref{len(self._names)}"
                    self.engine.register_adapter(self._names[folder], str(folder))
                name = self._names[folder]
            self._count += 1
            out = run_alone(self.engine, f"ref-{self._count}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), name)
            self._tokens[key] = out.token_ids
        return self._tokens[key]


@pytest.fixture(scope="module")
def references(tiny_llama_dir):
    refs = References(tiny_llama_dir)
    yield refs
    refs.engine.close()


def stress(engine, version_folders, prompts, references, seed: int, operations: int, live_root: Path) -> dict[str, int]:
    """Run ``operations`` random events on ``engine`` then drain it; assert everything the module
    docstring lists. Returns how often each event happened (for the caller to check coverage).
    ``live_root``: a folder per name there is overwritten in place and registered again."""
    rng = random.Random(seed)
    current: dict[str, tuple[AdapterRef, Path]] = {}  # our model of the registry: name -> (version, content folder)
    folder_of: dict[AdapterRef, Path] = {}  # version -> the (never rewritten) folder with its content
    live_content: dict[Path, Path] = {}  # a live folder -> the content folder last copied into it
    stale: set[AdapterRef] = set()  # versions whose registered folder was overwritten with other content
    off_host: set[str] = set()  # requests whose version was seen off the host tier while they were in flight
    held: set[AdapterRef] = set()  # versions no longer current, seen on the host while requests were bound to them
    requests: dict[str, tuple[list[int], Optional[AdapterRef], int]] = {}  # id -> (prompt, bound version, max_tokens)
    finals: dict = {}
    seen: dict[str, int] = {}

    def note(event: str) -> None:
        seen[event] = seen.get(event, 0) + 1

    def register(name: str, folder: Path, path: Optional[Path] = None) -> None:
        ref = engine.register_adapter(name, str(path or folder))
        stale.discard(ref)  # registered again from where its content is
        held.discard(ref)  # current again (revived): a current version may be drained
        assert ref.name == name
        for other, known in folder_of.items():  # a version is its content: the same folder, the same version
            if other.name == name:
                assert (known == folder) == (other == ref), (other, known, ref, folder)
        previous = current.get(name)
        note("register" if previous is None else "revert" if ref in folder_of and previous[0] != ref else "update" if previous[0] != ref else "same")
        folder_of[ref] = folder
        current[name] = (ref, folder)

    def collect(outputs) -> None:
        for out in outputs:
            _, bound, _ = requests[out.request_id]
            assert out.adapter == bound, f"{out.request_id}: bound to {bound}, output says {out.adapter}"
            assert out.request_id not in finals, f"{out.request_id}: output after its final one"
            if out.finished:
                finals[out.request_id] = out
                note(f"final {out.finish_reason}")
                if out.finish_reason == "error":  # only documented: its version's folder rewritten while it waited for a read
                    assert bound in stale and out.request_id in off_host and "changed on disk" in out.error, (out.request_id, bound, out.error)

    def check_in_flight() -> None:
        pool, registry = engine.pool, engine.registry
        for seq in engine.scheduler.running:
            if seq.adapter is not None:
                assert pool.slot_of(seq.adapter) is not None and pool.device_refs_of(seq.adapter) > 0, seq.adapter
        host = set(pool.host_refs())
        # A version no longer current stays on the host while a request is bound to it: only a current
        # version may be dropped for another's read (host_drain) and read back, from files that may
        # have changed since.
        for ref in list(held):
            if pool.demand_of(ref) == 0:
                held.discard(ref)
            else:
                assert ref in host, f"{ref}: no longer current, dropped from the host with {pool.demand_of(ref)} requests bound to it"
        currents = {ref for ref, _ in current.values()}
        for live in engine._live.values():
            ref = live.seq.adapter
            if ref is not None:
                if ref not in host:
                    off_host.add(live.seq.request_id)
                elif ref not in currents:
                    held.add(ref)
                assert registry.known(ref) and registry.readers(ref) > 0 and pool.demand_of(ref) > 0, ref
        assert all(ref in host for ref, _, _ in pool.device_residents().values()), "the host must hold every device resident"

    for i in range(operations):
        event = rng.choices(
            ["submit", "step", "update", "unregister", "register", "abort", "in place"], weights=[34, 30, 10, 7, 8, 9, 5]
        )[0]
        if event == "submit":
            roll = rng.random()  # the base model, a registered name, or (refused) any name
            name = None if roll < 0.25 else rng.choice(sorted(current)) if roll < 0.9 and current else rng.choice(NAMES)
            prompt = rng.choice(prompts)
            max_tokens = rng.randint(1, MAX_TOKENS)
            rid = f"r{i}"
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            if name is not None and name not in current:
                with pytest.raises(UnknownAdapterError):
                    engine.add_request(rid, prompt, params, name)
                note("refused")
                continue
            bound = current[name][0] if name is not None else None
            if name is not None and rng.random() < 0.15:
                # Checked, then the name changes before the request is queued (LLM.generate and the async
                # engine's admission group check first, add after): it binds to the checked version if that
                # still has a reader, and is refused (documented) if the version is gone.
                checked = engine.check_request(rid, prompt, params, name)
                assert checked.adapter == bound
                if rng.random() < 0.5:
                    register(name, rng.choice(version_folders[name]))
                else:
                    engine.unregister_adapter(name)
                    del current[name]
                if not engine.registry.known(bound):
                    with pytest.raises(UnknownAdapterError):
                        engine.add_checked(checked)
                    note("refused late")
                    continue
                engine.add_checked(checked)
                note("late add")
            else:
                engine.add_request(rid, prompt, params, name)
            requests[rid] = (prompt, bound, max_tokens)
            note("submit")
        elif event == "step":
            for _ in range(rng.randint(1, 4)):
                collect(engine.step())
                check_in_flight()
            note("step")
        elif event in ("update", "register"):
            names = [n for n in NAMES if (n in current) == (event == "update")]
            if not names:
                continue
            # An update prefers a name with requests in flight, and may pick its current or an older version.
            busy = [n for n in names if any(b is not None and b.name == n for rid, (_, b, _) in requests.items() if rid not in finals)]
            name = rng.choice(busy if busy and rng.random() < 0.7 else names)
            register(name, rng.choice(version_folders[name]))
        elif event == "unregister":
            name = rng.choice(NAMES)
            if name not in current:
                with pytest.raises(UnknownAdapterError):
                    engine.unregister_adapter(name)
                note("refused")
                continue
            engine.unregister_adapter(name)
            del current[name]
            note("unregister")
        elif event == "in place":
            # Overwrite a name's live folder with another version's files; register it again, mostly.
            name = rng.choice(NAMES)
            live, content = live_root / name, rng.choice(version_folders[name])
            if live_content.get(live) != content:
                copy_adapter(content, live)
                for ref in folder_of:
                    if engine.registry.known(ref) and Path(engine.registry.path_of(ref)) == live:
                        stale.add(ref)
                live_content[live] = content
            note("in place")
            if rng.random() < 0.7:
                register(name, content, live)
        elif event == "abort":
            in_flight = [rid for rid in requests if rid not in finals]
            if in_flight:
                rid = rng.choice(in_flight)
                if engine.abort(rid):
                    note("abort")
        check_in_flight()

    for _ in range(5000):
        if not engine.has_unfinished():
            break
        collect(engine.step())
        check_in_flight()
    assert not engine.has_unfinished(), "the engine did not drain"

    assert set(finals) == set(requests)
    for rid, (prompt, bound, max_tokens) in requests.items():
        out = finals[rid]
        assert out.finish_reason in ("length", "abort", "error"), (rid, out.finish_reason, out.error)
        want = references.tokens(folder_of[bound] if bound is not None else None, prompt)
        if out.finish_reason == "length":
            assert len(out.token_ids) == max_tokens, rid
        assert out.token_ids == want[: len(out.token_ids)], (
            f"{rid} (seed {seed}, version {bound}, prompt {len(prompt)} tokens): {out.token_ids} != alone {want}"
        )

    snap = engine.snapshot()
    assert idle_problems(snap, registered=len(current)) == [], idle_problems(snap, registered=len(current))
    live_refs = {ref for ref, _ in current.values()}
    assert set(engine.registry._records) == live_refs, "a version no longer current outlived its readers in the registry"
    assert set(engine.pool.host_refs()) <= live_refs
    assert {ref for ref, _, _ in engine.pool.device_residents().values()} <= live_refs
    assert not engine.pool._retired, "a retired version outlived its readers in the pool (or a current one is marked retired)"

    # Every name now serves its current version (a revived or re-read version included).
    for name, (ref, folder) in sorted(current.items()):
        if ref in stale and ref not in engine.pool.host_refs():
            continue  # its files changed on disk: a read would refuse them (documented)
        prompt = rng.choice(prompts)
        out = run_alone(engine, f"after-{name}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), name)
        assert out.adapter == ref and out.token_ids == references.tokens(folder, prompt), name
    snap = engine.snapshot()
    assert idle_problems(snap, registered=len(current)) == []
    return seen


STRESS_ENGINE = dict(
    max_loras=2, max_cpu_loras=2, max_lora_rank=16, lora_pool_rows=24,  # two rank-16 adapters do not fit at once
    enable_prefix_caching=True, block_size=BLOCK, num_kv_blocks=16, max_model_len=48,  # 64 tokens of KV: preemptions
    max_num_seqs=6, max_num_batched_tokens=16,  # chunked prefills
)


@pytest.mark.parametrize("seed, slots, host", [(0, 2, 2), (1, 2, 3), (2, 2, 2), (4, 1, 1)])
def test_adapter_lifetimes_under_random_updates_unregisters_and_aborts(tiny_llama_dir, version_folders, prompts, references, seed, slots, host, tmp_path):
    engine = make_engine(tiny_llama_dir, **dict(STRESS_ENGINE, max_loras=slots, max_cpu_loras=host))
    try:
        seen = stress(engine, version_folders, prompts, references, seed, operations=140, live_root=tmp_path)
    finally:
        engine.close()
    for event in ("submit", "update", "unregister", "abort", "in place"):
        assert seen.get(event, 0) > 0, f"seed {seed} never did {event}: {seen}"
    snap = engine.snapshot()
    agg = {}
    for name, c in snap["adapters"].items():
        for k, v in c.items():
            if isinstance(v, (int, float)): agg[k] = agg.get(k, 0) + v
    print("\nSEEN", seed, seen, "hits", snap["prefix_cache_hit_blocks"], {k: agg[k] for k in ("loads","device_loads","host_evictions","device_evictions","retired","disk_misses","preemptions") if k in agg})
    assert snap["prefix_cache_hit_blocks"] > 0, "the shared prefixes should hit the cache"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 140))
def test_adapter_lifetimes_stress_long(tiny_llama_dir, version_folders, prompts, references, seed, tmp_path):
    rng = random.Random(seed)
    overrides = dict(
        STRESS_ENGINE,
        max_loras=rng.choice([1, 2, 3]),
        num_kv_blocks=rng.choice([14, 24, 64]),
        max_num_batched_tokens=rng.choice([5, 16, 32]),
        max_num_seqs=rng.choice([2, 6, 12]),
    )
    overrides["max_cpu_loras"] = overrides["max_loras"] + rng.choice([0, 1, 3])
    overrides["lora_pool_rows"] = max(16, overrides["max_loras"] * rng.choice([12, 16]))
    engine = make_engine(tiny_llama_dir, **overrides)
    try:
        stress(engine, version_folders, prompts, references, seed, operations=600, live_root=tmp_path)
    finally:
        engine.close()

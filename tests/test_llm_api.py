"""Offline API: LLM(...).generate over the continuous-batching engine."""
from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys

import pytest

from runtime import LLM, GenerationError, SamplingParams
from tests.engine_helpers import clone_adapter, copy_adapter


def test_generate_mixed_adapters_matches_single_prompt_calls(tiny_llama_dir, tiny_adapters):
    llm = LLM(str(tiny_llama_dir), adapters={n: str(p) for n, p in tiny_adapters.items()}, max_lora_rank=16, max_loras=2, num_kv_blocks=64, block_size=4)
    prompts = ["hello", "the cat", [5, 6, 7, 8], "xyz"]
    adapters = ["a", None, "c", "e"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    batch = llm.generate(prompts, params, adapter=adapters)
    single = [llm.generate([p], params, adapter=a)[0] for p, a in zip(prompts, adapters)]
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    assert [r.adapter for r in batch] == adapters and all(r.finish_reason == "length" for r in batch)
    assert batch[0].text == llm.tokenizer.decode(batch[0].token_ids)
    assert all(r.logprobs is None for r in batch)
    scored = llm.generate(prompts[:2], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1), adapter=adapters[:2])
    assert [r.token_ids for r in scored] == [r.token_ids for r in batch[:2]]
    assert all(len(r.prompt_logprobs) == len(r.prompt_token_ids) and r.prompt_logprobs[0] is None for r in scored)
    assert all([lp.token_id for lp in r.logprobs] == list(r.token_ids) and all(len(lp.top) == 2 for lp in r.logprobs) for r in scored)


def test_generate_validates_arguments(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="adapter: got 1 values for 2 prompts"):
        llm.generate(["a", "b"], adapter=[None])
    with pytest.raises(ValueError, match=r"prompts\[1\].*not registered"):
        llm.generate(["a", "b"], adapter=[None, "missing"])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="unknown config key"):
        LLM(str(tiny_llama_dir), not_a_key=1)
    for bad, message in [(dict(adapter=3), r"adapter: expected an adapter name \(str\) or None or a list of them .* got int"),
                         (dict(adapter={"a": 1, "b": 2}), "adapter: expected .* got dict"),
                         (dict(adapter=[None, 3]), r"adapter\[1\]: expected an adapter name"),
                         (dict(params={"max_tokens": 3}), "params: expected a SamplingParams or a list of them")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.generate(["a", "b"], **bad)
    for prompts in (5, None, 3.5, b"abc", {"a": 1}, {"a"}):  # never iterated into prompts or token ids
        with pytest.raises(ValueError, match=f"prompts: expected a string, a list of token ids, or a list of those, got {type(prompts).__name__}"):
            llm.generate(prompts)
    assert not llm.engine.has_unfinished()
    assert llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"  # still usable
    with pytest.raises(ValueError, match="adapters: expected a mapping"):
        LLM(str(tiny_llama_dir), adapters=["/some/adapter"])
    llm.close()


def test_failed_requests_raise_with_every_result_unless_asked_not_to(tiny_llama_dir, tiny_adapters, tmp_path, caplog):
    """An adapter whose files changed on disk before its first read fails its requests; the
    base-model request in the same call still succeeds and is not lost."""
    live = copy_adapter(tiny_adapters["a"], tmp_path / "live")
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4, max_loras=1, max_cpu_loras=1) as llm:
        llm.register_adapter("live", str(live))
        llm.register_adapter("other", str(tiny_adapters["b"]))  # the 1-entry host tier drops "live"
        clone_adapter(tiny_adapters["a"], live, seed=5)  # "live" must be read again: its files changed
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        with pytest.raises(GenerationError, match=r"1 of 2 requests failed: prompts\[1\] \(adapter 'live'\): .*changed on disk") as exc:
            llm.generate(["x", "y"], params, adapter=[None, "live"])
        good, bad = exc.value.results
        assert good.finish_reason == "length" and len(good.token_ids) == 3 and bad.finish_reason == "error"
        kept = llm.generate(["x", "y"], params, adapter=[None, "live"], raise_on_error=False)
        assert [r.finish_reason for r in kept] == ["length", "error"] and kept[0].token_ids == good.token_ids
        # Files replaced by ones that no longer validate (another adapter's targets): still "changed on disk"; the
        # reason goes to the log, not into the request's error, which any API caller of that adapter reads.
        llm.register_adapter("gone", str(copy_adapter(tiny_adapters["a"], tmp_path / "gone")))
        llm.register_adapter("other2", str(copy_adapter(tiny_adapters["b"], tmp_path / "other2")))  # drops "gone" from the host tier
        shutil.copyfile(tiny_adapters["c"] / "adapter_model.safetensors", tmp_path / "gone" / "adapter_model.safetensors")  # a's config, c's tensors
        with caplog.at_level(logging.WARNING, logger="runtime.engine"):
            (failed,) = llm.generate(["y"], params, adapter="gone", raise_on_error=False)
        assert failed.finish_reason == "error" and "changed on disk since it was registered" in failed.error, failed.error
        assert "no longer loads (the log has why" in failed.error
        assert any("re-reading" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)
    assert not llm.engine.has_unfinished()


def test_a_re_read_never_follows_files_swapped_to_point_elsewhere(tiny_llama_dir, tiny_adapters, tmp_path, caplog):
    """After registration, an adapter's file replaced by a symlink to a file elsewhere (outside
    --adapter-root, say): the host tier's re-read reads nothing and the request's error quotes none
    of that file (it used to: a parse error showed its first bytes to any caller)."""
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text('{"peft_type": "TOPSECRET-hunter2"}')
    live = copy_adapter(tiny_adapters["a"], tmp_path / "root" / "live")
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4, max_loras=1, max_cpu_loras=1) as llm:
        llm.register_adapter("live", str(live))
        llm.register_adapter("other", str(tiny_adapters["b"]))  # the 1-entry host tier drops "live": the next request re-reads it
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            saved = (live / name).read_bytes()
            (live / name).unlink()
            (live / name).symlink_to(secret)
            with caplog.at_level(logging.WARNING, logger="runtime.engine"):
                (failed,) = llm.generate(["y"], params, adapter="live", raise_on_error=False)
            assert failed.finish_reason == "error" and "resolve to other paths than when it was registered" in failed.error, failed.error
            assert "TOPSECRET" not in failed.error and "nothing was read" in failed.error
            (live / name).unlink()
            (live / name).write_bytes(saved)  # the same content at the same place: served again
            (ok,) = llm.generate(["y"], params, adapter="live")
            assert ok.finish_reason == "length"
            llm.generate(["y"], params, adapter="other")  # and dropped from the host tier again
        assert all("TOPSECRET" not in r.getMessage() for r in caplog.records)  # not read at all: not even the log has it
        # The whole folder (registered by its own path, as the admin route registers it) swapped for a symlink to a copy elsewhere.
        elsewhere = copy_adapter(tiny_adapters["a"], tmp_path / "outside" / "copy")
        shutil.rmtree(live)
        live.symlink_to(elsewhere)
        (failed,) = llm.generate(["y"], params, adapter="live", raise_on_error=False)
        assert failed.finish_reason == "error" and "nothing was read" in failed.error, failed.error


def test_a_re_read_never_follows_a_file_swapped_right_after_its_check(tiny_llama_dir, tiny_adapters, tmp_path, caplog, monkeypatch):
    """The host tier's re-read checks where the files resolve, then reads them: a file swapped for a
    symlink to one outside in between used to be read (and its parse error, in the log, quoted it);
    now the loader reads only the paths that check approved, and refuses, nothing read."""
    import runtime.engine as engine_module

    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text('{"peft_type": "TOPSECRET-hunter2"}')
    live = copy_adapter(tiny_adapters["a"], tmp_path / "root" / "live")
    check = engine_module.resolved_files

    def check_then_swap(folder):
        files = check(folder)
        (live / "adapter_config.json").unlink()
        (live / "adapter_config.json").symlink_to(secret)
        return files

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4, max_loras=1, max_cpu_loras=1) as llm:
        llm.register_adapter("live", str(live))
        llm.register_adapter("other", str(tiny_adapters["b"]))  # drops "live" from the 1-entry host tier: the next request re-reads it
        monkeypatch.setattr(engine_module, "resolved_files", check_then_swap)
        with caplog.at_level(logging.WARNING, logger="runtime.engine"):
            (failed,) = llm.generate(["y"], params, adapter="live", raise_on_error=False)
    assert failed.finish_reason == "error" and "nothing was read" in failed.error, failed.error
    assert "TOPSECRET" not in failed.error and all("TOPSECRET" not in r.getMessage() for r in caplog.records)


def test_a_re_read_follows_a_folder_symlink_repointed_at_another_copy(tiny_llama_dir, tiny_adapters, tmp_path):
    """A release switch (``current -> rev1`` repointed at ``rev2``, as git-sync does): the files now
    resolve elsewhere, but inside the folder the registered path names, and hash to the version."""
    rev1, rev2 = copy_adapter(tiny_adapters["a"], tmp_path / "rev1"), copy_adapter(tiny_adapters["a"], tmp_path / "rev2")
    current = tmp_path / "current"
    current.symlink_to(rev1)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4, max_loras=1, max_cpu_loras=1) as llm:
        llm.register_adapter("live", str(current))
        (first,) = llm.generate(["y"], params, adapter="live")
        llm.generate(["y"], params, adapter=None)
        llm.register_adapter("other", str(tiny_adapters["b"]))  # drops "live" from the 1-entry host tier
        current.unlink()
        current.symlink_to(rev2)
        (again,) = llm.generate(["y"], params, adapter="live")
        assert again.finish_reason == "length" and again.token_ids == first.token_ids, again.error


def test_close_and_a_failed_constructor_release_the_engine(tiny_llama_dir, tiny_adapters, monkeypatch):
    from runtime.engine import LLMEngine

    closed = []
    real_close = LLMEngine.close
    monkeypatch.setattr(LLMEngine, "close", lambda self, *args: (closed.append(self), real_close(self, *args)))  # LLM.close passes its timeout
    with pytest.raises(ValueError, match=r"adapters\['big'\]|rank"):  # rank 16 over max_lora_rank 8: found once the model is loaded
        LLM(str(tiny_llama_dir), adapters={"good": str(tiny_adapters["a"]), "big": str(tiny_adapters["c"])}, max_lora_rank=8,
            num_kv_blocks=32, block_size=4)  # fmt: skip
    assert len(closed) == 1
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4) as llm:
        assert llm.engine.config.device == "auto" or llm.engine.backend.name == "cpu"
    assert closed[-1] is llm.engine and len(closed) == 2


def test_import_runtime_is_light():
    code = "import sys, runtime; assert 'torch' not in sys.modules; from runtime import LLM, SamplingParams; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "ok"


@pytest.mark.parametrize("where", ["sampler", "demand", "scheduler"])
def test_an_interrupt_while_a_request_is_added_leaves_nothing_behind(tiny_llama_dir, tiny_adapters, monkeypatch, where):
    """Ctrl-C while generate queued its prompts left an adapter demanded (and sometimes a live request
    that never ran): with a 1-entry host tier, the next generate for another adapter then never returned."""
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, seed=1)  # sampled: the sampler holds a generator
    with LLM(str(tiny_llama_dir), adapters={"a": str(tiny_adapters["a"]), "b": str(tiny_adapters["b"])}, num_kv_blocks=32,
             block_size=4, max_loras=1, max_cpu_loras=1) as llm:  # fmt: skip
        engine = llm.engine
        target = {"sampler": (engine.sampler, "add"), "demand": (engine.pool, "demand"), "scheduler": (engine.scheduler, "add")}[where]
        real = getattr(*target)

        def then_interrupt(*args, **kwargs):  # type: ignore[no-untyped-def]
            real(*args, **kwargs)  # what it takes is taken; the interrupt lands right after
            raise KeyboardInterrupt

        monkeypatch.setattr(*target, then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["x", "y"], params, adapter="a")
        monkeypatch.setattr(*target, real)
        ref = engine.registry.resolve("a")
        assert not engine.has_unfinished() and engine.pool.demand_of(ref) == 0 and engine.registry.readers(ref) == 0
        assert not engine.sampler._generators
        (out,) = llm.generate(["y"], SamplingParams(max_tokens=2, ignore_eos=True), adapter="b")  # it hung here
        assert out.finish_reason == "length"


def test_a_closed_llm_refuses_every_call_and_adapters_can_be_unregistered(tiny_llama_dir, tiny_adapters):
    from runtime.request import UnknownAdapterError

    llm = LLM(str(tiny_llama_dir), adapters={"a": str(tiny_adapters["a"])}, num_kv_blocks=32, block_size=4)
    llm.unregister_adapter("a")
    with pytest.raises(UnknownAdapterError):
        llm.generate(["x"], SamplingParams(max_tokens=1), adapter="a")
    with pytest.raises(ValueError, match="raise_on_error: expected True or False"):
        llm.generate(["x"], SamplingParams(max_tokens=1), raise_on_error="no")
    with pytest.raises(TypeError, match="adapter folder: expected a str or os.PathLike, got NoneType"):
        llm.register_adapter("late", None)  # was "None: adapter folder does not exist"
    llm.register_adapter("a", tiny_adapters["a"])  # a Path is a path
    llm.close()
    for call in (lambda: llm.register_adapter("late", str(tiny_adapters["b"])), lambda: llm.unregister_adapter("a"),
                 lambda: llm.generate(["x"], SamplingParams(max_tokens=1))):  # fmt: skip
        with pytest.raises(RuntimeError, match="LLM: closed"):
            call()


def test_a_refused_batch_leaves_no_trace(tiny_llama_dir, tiny_adapters):
    """The README says a refused batch is refused before anything runs. Its earlier prompts used
    to be queued and aborted: they drew seeds (an unseeded run after it differed from one on a
    fresh LLM), started adapter reads and counted as requests in the metrics."""
    def fresh() -> LLM:
        return LLM(str(tiny_llama_dir), adapters={n: str(p) for n, p in tiny_adapters.items()}, max_lora_rank=16, max_loras=2,
                   num_kv_blocks=64, block_size=4)  # fmt: skip

    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    with fresh() as reference:
        expected = reference.generate(["hello"], sampled)[0].token_ids
    with fresh() as llm:
        before = llm.engine.snapshot()
        with pytest.raises(ValueError, match=r"prompts\[2\]"):
            llm.generate(["hello", "x", [99999]], sampled, adapter=["a", "c", None])
        after = llm.engine.snapshot()
        assert after == before  # the per-adapter request counts, the pool, the KV blocks, the steps
        assert llm.generate(["hello"], sampled)[0].token_ids == expected


def test_token_id_prompts_take_numpy_integers_and_a_mixed_list_is_named(tiny_llama_dir):
    import numpy as np

    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4) as llm:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        plain = llm.generate([[5, 6, 7]], params)[0].token_ids
        assert llm.generate(list(np.array([5, 6, 7])), params)[0].token_ids == plain  # one prompt of numpy int64
        assert llm.generate([np.array([5, 6, 7]).tolist(), list(np.array([5, 6, 7]))], params)[1].token_ids == plain
        with pytest.raises(ValueError, match=r"must hold integers only; item 1 is str"):  # it blamed item 0, "got int"
            llm.generate([1, "a"], params)
        with pytest.raises(ValueError, match=r"item 1 is bool"):
            llm.generate([5, True, 7], params)


def test_use_tqdm_shows_one_step_per_finished_prompt(tiny_llama_dir, capsys):
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=4) as llm:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        llm.generate(["a", "b", "c"], params, use_tqdm=True)
        err = capsys.readouterr().err
        assert "generate: 3/3 prompt (100%)" in err.splitlines() and "\r" not in err  # no terminal: lines, not a redrawn bar
        llm.generate(["a", "b", "c"], params)  # the default: only on a terminal
        assert "3/3" not in capsys.readouterr().err
        with pytest.raises(ValueError, match="use_tqdm"):
            llm.generate(["a"], params, use_tqdm="yes")


def test_generation_error_survives_pickling_with_its_results():
    """A GenerationError raised in a worker process (multiprocessing, concurrent.futures, Ray) is
    pickled back to the caller; unpickling rebuilt it from its message and failed with
    "AttributeError: 'str' object has no attribute 'finish_reason'" instead."""
    import pickle

    from runtime.llm import CompletionResult

    results = [CompletionResult("ok", (1, 2), "length", None), CompletionResult("", (), "error", "a", error="its files changed")]
    again = pickle.loads(pickle.dumps(GenerationError(results)))
    assert isinstance(again, GenerationError) and again.results == results
    assert str(again) == str(GenerationError(results)) and "prompts[1] (adapter 'a'): its files changed" in str(again)


def test_adapters_are_checked_before_the_model_loads(tiny_llama_dir, tiny_adapters, tmp_path, monkeypatch):
    """A mistyped adapter folder or a bad name in ``adapters={...}`` was found only after the model
    had loaded (minutes for a large one); None as a folder said "None: adapter folder does not exist"."""
    import runtime.llm

    built = []
    monkeypatch.setattr(runtime.llm, "LLMEngine", lambda config: built.append(config))
    (tmp_path / "not_an_adapter").mkdir()
    good = str(tiny_adapters["a"])
    for adapters, message in [({"good": good, "bad": "/no/such/adapter"}, r"adapters\['bad'\]: /no/such/adapter: adapter folder does not exist"),
                              ({"x": str(tmp_path / "not_an_adapter")}, r"adapters\['x'\]: .*adapter_config.json: missing"),
                              ({"": good}, r"adapters\[''\]: adapter name: must be a non-empty string"),
                              ({" a": good}, r"adapters\[' a'\]: adapter name"),
                              ({"__base__": good}, r"adapters\['__base__'\]: adapter name: '__base__' is reserved")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_llama_dir), adapters=adapters)
    for folder in (None, 7, b"/adapters/a"):  # a wrong type: a TypeError, as from register_adapter
        with pytest.raises(TypeError, match=rf"adapters\['x'\]: adapter folder: expected a str or os.PathLike, got {type(folder).__name__}"):
            LLM(str(tiny_llama_dir), adapters={"x": folder})
    for name in (1, None, b"a"):  # so is a name that is not a str
        with pytest.raises(TypeError, match=rf"adapters\[{re.escape(repr(name))}\]: adapter name: expected a str, got {type(name).__name__}"):
            LLM(str(tiny_llama_dir), adapters={name: good})
    assert built == []

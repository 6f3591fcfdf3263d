"""`lorafleet serve`'s "loading ..." line: said before the minutes a large model takes to load, only
once the quick checks have passed (a mistyped --model is one line, with no "loading" before it),
and under --ray too, where Ray's start-up and the replicas' loads take as long."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from runtime.commands import serve
from tests.test_serve_cli import parse


def stop_before_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(settings):  # type: ignore[no-untyped-def]
        raise ValueError("stop here")

    monkeypatch.setattr(serve, "load_engine", fail)


def test_a_line_says_the_model_is_loading_before_it_loads(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], caplog, monkeypatch) -> None:
    """Nothing was logged from the start until "serving on", after the weights had loaded (and, on the
    cpu, been packed) and every adapter was read: minutes of silence for a large checkpoint, with no
    sign that anything was happening or what."""
    stop_before_the_load(monkeypatch)
    caplog.set_level(logging.INFO, logger="lorafleet.serve")
    assert serve.run(parse("--model", str(tiny_llama_dir), "--lora-modules", f"a={tiny_adapters['a']}", "--port", "0")) == 2
    size = sum(p.stat().st_size for p in tiny_llama_dir.glob("*.safetensors")) / 2**20
    assert (f"lorafleet serve: loading {tiny_llama_dir} ({size:.1f} MiB of weights) and 1 adapter on --device auto, dtype float32; "
            "'serving on' follows once they are ready") in caplog.messages


@pytest.mark.parametrize("model, error", [
    ("nowhere", "nowhere: no such folder"),
    ("config-only", "model.safetensors"),  # config.json but no weights: found before the line, not by the load
    ("no-tokenizer", "tokenizer.json: missing"),
])
def test_a_model_that_cannot_load_is_one_line_without_a_loading_line_before_it(tiny_llama_dir: Path, tmp_path: Path, caplog, capsys,
                                                                               monkeypatch, model: str, error: str) -> None:
    """The "loading" line came first, then at once the error that the folder does not exist: it said
    a model was loading that never could."""
    stop_before_the_load(monkeypatch)
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    shutil.copytree(tiny_llama_dir, tmp_path / "no-tokenizer")
    (tmp_path / "no-tokenizer" / "tokenizer.json").unlink()
    caplog.set_level(logging.INFO, logger="lorafleet.serve")
    assert serve.run(parse("--model", str(tmp_path / model), "--port", "0")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err and "stop here" not in err, err
    assert not [m for m in caplog.messages if "loading" in m]


def test_ray_says_what_each_replica_loads_before_ray_starts(tiny_llama_dir: Path, tiny_adapters: dict[str, Path], capsys, monkeypatch) -> None:
    """`serve --ray` said nothing between the command and "serving on" (Ray's start, then every
    replica loading the model): the single server's line, for each replica."""
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray

    def init(**kw):  # type: ignore[no-untyped-def]
        raise ConnectionError("stop here")

    monkeypatch.setattr(ray, "init", init)
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-modules", f"a={tiny_adapters['a']}", f"b={tiny_adapters['b']}",
                                         "--ray", "--num-replicas", "2", "--ray-address", "ray://nohost:10001"))  # fmt: skip
    assert run_ray(settings) == 2
    size = sum(p.stat().st_size for p in tiny_llama_dir.glob("*.safetensors")) / 2**20
    assert capsys.readouterr().out == (f"lorafleet serve: starting Ray Serve with 2 replicas, each loading {tiny_llama_dir} ({size:.1f} MiB of "
                                       "weights) and 2 adapters on --device auto, dtype float32; 'serving on' follows once they are ready\n")

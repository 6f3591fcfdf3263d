"""`lorafleet serve` settings: flags, --config YAML, precedence, and errors that name the key."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.commands import serve
from runtime.config import ConfigError
from runtime.server.serve_config import build_settings, load_yaml, normalize_keys, parse_lora_module
from tests.server_harness import free_port


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_override_config_file(tmp_path: Path, tiny_llama_dir: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\nmax-loras: 3\nport: 9001\ndtype: bfloat16\nenable_prefix_caching: true\n")
    s = serve.load_settings(parse("--config", str(cfg), "--max-loras", "5"))
    assert s.engine.max_loras == 5  # flag wins
    assert s.server.port == 9001 and s.engine.dtype == "bfloat16" and s.engine.enable_prefix_caching is True  # file applies
    assert s.server.host == "127.0.0.1"  # default: loopback only


def test_a_no_flag_turns_off_a_boolean_the_file_turns_on(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Flags override the file for booleans too: --no-X turns off what the file turns on (the file
    alone, or no flag, keeps the file's value)."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\nenable_prefix_caching: true\nenable_adapter_admin: true\n")
    on = serve.load_settings(parse("--config", str(cfg)))
    assert on.engine.enable_prefix_caching is True and on.server.enable_adapter_admin is True
    off = serve.load_settings(parse("--config", str(cfg), "--no-enable-prefix-caching", "--no-enable-adapter-admin", "--no-ray"))
    assert off.engine.enable_prefix_caching is False and off.server.enable_adapter_admin is False and off.ray is False
    assert serve.load_settings(parse("--model", str(tiny_llama_dir), "--enable-prefix-caching")).engine.enable_prefix_caching is True


def test_the_cpu_gemm_comes_from_the_file_or_the_flag(tmp_path: Path, tiny_llama_dir: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\ncpu-gemm: onednn\n")
    assert serve.load_settings(parse("--config", str(cfg))).engine.cpu_gemm == "onednn"
    assert serve.load_settings(parse("--config", str(cfg), "--cpu-gemm", "mkl")).engine.cpu_gemm == "mkl"
    assert serve.load_settings(parse("--model", str(tiny_llama_dir))).engine.cpu_gemm == "auto"
    with pytest.raises(SystemExit):
        parse("--cpu-gemm", "blas")


@pytest.mark.parametrize(
    "text, key",
    [("max_lorax: 3\n", "max_lorax"), ("max_loras: -1\n", "max_loras"), ("dtype: float64\n", "dtype"),
     ("port: 70000\n", "port"), ("max_loras: many\n", "max_loras"), ("log_level: loud\n", "log_level"),
     ("cpu_gemm: blas\n", "cpu_gemm"), ("cpu_gemm: 3\n", "cpu_gemm")],
)
def test_bad_keys_and_values_name_the_key(tmp_path: Path, tiny_llama_dir: Path, text: str, key: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\n" + text)
    with pytest.raises(ConfigError, match=key):
        serve.load_settings(parse("--config", str(cfg)))


def test_broken_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml(str(tmp_path / "missing.yaml"))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("served_model_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"--config {latin1}: not UTF-8 text"):
        load_yaml(str(latin1))
    twice = tmp_path / "twice.yaml"
    twice.write_text("max_loras: 2\nmax-loras: 4\n")
    with pytest.raises(ConfigError, match="'max_loras' and 'max-loras' both set max_loras; keep one"):
        load_yaml(str(twice))


@pytest.mark.parametrize("value", ["123", "true", "[a, b]", "''"])
def test_a_model_that_is_not_a_path_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {value}\n")
    assert serve.run(parse("--config", str(cfg), "--port", "0")) == 2
    err = capsys.readouterr().err
    # empty: refused too (it served the bundled demo, the wrong model, when a variable was unset)
    expected = "lorafleet serve: model: empty" if value == "''" else "lorafleet serve: model: expected a checkpoint folder (a path)"
    assert err.startswith(expected) and "Traceback" not in err, err


@pytest.mark.parametrize("flags", [["--model", "{long}"], ["--lora-modules", "x={long}"], ["--enable-adapter-admin", "--adapter-root", "{long}"]])
def test_a_path_the_file_system_cannot_take_is_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                       tiny_llama_dir: Path, flags: list[str]) -> None:  # fmt: skip
    """A path component longer than the file system allows (ENAMETOOLONG) crashed start-up with a traceback."""
    long = str(tmp_path / ("a" * 300))
    model = [] if flags[0] == "--model" else ["--model", str(tiny_llama_dir)]
    assert serve.run(parse(*model, *(f.format(long=long) for f in flags), "--port", "0")) == 2
    err = capsys.readouterr().err
    assert err == f"lorafleet serve: {long}: File name too long\n", err


def test_repeated_lora_modules_flags_add_up(tiny_llama_dir: Path) -> None:
    """A second --lora-modules dropped the adapters of the first without a word."""
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"))
    assert [m.name for m in settings.lora_modules] == ["a", "b", "c"]


def test_more_device_slots_than_the_default_host_tier_raise_the_host_tier(tiny_llama_dir: Path) -> None:
    """--max-loras 40 without --max-cpu-loras failed on a flag the user never set (the host tier's 32)."""
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--max-loras", "40"))
    assert settings.engine.max_cpu_loras is None and settings.engine.host_tier_size == 40
    assert serve.load_settings(parse("--model", str(tiny_llama_dir))).engine.host_tier_size == 32
    with pytest.raises(ConfigError, match="max_cpu_loras: 8 is below max_loras=40"):  # given, and too small: still an error
        serve.load_settings(parse("--model", str(tiny_llama_dir), "--max-loras", "40", "--max-cpu-loras", "8"))


@pytest.mark.parametrize("line, flags", [
    ("enable_adapter_admin: 'false'", ["--enable-adapter-admin"]), ("port: 'abc'", ["--port", "9000"]),
    ("max_loras: '8'", ["--max-loras", "4"]), ("enable_prefix_caching: 'no'", ["--enable-prefix-caching"]),
    ("log_level: 5", ["--log-level", "info"]), ("dtype: 16", ["--dtype", "float32"]), ("num_replicas: '2'", ["--num-replicas", "1"]),
    ("max_loras: true", ["--max-loras", "4"]), ("model: null", ["--model", "{model}"]),
])  # fmt: skip
def test_a_wrong_type_in_the_config_file_is_an_error_also_where_a_flag_overrides_it(tmp_path: Path, tiny_llama_dir: Path, line: str,
                                                                                   flags: list[str]) -> None:  # fmt: skip
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(line + "\n")
    key = line.split(":")[0]
    argv = [f.format(model=tiny_llama_dir) for f in flags] + ([] if "--model" in flags else ["--model", str(tiny_llama_dir)])
    with pytest.raises(ConfigError, match=f"^{key}: expected .* in the --config file"):
        serve.load_settings(parse("--config", str(cfg), *argv))


def test_every_config_key_has_a_file_type() -> None:
    from runtime.server.serve_config import ALL_KEYS, KEY_TYPES

    assert set(KEY_TYPES) == set(ALL_KEYS)


def test_a_key_given_twice_in_the_config_file_is_an_error(tmp_path: Path) -> None:
    """YAML keeps the last of two equal keys and drops the first without a word."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 18960\nport: 99999\n")
    with pytest.raises(ConfigError, match="key 'port' is given twice; keep one"):
        load_yaml(str(cfg))
    cfg.write_text("lora_modules:\n  - {name: a, path: /x, name: b}\n")  # nested mappings too
    with pytest.raises(ConfigError, match="key 'name' is given twice"):
        load_yaml(str(cfg))


def test_lora_module_forms() -> None:
    assert parse_lora_module("a=/x/y").path == "/x/y"
    m = parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "base"}')
    assert (m.name, m.path, m.base_model_name) == ("b", "/p", "base")
    for bad in ("novalue", '{"name": "x"}', '{"name": "x", "path": "/p", "extra": 1}', "{broken"):
        with pytest.raises(ConfigError, match="lora_modules"):
            parse_lora_module(bad)


def test_relative_lora_module_paths_are_made_absolute(tiny_llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A relative adapter path (flag or --config file) means the folder under the one serve starts
    in; it is kept absolute, so GET /v1/models shows it as it shows admin-loaded adapters."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("lora_modules:\n  - {name: b, path: adapters/b}\n  - c=./adapters/c\n")
    from_file = serve.load_settings(parse("--model", str(tiny_llama_dir), "--config", str(cfg)))
    from_flag = serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-modules", "a=adapters/a"))
    assert {m.name: m.path for m in from_file.lora_modules + from_flag.lora_modules} == {n: str(tmp_path / "adapters" / n) for n in "abc"}
    assert parse_lora_module("a=/x/y").path == "/x/y"  # an absolute path stays as given


def test_duplicate_adapter_names_rejected(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        build_settings({}, normalize_keys({"model": str(tiny_llama_dir), "lora_modules": ["a=/1", "a=/2"]}, "flags"), None)


@pytest.mark.parametrize("name", ["bad\ud800name", "a b", "org/tuned", "L" * 129, "line\nbreak", "nul\x00", "-dash", "__base__"])
def test_adapter_names_the_admin_api_refuses_are_refused_at_start_up(tiny_llama_dir: Path, name: str) -> None:
    """A name the admin route refuses could not be hot-updated or unloaded there; a lone surrogate
    made GET /v1/models a 500 for everyone, a newline split the start-up summary."""
    with pytest.raises(ConfigError, match="must be 1-128 letters, digits"):
        build_settings({}, normalize_keys({"model": str(tiny_llama_dir), "lora_modules": [{"name": name, "path": "/x"}]}, "flags"), None)


def test_adapter_names_the_admin_api_accepts_are_accepted_at_start_up(tiny_llama_dir: Path) -> None:
    names = ["x", "1", "x.y-z_w", "L" * 128]
    settings = build_settings({}, normalize_keys({"model": str(tiny_llama_dir), "lora_modules": [f"{n}=/x" for n in names]}, "flags"), None)
    assert [m.name for m in settings.lora_modules] == names


def test_no_model_without_demo_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="bundled demo"):
        build_settings({}, {}, demo_model=None)


@pytest.mark.parametrize("key, value", [("model", ""), ("model", "  "), ("served_model_name", ""), ("host", ""), ("host", " ")])
def test_an_empty_model_or_served_name_is_refused(tiny_llama_dir: Path, key: str, value: str) -> None:
    """--model "$MODEL" with MODEL unset served the bundled demo; an empty served name was the folder's;
    an empty host listened on every interface, not on the default 127.0.0.1."""
    flags = {"model": str(tiny_llama_dir), key: value}
    with pytest.raises(ConfigError, match=rf"{key}: empty"):
        build_settings({}, normalize_keys(flags, "flags"), demo_model=str(tiny_llama_dir))
    with pytest.raises(ConfigError, match=rf"{key}: empty"):
        build_settings(flags, {}, demo_model=str(tiny_llama_dir))  # the same in the YAML file


def test_cli_exit_code_and_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("unknown_thing: 1\n")
    assert serve.run(parse("--config", str(cfg))) == 2
    assert "unknown_thing" in capsys.readouterr().err


def test_adapter_with_wrong_base_name_refused(tiny_llama_dir: Path, tiny_adapters) -> None:
    spec = f'{{"name": "a", "path": "{tiny_adapters["a"]}", "base_model_name": "some-other-model"}}'
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-modules", spec, "--device", "cpu"))
    with pytest.raises(ConfigError, match="base_model_name"):
        serve.build_engine(settings)


def test_a_positional_model_as_vllm_takes_it_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`lorafleet serve MODEL` (vLLM's form) was argparse's "unrecognized arguments" under 24 lines of usage."""
    from runtime.cli import main

    assert main(["serve", "meta-llama/Llama-3.2-1B", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err == ("lorafleet serve: 'meta-llama/Llama-3.2-1B': the model is given as --model meta-llama/Llama-3.2-1B "
                   "(lorafleet serve takes no positional argument)\n")  # fmt: skip


def test_a_missing_adapter_folder_is_refused_before_the_model_loads(tmp_path: Path, tiny_llama_dir: Path, tiny_adapters,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A mistyped --lora-modules path was found only after the model had loaded (minutes for a large one);
    so was an adapter named like the checkpoint. Both are checked first now, as LLM and --ray do."""
    import runtime.async_engine

    monkeypatch.setattr(runtime.async_engine, "AsyncLLMEngine", lambda config: pytest.fail("the model was loaded first"))
    missing = tmp_path / "nowhere"
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--device", "cpu", "--lora-modules", f"good={tiny_adapters['a']}", f"bad={missing}"))
    with pytest.raises(ValueError, match=f"{missing}: adapter folder does not exist"):
        serve.build_engine(settings)
    from runtime.models.hf_config import load_model_config

    clash = serve.load_settings(parse("--model", str(tiny_llama_dir), "--device", "cpu",
                                      "--lora-modules", f"{load_model_config(str(tiny_llama_dir)).name}={tiny_adapters['a']}"))  # fmt: skip
    with pytest.raises(ConfigError, match="has the served base model's name"):
        serve.build_engine(clash)


@pytest.mark.parametrize("flags", [("--num-replicas", "2"), ("--ray-address", "auto"), ("--registry-dir", "reg")])
def test_ray_only_options_without_ray_are_refused(tiny_llama_dir: Path, flags) -> None:
    key = flags[0][2:].replace("-", "_")
    with pytest.raises(ConfigError, match=f"{key}: only used by a Ray Serve deployment"):
        serve.load_settings(parse("--model", str(tiny_llama_dir), *flags))
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", *flags))  # accepted with --ray
    assert settings.ray


def test_ray_deployment_checks_declared_base_names_before_starting(tiny_llama_dir: Path, tiny_adapters, capsys) -> None:
    pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray

    spec = f'{{"name": "a", "path": "{tiny_adapters["a"]}", "base_model_name": "some-other-model"}}'
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-modules", spec, "--ray"))
    assert run_ray(settings) == 2  # refused before Ray starts: nothing to shut down
    assert "base_model_name 'some-other-model'" in capsys.readouterr().err


@pytest.mark.parametrize("model, error", [("missing", ": no such folder"), ("pickled", ": only pickled weights"),
                                          ("no-tokenizer", "/tokenizer.json: missing")])
def test_a_local_ray_start_checks_the_model_before_ray_starts(tmp_path: Path, tiny_llama_dir: Path, capsys, monkeypatch, model: str,
                                                              error: str) -> None:
    """A local cluster's replicas read the model on this machine: a bad folder is one line now, not
    32 s of Ray start-up and then replica tracebacks (exit 1)."""
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray

    started = []
    monkeypatch.setattr(ray, "init", lambda **kw: started.append(kw))
    folder = tmp_path / model
    if model == "pickled":
        folder.mkdir()
        (folder / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
        (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    if model == "no-tokenizer":
        shutil.copytree(tiny_llama_dir, folder)
        (folder / "tokenizer.json").unlink()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    settings = serve.load_settings(parse("--model", str(folder), "--ray", "--port", str(free_port()), "--registry-dir", str(tmp_path / "reg")))
    assert run_ray(settings) == 2 and not started
    err = capsys.readouterr().err
    assert err.startswith(f"lorafleet serve: {folder}{error}"), err
    # With $RAY_ADDRESS, ray.init joins that cluster, whose nodes may hold the model: not checked here.
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")

    def init_then_stop(**kw):  # type: ignore[no-untyped-def]
        started.append(kw)
        raise ConnectionError("stop here")

    monkeypatch.setattr(ray, "init", init_then_stop)
    assert run_ray(settings) == 2 and len(started) == 1  # got as far as ray.init


def test_a_local_ray_start_refuses_a_restored_adapter_named_like_the_served_base(tmp_path: Path, tiny_llama_dir: Path, capsys,
                                                                                 monkeypatch) -> None:  # fmt: skip
    """An adapter registered earlier in the --registry-dir, named like this start's --served-model-name, is
    restored with the others: it would be unreachable (requests for it reach the base)."""
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray
    from runtime.distributed.manifest import Manifest, ManifestEntry, ManifestStore

    started = []
    monkeypatch.setattr(ray, "init", lambda **kw: started.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    registry = tmp_path / "reg"
    ManifestStore(registry).save(Manifest(1, (ManifestEntry("up3", "/adapters/up3", "0" * 64, 8, 0.0),)))
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--port", str(free_port()), "--registry-dir", str(registry),
                                         "--served-model-name", "up3"))  # fmt: skip
    assert run_ray(settings) == 2 and not started
    assert "adapter 'up3', registered there earlier, has the served base model's name" in capsys.readouterr().err


def test_a_local_ray_start_checks_the_adapter_folders_before_ray_starts(tmp_path: Path, tiny_llama_dir: Path, tiny_adapters, capsys,
                                                                        monkeypatch) -> None:  # fmt: skip
    """A missing --lora-modules folder was found only after Ray and the replicas had started (13-19 s),
    having recorded the adapters listed before it; a single server says so in a second."""
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray

    started = []
    monkeypatch.setattr(ray, "init", lambda **kw: started.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    for bad, message in ((tmp_path / "nowhere", "adapter folder does not exist"), (pickled, "pickled adapter weights are refused")):
        settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--port", str(free_port()), "--registry-dir", str(tmp_path / "reg"),
                                             "--lora-modules", f"good={tiny_adapters['a']}", f"bad={bad}"))  # fmt: skip
        assert run_ray(settings) == 2 and not started
        err = capsys.readouterr().err
        assert err.startswith(f"lorafleet serve: {bad}") and message in err, err
    assert not (tmp_path / "reg" / "adapters.json").exists()


def test_a_registry_dir_that_cannot_be_made_is_found_by_trying(tmp_path: Path) -> None:
    """os.access says yes to root under /proc or on a read-only mount: the check makes (and removes) a folder."""
    from runtime.distributed.manifest import ManifestError, check_folder

    with pytest.raises(ManifestError, match="registry_dir /proc/nope/reg: cannot create"):
        check_folder("/proc/nope/reg")
    check_folder(tmp_path / "new" / "reg")
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_unanswered_ray_address_is_one_line_not_minutes_of_retries(capsys, tiny_llama_dir: Path, monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import _unreachable_gcs, run_ray

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    assert _unreachable_gcs("auto") is None and _unreachable_gcs("ray://head:10001") is None
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail("ray.init must not be reached"))
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--ray-address", f"127.0.0.1:{port}"))
    assert run_ray(settings) == 2
    assert f"Ray cluster 127.0.0.1:{port}: nothing answers there" in capsys.readouterr().err


def test_ray_deployment_refuses_an_adapter_named_like_the_checkpoint(tiny_llama_dir: Path, tiny_adapters, capsys) -> None:
    pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray
    from runtime.models.hf_config import load_model_config

    base = load_model_config(tiny_llama_dir).name
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-modules", f"{base}={tiny_adapters['a']}", "--ray"))
    assert run_ray(settings) == 2  # no --served-model-name, no base_model_name: the checkpoint's name is read here
    assert f"adapter {base!r} has the served base model's name" in capsys.readouterr().err


def test_ray_refuses_port_0_before_starting_ray(tiny_llama_dir: Path, capsys, monkeypatch) -> None:
    """A single server binds port 0 and prints the port it got; Serve's proxy picked one and
    nobody was told: ``serve --ray`` printed "serving on http://127.0.0.1:0"."""
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray

    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--device", "cpu", "--ray", "--port", "0", "--registry-dir",
                                         str(tiny_llama_dir.parent / "registry-unused")))  # fmt: skip
    assert run_ray(settings) == 2
    assert "--port 0 (any free port) does not work with --ray" in capsys.readouterr().err


def test_ray_key_must_be_boolean_and_one_replica_needs_no_ray(tmp_path: Path, tiny_llama_dir: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\nray: 'false'\n")
    with pytest.raises(ConfigError, match="ray: expected true or false"):
        serve.load_settings(parse("--config", str(cfg)))
    cfg.write_text(f"model: {tiny_llama_dir}\nnum_replicas: 1\n")  # a shared template's default: a single server is one replica
    assert not serve.load_settings(parse("--config", str(cfg))).ray


def test_adapter_named_like_the_served_base_is_refused(tiny_llama_dir: Path, tiny_adapters) -> None:
    """Such an adapter could never be reached (requests for the name go to the base): refused at startup."""
    with pytest.raises(ConfigError, match="'foo' has the served base model's name"):
        serve.load_settings(parse("--model", str(tiny_llama_dir), "--served-model-name", "foo", "--lora-modules", f"foo={tiny_adapters['a']}"))
    with pytest.raises(ConfigError, match=f"'{serve.DEMO_MODEL_NAME}' has the served base model's name"):  # the demo's base name
        serve.load_settings(parse("--device", "cpu", "--lora-modules", f"{serve.DEMO_MODEL_NAME}={tiny_adapters['a']}"))


def test_adapter_named_like_the_checkpoint_is_refused_when_it_is_the_served_name(tiny_llama_dir: Path, tiny_adapters) -> None:
    from runtime.models.hf_config import load_model_config

    checkpoint = load_model_config(str(tiny_llama_dir)).name
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--device", "cpu", "--lora-modules", f"{checkpoint}={tiny_adapters['a']}"))
    with pytest.raises(ConfigError, match="has the served base model's name"):  # the base is served under the checkpoint's name
        serve.build_engine(settings)
    renamed = serve.load_settings(parse("--model", str(tiny_llama_dir), "--served-model-name", "base", "--lora-modules", f"{checkpoint}={tiny_adapters['a']}"))
    assert [m.name for m in renamed.lora_modules] == [checkpoint]  # another served name frees the name


def test_adapter_root_without_admin_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """--adapter-root only confines the admin routes: without --enable-adapter-admin it would be ignored."""
    with pytest.raises(ConfigError, match="adapter_root: only used by the adapter admin routes; add --enable-adapter-admin"):
        serve.load_settings(parse("--model", str(tiny_llama_dir), "--adapter-root", str(tmp_path)))
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\nadapter_root: {tmp_path}\nenable_adapter_admin: false\n")
    with pytest.raises(ConfigError, match="adapter_root: only used by the adapter admin routes"):
        serve.load_settings(parse("--config", str(cfg)))
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--adapter-root", str(tmp_path), "--enable-adapter-admin"))
    assert settings.server.adapter_roots == (tmp_path.resolve(),)


@pytest.mark.parametrize(
    "text, message",
    [('enable_adapter_admin: "false"\n', "enable_adapter_admin: expected true or false, got 'false'"),
     ("api_key: 12345678\n", "api_key: expected a string, got an integer"),
     ("served_model_name: 2024\n", "served_model_name: expected a string, got 2024"),
     ("host: 0\n", "host: expected a string, got 0"),
     ("host: null\n", "host: expected a string, got None"),
     ("adapter_root: 7\nenable_adapter_admin: true\n", "adapter_root: expected a folder or a list of folders, got 7"),
     ("ray: true\nregistry_dir: [a]\n", r"registry_dir: expected a string, got \['a'\]"),
     ("ray: true\nray_address: 1\n", "ray_address: expected a string, got 1"),
     ("lora_modules: a=/x\n", "lora_modules: expected a list of adapters"),
     ("lora_modules: [{name: 2024, path: /x}]\n", "lora_modules: name, path and base_model_name must be strings")],
)  # fmt: skip
def test_yaml_server_keys_are_type_checked(tmp_path: Path, tiny_llama_dir: Path, text: str, message: str) -> None:
    """YAML can give any type; a wrong one is a ConfigError naming the key, never a truthy string or a TypeError."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\n" + text)
    with pytest.raises(ConfigError, match=message):
        serve.load_settings(parse("--config", str(cfg)))


@pytest.mark.parametrize("flags", [(), ("--api-key", "from-the-flag-123")])
def test_a_mistyped_api_key_is_not_echoed(tmp_path: Path, tiny_llama_dir: Path, flags: tuple[str, ...]) -> None:
    """An unquoted numeric key in the YAML is a ConfigError that says what type it has, never the
    key itself: the message goes to stderr, and from there to logs others can read."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\napi_key: 8675309123456\n")
    with pytest.raises(ConfigError, match="api_key: expected a string, got an integer") as info:
        serve.load_settings(parse("--config", str(cfg), *flags))
    assert "8675309123456" not in str(info.value)


def test_server_options_keep_the_api_key_out_of_their_repr() -> None:
    from runtime.server.options import ServerOptions

    shown = repr(ServerOptions(api_key="do-not-print-me"))
    assert "do-not-print-me" not in shown and "host='127.0.0.1'" in shown


def test_yaml_nullable_server_keys_mean_not_set(tmp_path: Path, tiny_llama_dir: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\nserved_model_name: null\napi_key: ~\nenable_adapter_admin: true\nhost: 0.0.0.0\n")
    server = serve.load_settings(parse("--config", str(cfg))).server
    assert (server.served_model_name, server.api_key, server.enable_adapter_admin, server.host) == (None, None, True, "0.0.0.0")


def test_help_states_the_registry_dir_default() -> None:
    from runtime.distributed.launcher import DEFAULT_REGISTRY_DIR

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    action = next(a for a in p._actions if "--registry-dir" in a.option_strings)  # noqa: SLF001
    assert f"default: ./{DEFAULT_REGISTRY_DIR}" in action.help


@pytest.mark.parametrize("flag, words", [
    ("--port", "0: any free port"), ("--max-model-len", "in tokens"), ("--num-kv-blocks", "of --block-size tokens"),
    ("--kv-cache-mb", "in MiB"), ("--max-request-bytes", "in bytes, at least 1024"), ("--ray-address", "$RAY_ADDRESS"),
])
def test_help_states_units_and_the_defaults_that_apply(flag: str, words: str) -> None:
    """The help of each size gives its unit, and the limits and fall-backs the settings apply (the
    1024-byte floor of --max-request-bytes, $RAY_ADDRESS before a local Ray) are in --help."""
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    action = next(a for a in p._actions if flag in a.option_strings)  # noqa: SLF001
    assert words in action.help


def ray_start_whose_deploy_raises(error: Exception, tmp_path: Path, tiny_llama_dir: Path, tiny_adapters, monkeypatch, capsys) -> tuple[int, str]:
    """``run_ray``'s exit status and stderr for a ``serve --ray --lora-modules a=...`` whose
    ``application.deploy`` raises ``error`` (Ray itself stood in)."""
    ray = pytest.importorskip("ray")
    from runtime.distributed import application
    from runtime.distributed.launcher import run_ray

    def deploy(cfg):  # type: ignore[no-untyped-def]
        raise error

    monkeypatch.setattr(application, "deploy", deploy)
    monkeypatch.setattr(application, "stop", lambda cfg: None)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--served-model-name", "base", "--lora-modules",
                                         f"a={tiny_adapters['a']}", "--ray", "--port", str(free_port()),
                                         "--registry-dir", str(tmp_path / "reg")))  # fmt: skip
    return run_ray(settings), capsys.readouterr().err


def test_ray_replicas_failing_the_initial_adapters_end_serve_with_one_line(tiny_llama_dir: Path, tmp_path: Path, tiny_adapters, capsys, monkeypatch) -> None:
    pytest.importorskip("ray")
    from runtime.distributed.registry_client import ReplicasFailedToApply

    error = ReplicasFailedToApply("load 'a'", "a", {"replica-1": ["a: /x: adapter folder does not exist"]})
    rc, err = ray_start_whose_deploy_raises(error, tmp_path, tiny_llama_dir, tiny_adapters, monkeypatch, capsys)
    assert rc == 2
    assert "the initial adapters could not be applied" in err and "replica replica-1" in err and "Traceback" not in err


def test_ray_start_whose_registry_restarted_while_the_initial_adapters_were_applied_says_so(tmp_path: Path, tiny_llama_dir, tiny_adapters,
                                                                                             monkeypatch, capsys) -> None:
    """deploy records --lora-modules through RegistryClient, which raises RegistryRestarted (7c07e9c)
    when the registry actor restarted without the change before the replicas applied it; the
    launcher caught only ReplicasFailedToApply, so start-up ended with a traceback."""
    pytest.importorskip("ray")
    from runtime.distributed.registry_client import RegistryRestarted

    rc, err = ray_start_whose_deploy_raises(RegistryRestarted("register a@0123"), tmp_path, tiny_llama_dir, tiny_adapters, monkeypatch, capsys)
    assert rc == 2
    assert "the initial adapters are not recorded (register a@0123: the adapter registry restarted" in err and "start again" in err, err
    assert "Traceback" not in err


def test_ray_start_whose_initial_adapter_cannot_be_read_says_so_as_a_single_server(tmp_path: Path, tiny_llama_dir, tiny_adapters,
                                                                                monkeypatch, capsys) -> None:
    """RegistryClient.validate raises the validating replica's OSError again (the admin route words it
    as a single server does): at start-up it is one line, "FILE: reason", as a single server's."""
    pytest.importorskip("ray")
    error = PermissionError(13, "Permission denied", "/adapters/a/adapter_model.safetensors")
    rc, err = ray_start_whose_deploy_raises(error, tmp_path, tiny_llama_dir, tiny_adapters, monkeypatch, capsys)
    assert (rc, err) == (2, "lorafleet serve: /adapters/a/adapter_model.safetensors: Permission denied\n"), err


@pytest.mark.parametrize("kind", ["replica_unavailable", "registry_unavailable", "busy"])
def test_ray_start_whose_initial_adapters_hit_another_admin_error_ends_with_one_line(kind: str, tmp_path: Path, tiny_llama_dir, tiny_adapters,
                                                                                   monkeypatch, capsys) -> None:
    """RegistryClient also raises an APIError 503 (the replica validating an adapter died, the
    registry is gone) or AdminBusy (too many validations on a replica) while deploy records
    --lora-modules; the launcher caught neither, so start-up ended with a traceback, not the one
    line and exit status 2 of every other start-up error."""
    pytest.importorskip("ray")
    from runtime.distributed.registry_client import RegistryUnavailable
    from runtime.server.admin_workers import AdminBusy
    from runtime.server.errors import APIError

    error = {
        "replica_unavailable": APIError(503, "load 'a': the replica validating the files stopped before it answered (RayActorError); "
                                             "nothing was recorded; retry the request", code="replica_unavailable"),
        "registry_unavailable": RegistryUnavailable("register a@0123", RuntimeError("gone"), recorded=None),
        "busy": AdminBusy("replica r1: 32 adapter loads and unloads are already in progress"),
    }[kind]
    rc, err = ray_start_whose_deploy_raises(error, tmp_path, tiny_llama_dir, tiny_adapters, monkeypatch, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lorafleet serve: registering the initial adapters failed: "), err
    assert (error.message if isinstance(error, APIError) else str(error)) in lines[0], err


@pytest.mark.parametrize("step", ["begin_deploy", "set_ready", "ingress_died", "ingress_raised"])
def test_ray_start_whose_registry_or_ingress_dies_while_deploying_ends_with_one_line(step: str, tmp_path: Path, tiny_llama_dir, monkeypatch,
                                                                                   capsys) -> None:
    """deploy resets the registry actor, deploys, marks the registry ready and has the ingress take
    its view: a registry actor or an ingress that died there (Ray's RayActorError, or the ingress's
    RayTaskError when its call to the registry failed) ended start-up with a traceback, as the
    launcher catches only lorafleet's own errors. Now it is one line naming the step, exit 2, and
    what was deployed is stopped."""
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

    def fails() -> Any:
        if step == "ingress_raised":  # the ingress's own call to the registry raised there
            raise RayTaskError("sync_registry", "Traceback (most recent call last):\n  ...\nray.exceptions.RayActorError: gone", RayActorError())
        raise ActorDiedError()

    def get(ref: Any) -> Any:
        return fails() if ref == step else None

    handle = SimpleNamespace(sync_registry=SimpleNamespace(remote=lambda: SimpleNamespace(
        result=fails if step.startswith("ingress") else lambda: None)))
    registry = SimpleNamespace(begin_deploy=SimpleNamespace(remote=lambda: "begin_deploy"), set_ready=SimpleNamespace(remote=lambda ready: "set_ready"))
    stopped = fake_ray_deploy(monkeypatch, registry, run=lambda app, **kw: handle, get=get)
    err, lines = one_line_ray_start_failure(tiny_llama_dir, tmp_path, capsys)
    what = {"begin_deploy": "resetting the adapter registry actor", "set_ready": "marking the adapter registry ready"}.get(
        step, "the ingress taking the registry's adapter set")
    cause = "RayActorError: The actor experienced an error" if step == "ingress_raised" else "ActorDiedError: The actor died unexpectedly"
    assert lines[0].startswith(f"lorafleet serve: {what} failed during start-up ({cause}"), err
    assert len(stopped) == 1  # the application and the registry actor are deleted


# A deployment's status once Serve gave up starting its replicas (ray 2.60, a constructor raising):
# serve.run's own RuntimeError says only "Failed to update the deployments ['LoraReplica']."
REPLICA_START_FAILURE = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or initial health check "
    "failing. See controller logs for details. Error:\n\x1b[36mray::ServeReplica:lorafleet:LoraReplica.initialize_and_get_metadata()"
    "\x1b[39m (pid=15713, ip=192.0.2.2, actor_id=17d1, repr=<ray.serve._private.replica.ServeReplica:lorafleet:LoraReplica object>)\n"
    '  File "/venv/ray/serve/_private/replica.py", line 1928, in initialize\n'
    "    raise RuntimeError(traceback.format_exc()) from None\n"
    "RuntimeError: Traceback (most recent call last):\n"
    '  File "/venv/ray/serve/_private/replica.py", line 4008, in _call_func_or_gen\n'
    "    result = callable(*args, **kwargs)\n"
    "             ^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/srv/lorafleet/runtime/distributed/replica.py", line 160, in __init__\n'
    "    engine = AsyncLLMEngine(engine_config)\n"
    "runtime.config.ConfigError: num_kv_blocks: 2 blocks of 8 tokens cannot hold one sequence of 64\n"
    "second line of the message"
)


def test_ray_start_whose_replicas_fail_to_start_ends_with_one_line_naming_their_error(tmp_path: Path, tiny_llama_dir, monkeypatch,
                                                                                   capsys) -> None:
    """A replica whose constructor raised made Serve give up on the deployment: serve.run raised
    its RuntimeError ("Deploying application lorafleet failed: Failed to update the deployments
    ['LoraReplica'].") and `serve --ray` ended with a traceback that did not say why. Now it is one
    line naming the deployment and the replica's own error, exit 2, and what was deployed is
    stopped."""
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from runtime.distributed import application

    def run(app: Any, **kw: Any) -> Any:
        raise RuntimeError(f"Deploying application {kw['name']} failed: Failed to update the deployments ['LoraReplica'].")

    status = SimpleNamespace(applications={"lorafleet": SimpleNamespace(deployments={
        "LoraIngress": SimpleNamespace(status="UPDATING", message=""),
        "LoraReplica": SimpleNamespace(status="DEPLOY_FAILED", message=REPLICA_START_FAILURE)})})
    registry = SimpleNamespace(begin_deploy=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(application.serve, "status", lambda: status)
    stopped = fake_ray_deploy(monkeypatch, registry, run=run, get=lambda ref: None)
    err, lines = one_line_ray_start_failure(tiny_llama_dir, tmp_path, capsys)
    assert lines[0] == ("lorafleet serve: Ray Serve could not start the application's replicas (the LoraReplica deployment: ConfigError: "
                        "num_kv_blocks: 2 blocks of 8 tokens cannot hold one sequence of 64); nothing is served (Ray's logs have the "
                        "whole error)"), err  # fmt: skip
    assert len(stopped) == 1  # the failed application and the registry actor are deleted


def test_ray_start_whose_registry_is_gone_when_the_ingress_starts_ends_with_one_line(tmp_path: Path, tiny_llama_dir, monkeypatch,
                                                                                   capsys) -> None:
    """The registry actor gone when the ingress starts (stopped between its creation and the
    deployment): the ingress's constructor waits for it a while, then raises ``RegistryMissing``,
    and Serve gives up after 3 tries. ``serve --ray`` ends with that error's one line, exit 2."""
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from runtime.distributed import application
    from runtime.distributed.registry_lookup import RegistryMissing

    error = RegistryMissing("the adapter registry actor 'lorafleet-registry-lorafleet' (namespace 'lorafleet') is not running (waited 10 s): "
                            "it was stopped, or could not restart; start the application again")  # fmt: skip
    failure = REPLICA_START_FAILURE.replace("LoraReplica", "LoraIngress").replace(
        "runtime.config.ConfigError: num_kv_blocks: 2 blocks of 8 tokens cannot hold one sequence of 64\nsecond line of the message",
        f"runtime.distributed.registry_lookup.RegistryMissing: {error}")

    def run(app: Any, **kw: Any) -> Any:
        raise RuntimeError(f"Deploying application {kw['name']} failed: Failed to update the deployments ['LoraIngress'].")

    status = SimpleNamespace(applications={"lorafleet": SimpleNamespace(deployments={
        "LoraIngress": SimpleNamespace(status="DEPLOY_FAILED", message=failure),
        "LoraReplica": SimpleNamespace(status="HEALTHY", message="")})})
    registry = SimpleNamespace(begin_deploy=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(application.serve, "status", lambda: status)
    stopped = fake_ray_deploy(monkeypatch, registry, run=run, get=lambda ref: None)
    err, lines = one_line_ray_start_failure(tiny_llama_dir, tmp_path, capsys)
    assert lines[0] == (f"lorafleet serve: Ray Serve could not start the application's replicas (the LoraIngress deployment: RegistryMissing: "
                        f"{error}); nothing is served (Ray's logs have the whole error)"), err  # fmt: skip
    assert len(stopped) == 1


def test_a_replica_start_error_without_a_traceback_is_its_first_line() -> None:
    pytest.importorskip("ray")
    from runtime.distributed.application import replica_start_error

    died = ("The deployment failed to start 3 times in a row. See controller logs for details. Error:\n"
            "The actor died unexpectedly before finishing this task.\n\tclass_name: ServeReplica:lorafleet:LoraReplica")
    assert replica_start_error(died) == "The actor died unexpectedly before finishing this task."


def test_ray_name_check_is_skipped_when_the_model_is_not_readable_here(tmp_path: Path, tiny_adapters, monkeypatch) -> None:
    """With a remote cluster the model path may exist only on the workers: without a declared
    base_model_name the adapter-name check cannot run here, and start-up goes on to deploy."""
    ray = pytest.importorskip("ray")
    from runtime.distributed import application
    from runtime.distributed.launcher import run_ray

    deployed = []

    def deploy(cfg):  # type: ignore[no-untyped-def]
        deployed.append(cfg)
        raise ValueError("stop here")  # the test ends start-up at deploy

    monkeypatch.setattr(application, "deploy", deploy)
    monkeypatch.setattr(application, "stop", lambda cfg: None)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    settings = serve.load_settings(parse("--model", str(tmp_path / "only-on-the-workers"), "--lora-modules", f"a={tiny_adapters['a']}",
                                         "--ray", "--ray-address", "ray://head:10001"))  # fmt: skip
    assert run_ray(settings) == 2 and len(deployed) == 1  # reached deploy (which the test makes fail)


def test_busy_port_or_bad_host_is_one_line_before_the_model_loads(tiny_llama_dir: Path, capsys, monkeypatch) -> None:
    """The socket is bound before the engine is built: a busy port costs no model load and
    gives one line with exit 2 (it used to log "serving on", load everything, then exit 3)."""
    import socket

    built = []
    monkeypatch.setattr(serve, "load_engine", lambda settings: built.append(settings) or pytest.fail("engine built"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve.run(parse("--model", str(tiny_llama_dir), "--port", str(port))) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and "Traceback" not in err
    assert serve.run(parse("--model", str(tiny_llama_dir), "--host", "256.1.1.1", "--port", "0")) == 2
    assert "cannot listen on 256.1.1.1:0" in capsys.readouterr().err
    assert built == []


def test_engine_errors_after_binding_release_the_port(tiny_llama_dir: Path, capsys, monkeypatch) -> None:
    import socket

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def fail(settings):  # type: ignore[no-untyped-def]
        raise ValueError("no such adapter")

    monkeypatch.setattr(serve, "load_engine", fail)
    assert serve.run(parse("--model", str(tiny_llama_dir), "--port", str(port))) == 2
    assert "no such adapter" in capsys.readouterr().err
    with socket.socket() as again:  # released: binding it again works
        again.bind(("127.0.0.1", port))


def test_unreachable_ray_cluster_is_one_line(tiny_llama_dir: Path, capsys, monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    from runtime.distributed.launcher import run_ray

    def init(**kw):  # type: ignore[no-untyped-def]
        raise ConnectionError("ray client connection timeout")

    monkeypatch.setattr(ray, "init", init)
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--ray-address", "ray://nohost:10001"))
    assert run_ray(settings) == 2
    err = capsys.readouterr().err
    assert err.strip() == "lorafleet serve: --ray-address ray://nohost:10001: ray client connection timeout"


def test_the_last_line_says_whether_the_engine_stopped_or_its_stuck_step_was_abandoned(tiny_llama_dir: Path) -> None:
    """After shutdown gave up on a stuck step (a hung device), `lorafleet serve` still ended with
    "HTTP server and engine stopped"; now the line says the step was abandoned (a WARNING)."""
    import asyncio
    import logging

    from runtime.async_engine import AsyncLLMEngine
    from runtime.request import SamplingParams
    from tests.engine_helpers import StuckStepEngine
    from tests.server.conftest import make_engine_config

    stopped = AsyncLLMEngine(make_engine_config(tiny_llama_dir))
    stopped.shutdown(timeout=5)
    assert serve.stopped_line(stopped) == (logging.INFO, "lorafleet serve: HTTP server and engine stopped")

    inner = StuckStepEngine(make_engine_config(tiny_llama_dir))
    stuck = AsyncLLMEngine(None, engine=inner)

    async def stop_during_a_step() -> None:
        async def consume() -> None:
            async for _ in stuck.generate("r", [5, 6, 7], SamplingParams(max_tokens=2)):
                pass

        request = asyncio.create_task(consume())
        assert await asyncio.to_thread(inner.entered.wait, 30)
        await asyncio.to_thread(stuck.shutdown, 0.05, 0.05)
        await asyncio.wait_for(request, 30)  # ended with the shutdown's error output

    try:
        asyncio.run(stop_during_a_step())
        level, line = serve.stopped_line(stuck)
        assert (level, line) == (logging.WARNING, "lorafleet serve: HTTP server stopped; the engine was abandoned, not closed: a step was still running")
    finally:
        inner.unstuck.set()
        stuck._thread.join(30)
        inner.close()


@pytest.mark.parametrize("signal_name, count", [("SIGTERM", 1), ("SIGINT", 2)])
def test_serve_subprocess_answers_then_drains_on_sigterm(tmp_path: Path, signal_name: str, count: int) -> None:
    """The real CLI end to end: `--port 0` picks a free port and the log names it; a request
    is answered; SIGTERM stops the HTTP server, shuts the engine down and exits 0. Ctrl-C twice
    (stop at once) too, with no traceback: uvicorn skipped the app's lifespan shutdown then,
    and the cancelled lifespan task was logged as an ERROR traceback."""
    import re
    import signal
    import subprocess
    import sys
    import time

    import httpx

    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--port", "0"], stdout=log, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).resolve().parents[1])
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"serving on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            url = found.group(1) if found else time.sleep(0.2)
        assert url is not None, log_path.read_text()
        for _ in range(100):  # the log line comes just before uvicorn starts listening
            try:
                reply = httpx.post(f"{url}/v1/completions", json={"model": "upper", "prompt": "hello world =>", "max_tokens": 16,
                                                                  "temperature": 0}, timeout=30)
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == " HELLO WORLD", reply.text
        proc.send_signal(getattr(signal, signal_name))
        if count == 2:  # the second once shutdown has begun: uvicorn then forces the exit
            deadline = time.monotonic() + 30
            while "shutting down the engine" not in log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(getattr(signal, signal_name))
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "shutting down the engine" in text and "HTTP server and engine stopped" in text
    assert "Traceback" not in text and "ERROR" not in text, text


def test_a_seed_of_64_bits_or_more_is_refused(tiny_llama_dir: Path) -> None:
    """The sampler keeps a seed's low 64 bits: --seed 2**64 drew as --seed 0 does. Requests' seeds
    stop below 2**64 (SamplingParams); the default seed does too."""
    with pytest.raises(ConfigError, match=r"seed: must be below 2\*\*64"):
        serve.load_settings(parse("--model", str(tiny_llama_dir), "--seed", str(2**64)))
    assert serve.load_settings(parse("--model", str(tiny_llama_dir), "--seed", str(2**64 - 1))).engine.seed == 2**64 - 1


def test_kv_cache_mb_with_num_kv_blocks_is_refused(tiny_llama_dir: Path) -> None:
    """kv_cache_mb only sizes the pool when num_kv_blocks is not given: both would ignore one."""
    with pytest.raises(ConfigError, match="kv_cache_mb: only sizes the KV pool when num_kv_blocks is not given"):
        serve.load_settings(parse("--model", str(tiny_llama_dir), "--num-kv-blocks", "64", "--kv-cache-mb", "16"))


def test_a_step_budget_below_max_num_seqs_is_refused(tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A step budget C below max_num_seqs S would decode only C of S running sequences a step (the
    others stall holding KV blocks): serve refuses it, from flags or the file, in one line."""
    model = ("--model", str(tiny_llama_dir))
    monkeypatch.setattr(serve, "load_engine", lambda settings: pytest.fail("the settings were accepted"))
    assert serve.run(parse(*model, "--port", "0", "--max-num-batched-tokens", "32")) == 2  # max_num_seqs' default: 64
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_num_batched_tokens: 32 is below max_num_seqs=64" in err and "Traceback" not in err
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 8\n")
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 4 is below max_num_seqs=8"):
        serve.load_settings(parse(*model, "--config", str(cfg), "--max-num-batched-tokens", "4"))
    settings = serve.load_settings(parse(*model, "--config", str(cfg), "--max-num-batched-tokens", "8"))
    assert (settings.engine.max_num_seqs, settings.engine.max_num_batched_tokens) == (8, 8)  # equal: every decode fits


def test_buffers_that_do_not_fit_name_the_setting_to_lower(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import model_runner
    from runtime.model_runner import _allocating

    beyond = r"needs [0-9.]+ GiB, more than the [0-9.]+ GiB of memory available here"
    with pytest.raises(ConfigError, match=rf"^num_kv_blocks: the KV cache \(.*\) {beyond}; lower --num-kv-blocks"):
        serve.build_engine(serve.load_settings(parse("--model", str(tiny_llama_dir), "--num-kv-blocks", str(10**10))))
    with pytest.raises(ConfigError, match=rf"^lora_pool_rows: the model \(its weights and an adapter pool of .*\) {beyond}; lower --lora-pool-rows"):
        serve.build_engine(serve.load_settings(parse("--model", str(tiny_llama_dir), "--lora-pool-rows", str(10**11))))
    # Refused before allocating, not killed while the zeros are written: a pool that Linux would hand
    # out (overcommit) but the memory cannot hold. Here "available" is made 1 MiB; 512 slots of rank 64
    # on the tiny llama are ~9 MiB of pool.
    monkeypatch.setattr(model_runner, "host_memory_available", lambda: 1 << 20)
    with pytest.raises(ConfigError, match=rf"^lora_pool_rows: .* {beyond}; lower --lora-pool-rows or --max-loras"):
        serve.build_engine(serve.load_settings(parse("--model", str(tiny_llama_dir), "--max-loras", "512", "--num-kv-blocks", "4")))
    monkeypatch.setattr(model_runner, "host_memory_available", lambda: None)  # unknown: allocate and see
    with pytest.raises(ConfigError, match=r"^num_kv_blocks: .* does not fit in cpu memory \(.*allocate.*\); lower --num-kv-blocks"):
        serve.build_engine(serve.load_settings(parse("--model", str(tiny_llama_dir), "--num-kv-blocks", str(10**10))))
    with pytest.raises(ConfigError, match=r"^x does not fit in cpu memory \(CUDA out of memory. Tried to allocate 2.00 GiB\); lower y"):
        with _allocating("x", torch.device("cpu"), "y"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore advice")
    with pytest.raises(RuntimeError, match="unrelated"):  # other errors pass through unchanged
        with _allocating("x", torch.device("cpu"), "y"):
            raise RuntimeError("unrelated")


def test_summary_states_the_kv_pool_and_where_admin_loads_from(tiny_llama_dir: Path, tmp_path: Path) -> None:
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--num-kv-blocks", "4", "--block-size", "8",
                                         "--enable-adapter-admin", "--adapter-root", str(tmp_path)))  # fmt: skip
    engine = serve.build_engine(settings)
    try:
        text = serve.summary(settings, engine)
    finally:
        engine.shutdown()
    assert "kv pool    4 blocks x 8 tokens = 32 tokens (one request: at most 32 of prompt + output)" in text
    assert "host tier  at most 32 adapters (--max-cpu-loras)\n" in text
    # The device --device auto chose, and the step budget in effect (its default depends on that device).
    assert "device     cpu (backend cpu, chosen by --device auto), dtype float32" in text
    assert "max_num_seqs=64 max_num_batched_tokens=256 max_model_len=" in text
    assert f"model      {tiny_llama_dir}; requests name it {tiny_llama_dir.name!r} (\"model\" field, GET /v1/models)" in text
    assert f"admin      on, loads from {tmp_path.resolve()}" in text
    from runtime.models.dense import float32_packed

    auto_kernel = "oneDNN on packed weights" if float32_packed("auto") else "MKL (F.linear)"
    assert f"dtype float32, float32 GEMM {auto_kernel} (auto for this CPU; --cpu-gemm to choose)" in text
    assert "float32 GEMM MKL (F.linear)\n" in serve._gemm_note("mkl", engine.engine.config.replace(cpu_gemm="mkl")) + "\n"
    assert serve._gemm_note("auto", engine.engine.config.replace(dtype="bfloat16")) == ""  # the choice does not touch bf16
    no_root = serve.load_settings(parse("--model", str(tiny_llama_dir), "--enable-adapter-admin"))
    assert serve._admin_line(no_root.server).startswith("on, unload only")


def test_summary_says_an_int8_checkpoint_runs_its_projections_int8(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An int8 checkpoint (`lorafleet quantize`) was summarised as "dtype float32, float32 GEMM oneDNN
    on packed weights": nothing said the projections run int8, and the GEMM choice, which applies to
    the untied LM head only there, read as the kernel of the whole model."""
    from runtime.commands.quantize import quantize_checkpoint
    from runtime.models.dense import float32_packed

    quantize_checkpoint(str(tiny_llama_dir), str(tmp_path / "q8"), progress=False)
    settings = serve.load_settings(parse("--model", str(tmp_path / "q8"), "--num-kv-blocks", "4"))
    engine = serve.build_engine(settings)
    try:
        text = serve.summary(settings, engine)
        tied = serve._gemm_note("auto", engine.engine.config, quantized=True, tied_head=True)
    finally:
        engine.shutdown()
    auto_kernel = "oneDNN on packed weights" if float32_packed("auto") else "MKL (F.linear)"
    assert (f"dtype float32, projections int8 (weight-only checkpoint), untied LM head float32 GEMM {auto_kernel} "
            "(auto for this CPU; --cpu-gemm to choose)") in text
    assert tied == ""  # with the head tied to the embedding no float32 GEMM is left to name


def fake_ray_deploy(monkeypatch: pytest.MonkeyPatch, registry: Any, run: Any, get: Any) -> list[Any]:
    """``application.deploy`` against fakes: Serve started, ``registry`` as the registry actor,
    ``run`` as ``serve.run``, ``get`` as ``ray.get``, no cluster. Returns the list ``stop`` appends to."""
    import ray

    from runtime.distributed import application

    stopped: list[Any] = []
    monkeypatch.setattr(application, "start_serve", lambda cfg: None)
    monkeypatch.setattr(application, "start_registry", lambda cfg: registry)
    monkeypatch.setattr(application, "build", lambda cfg: None)
    monkeypatch.setattr(application.serve, "run", run)
    monkeypatch.setattr(application, "stop", stopped.append)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return stopped


def one_line_ray_start_failure(tiny_llama_dir: Path, tmp_path: Path, capsys: Any) -> tuple[str, list[str]]:
    """``serve --ray`` on the tiny model must end with exit status 2 and one stderr line, no
    traceback: (stderr, its lines)."""
    from runtime.distributed.launcher import run_ray

    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--served-model-name", "base", "--ray", "--port", str(free_port()),
                                         "--registry-dir", str(tmp_path / "reg")))  # fmt: skip
    assert run_ray(settings) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return err, lines


class FakeRay:
    """``lorafleet serve --ray`` without a cluster: ray.init/shutdown and the application's
    deploy/drain/stop replaced, every call recorded in ``calls``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, deploy: Any = None) -> None:
        ray = pytest.importorskip("ray")
        from runtime.distributed import application

        self.calls: list[str] = []
        monkeypatch.setattr(ray, "init", lambda **kw: self.calls.append("init"))
        monkeypatch.setattr(ray, "shutdown", lambda: self.calls.append("shutdown"))
        monkeypatch.setattr(application, "deploy", lambda cfg: (self.calls.append("deploy"), deploy and deploy(cfg)))
        monkeypatch.setattr(application, "drain", lambda cfg, drain_s, interrupted: self.calls.append(f"drain {drain_s:.0f}"))
        monkeypatch.setattr(application, "stop", lambda cfg: self.calls.append("stop"))


class SignalLeaked(Exception):
    """The test's own SIGTERM handler ran: the launcher had not installed its handlers yet."""


@pytest.fixture
def sigterm_guard():
    """A SIGTERM the launcher does not handle raises SignalLeaked here instead of ending pytest."""
    import signal

    def leaked(signum: int, frame: Any) -> None:
        raise SignalLeaked()

    previous = signal.signal(signal.SIGTERM, leaked)
    yield leaked
    signal.signal(signal.SIGTERM, previous)


def ray_settings(tiny_llama_dir: Path, tmp_path: Path, *extra: str) -> Any:
    return serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--port", str(free_port()), "--registry-dir", str(tmp_path / "reg"), *extra))


def test_ray_sigterm_during_start_up_stops_once_deployed(tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch, sigterm_guard) -> None:
    """SIGTERM while deploying hit Ray's own handler: the launcher aborted (SIGABRT in
    ray.shutdown) and left Ray's agents behind. Its handlers are in force from ray.init on."""
    import os
    import signal

    from runtime.distributed.launcher import run_ray

    fake = FakeRay(monkeypatch, deploy=lambda cfg: os.kill(os.getpid(), signal.SIGTERM))
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path)) == 0
    assert fake.calls == ["init", "deploy", "stop", "shutdown"]  # no drain: nothing was served
    out = capsys.readouterr()
    assert "lorafleet serving on" not in out.out and "stopped during start-up" in out.err
    assert signal.getsignal(signal.SIGTERM) is sigterm_guard  # the launcher's handlers are gone again


def test_ray_stop_that_fails_is_one_line_and_the_teardown_still_runs(tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch, sigterm_guard) -> None:
    """Deleting the app failed (the Serve controller already gone, e.g. after a SIGTERM to the whole
    process group): the exception escaped run_ray's finally as a traceback, skipping ray.shutdown
    and the restore of the signal handlers. Now it is one line on stderr and both still run."""
    import os
    import signal

    from runtime.distributed import application
    from runtime.distributed.launcher import run_ray

    fake = FakeRay(monkeypatch, deploy=lambda cfg: os.kill(os.getpid(), signal.SIGTERM))

    def stop(cfg: Any) -> None:
        fake.calls.append("stop")
        raise RuntimeError("Failed to connect to the Serve controller\n(more lines)")

    monkeypatch.setattr(application, "stop", stop)
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path)) == 0
    assert fake.calls == ["init", "deploy", "stop", "shutdown"]
    err = capsys.readouterr().err
    assert "deleting the Serve app and its registry actor failed (RuntimeError: Failed to connect to the Serve controller)" in err, err
    assert "Traceback" not in err and "(more lines)" not in err
    assert signal.getsignal(signal.SIGTERM) is sigterm_guard


def test_ray_second_signal_during_start_up_interrupts_the_deployment(tiny_llama_dir: Path, tmp_path: Path, monkeypatch, sigterm_guard) -> None:
    import os
    import signal
    import time

    from runtime.distributed.launcher import run_ray

    finished = []

    def deploy(cfg: Any) -> None:  # a deployment that would not end by itself (e.g. replicas that cannot be placed)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        finished.append(True)

    fake = FakeRay(monkeypatch, deploy=deploy)
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path)) == 0
    assert not finished  # run_ray came back while the deployment still slept
    assert fake.calls == ["init", "deploy", "stop", "shutdown"]


def test_ray_sigterm_drains_the_application_then_stops_it(tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch, sigterm_guard) -> None:
    import os
    import signal
    import threading

    from runtime.distributed.application import DRAIN_S
    from runtime.distributed.launcher import run_ray

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))  # once serving (started by deploy)
    fake = FakeRay(monkeypatch, deploy=lambda cfg: timer.start())
    try:
        assert run_ray(ray_settings(tiny_llama_dir, tmp_path)) == 0
    finally:
        timer.cancel()
    assert fake.calls == ["init", "deploy", f"drain {DRAIN_S:.0f}", "stop", "shutdown"]
    out = capsys.readouterr()
    assert "lorafleet serving on" in out.out and f"requests in flight get up to {DRAIN_S:.0f} s" in out.err


def test_ray_busy_port_and_unusable_registry_dir_are_one_line_before_ray_starts(tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """They surfaced as Serve's "Failed to bind" and Ray's ActorDiedError: tracebacks and exit 1."""
    import socket

    from runtime.distributed.launcher import run_ray

    fake = FakeRay(monkeypatch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run_ray(serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--port", str(port), "--registry-dir", str(tmp_path / "r")))) == 2
    assert capsys.readouterr().err.strip() == f"lorafleet serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    (tmp_path / "afile").write_text("")
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path, "--registry-dir", str(tmp_path / "afile" / "sub"))) == 2
    assert capsys.readouterr().err.strip() == f"lorafleet serve: registry_dir {tmp_path / 'afile' / 'sub'}: cannot create: Not a directory"
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "adapters.json").write_text('{"format": 1, "revision": "x", "adapters": {}}')
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path, "--registry-dir", str(tmp_path / "corrupt"))) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lorafleet serve: {tmp_path / 'corrupt' / 'adapters.json'}: 'revision' must be a non-negative integer, got 'x'"
    assert fake.calls == []  # Ray never started


def test_ray_start_error_is_one_line_and_deletes_nothing(tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """E.g. Serve already runs on the cluster with its proxy on another port: refused before
    anything is deployed, so the finally must not delete an application of that name either."""
    from runtime.distributed.application import StartError
    from runtime.distributed.launcher import run_ray

    def deploy(cfg: Any) -> None:
        raise StartError("Ray Serve already runs on this cluster with its HTTP proxy on 127.0.0.1:8140, and keeps that address")

    fake = FakeRay(monkeypatch, deploy=deploy)
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path, "--ray-address", "auto")) == 2
    assert capsys.readouterr().err.strip() == "lorafleet serve: Ray Serve already runs on this cluster with its HTTP proxy on 127.0.0.1:8140, and keeps that address"
    assert fake.calls == ["init", "deploy"]  # joined, not started here: nothing to shut down either


def test_ray_log_level_reaches_the_scale_out_config(tiny_llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """--log-level went to ray.init only (Ray's own logger): the actors' lorafleet loggers stayed at
    Ray's WARNING, so the INFO request lines (with user=) were never written under --ray."""
    from runtime.distributed.launcher import run_ray

    seen = []
    monkeypatch.setattr("signal.signal", lambda *a: None)  # no handlers left behind by this run
    fake = FakeRay(monkeypatch, deploy=lambda cfg: (seen.append(cfg.log_level), (_ for _ in ()).throw(KeyboardInterrupt)))
    try:
        run_ray(ray_settings(tiny_llama_dir, tmp_path, "--log-level", "debug"))
    except KeyboardInterrupt:
        pass
    assert seen == ["debug"] and "deploy" in fake.calls


def test_apply_log_level_sets_lorafleets_loggers_only() -> None:
    import logging

    from runtime.distributed.log_level import apply_log_level

    names = ("lorafleet", "runtime", "backends", "ray")
    before = {n: logging.getLogger(n).level for n in names}
    try:
        apply_log_level("debug")
        assert [logging.getLogger(n).level for n in names[:3]] == [logging.DEBUG] * 3
        assert logging.getLogger("lorafleet.requests").getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("ray").level == before["ray"]
        with pytest.raises(ValueError, match="not one of"):
            apply_log_level("loud")
    finally:
        for n, level in before.items():
            logging.getLogger(n).setLevel(level)


def test_apply_log_level_writes_info_lines_where_the_root_logger_has_no_handler() -> None:
    """A Serve replica's root logger has no handler, so Python's last resort printed WARNING and
    up only: setting the level alone still lost the INFO request lines."""
    import subprocess
    import sys

    code = ("import logging; from runtime.distributed.log_level import apply_log_level; apply_log_level('info'); "
            "apply_log_level('info'); logging.getLogger('lorafleet.requests').info('request line user=alice'); "
            "logging.getLogger('lorafleet.requests').debug('not at info')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("INFO lorafleet.requests: request line user=alice") == 1 and "not at info" not in proc.stderr


def test_a_second_signal_inside_ray_get_during_start_up_stops_cleanly(tiny_llama_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Inside ray.get the handler's StartupInterrupted comes back as a SystemError with it as context:
    it was a traceback and exit 1."""
    from runtime.distributed.launcher import StartupInterrupted, run_ray

    def deploy(cfg):
        try:
            raise StartupInterrupted()
        except StartupInterrupted:
            raise SystemError("<built-in method __new__> returned a result with an exception set")

    monkeypatch.setattr("signal.signal", lambda *a: None)
    fake = FakeRay(monkeypatch, deploy=deploy)
    assert run_ray(ray_settings(tiny_llama_dir, tmp_path)) == 0
    assert "stopped during start-up" in capsys.readouterr().err and fake.calls[:2] == ["init", "deploy"]

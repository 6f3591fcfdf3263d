"""``--max-cpu-lora-bytes`` / ``max_cpu_lora_bytes``: sizes as written, the key in --config, the
entry bound it leaves (or not), and the Ray rule (Serve's affinity needs an entry count)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from runtime.byte_size import format_byte_size, parse_byte_size
from runtime.commands import serve
from runtime.config import ConfigError, EngineConfig


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("text, size", [("512M", 512 * 2**20), ("2G", 2 * 2**30), ("2g", 2 * 2**30), ("1.5GiB", 3 * 2**29),
                                        ("1048576", 2**20), ("100B", 100), (" 3 T ", 3 * 2**40), ("1.5K", 1536), (7, 7)])
def test_sizes_are_read_in_binary_units(text, size) -> None:
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text, says", [("2GB", "ambiguous"), ("2 GB", "write 2G or 2GiB"), ("-1", "expected a size"), ("lots", "expected a size"),
                                        ("", "expected a size"), (True, "expected a size"), (1.5, "expected a size"), (-3, "at least 0")])
def test_a_bad_size_is_one_line_that_quotes_it(text, says) -> None:
    with pytest.raises(ValueError, match=says) as err:
        parse_byte_size(text)
    assert "\n" not in str(err.value)


def test_sizes_print_in_the_largest_unit() -> None:
    assert (format_byte_size(2**31), format_byte_size(100), format_byte_size(3 * 2**20 + 5)) == ("2.0 GiB", "100 bytes", "3.0 MiB")


def test_the_flag_and_the_file_key_set_the_engine_bound(tmp_path: Path, tiny_llama_dir: Path) -> None:
    s = serve.load_settings(parse("--model", str(tiny_llama_dir), "--max-cpu-lora-bytes", "512M"))
    assert s.engine.max_cpu_lora_bytes == 512 * 2**20
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\nmax-cpu-lora-bytes: 2G\nmax_cpu_loras: 40\n")
    s = serve.load_settings(parse("--config", str(cfg)))
    assert (s.engine.max_cpu_lora_bytes, s.engine.host_tier_size) == (2 * 2**30, 40)  # both bounds
    cfg.write_text(f"model: {tiny_llama_dir}\nmax_cpu_lora_bytes: 1048576\n")
    assert serve.load_settings(parse("--config", str(cfg))).engine.max_cpu_lora_bytes == 2**20


def test_unset_changes_nothing_and_bytes_alone_count_no_entries(tiny_llama_dir: Path) -> None:
    default = serve.load_settings(parse("--model", str(tiny_llama_dir))).engine
    assert default.max_cpu_lora_bytes is None and default.host_tier_size == 32
    alone = serve.load_settings(parse("--model", str(tiny_llama_dir), "--max-cpu-lora-bytes", "1G")).engine
    assert alone.host_tier_size is None  # the default 32 would cap what the bytes allow


@pytest.mark.parametrize("line, says", [("max_cpu_lora_bytes: 2GB", "ambiguous"), ("max_cpu_lora_bytes: true", "expected a size"),
                                        ("max_cpu_lora_bytes: 0", "must be >= 1"), ("max_cpu_lora_bytes: [1]", "expected a size")])
def test_a_bad_value_names_the_key(tmp_path: Path, tiny_llama_dir: Path, line: str, says: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {tiny_llama_dir}\n{line}\n")
    with pytest.raises(ConfigError, match=f"^max_cpu_lora_bytes: .*{says}"):
        serve.load_settings(parse("--config", str(cfg)))


def test_serve_says_a_bad_flag_in_one_line(tiny_llama_dir: Path, capsys) -> None:
    assert serve.run(parse("--model", str(tiny_llama_dir), "--max-cpu-lora-bytes", "2GB", "--port", "0")) == 2
    err = capsys.readouterr().err
    assert err.startswith("lorafleet serve: max_cpu_lora_bytes: '2GB' is ambiguous") and err.count("\n") == 1, err


def test_under_ray_the_bound_reaches_the_replicas_with_an_entry_count(tiny_llama_dir: Path) -> None:
    """Replicas build their engines from ``ScaleOutConfig.replica_engine()``; Serve's affinity counts
    adapters per replica (``host_tier_size``), so bytes alone are refused under --ray."""
    with pytest.raises(ConfigError, match="under --ray give max_cpu_loras"):
        serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--max-cpu-lora-bytes", "1G"))
    settings = serve.load_settings(parse("--model", str(tiny_llama_dir), "--ray", "--max-cpu-lora-bytes", "1G", "--max-cpu-loras", "64"))
    pytest.importorskip("ray")
    from runtime.distributed.application import ScaleOutConfig

    cfg = ScaleOutConfig(engine=settings.engine, server=settings.server, num_replicas=2, registry_dir="/unused")
    assert (cfg.replica_engine().max_cpu_lora_bytes, cfg.replica_engine().host_tier_size) == (2**30, 64)
    with pytest.raises(ConfigError, match="under --ray give max_cpu_loras"):  # every way to build the application
        ScaleOutConfig(engine=EngineConfig(model=str(tiny_llama_dir), max_cpu_lora_bytes=2**30), server=settings.server, num_replicas=1,
                       registry_dir="/unused")


def test_the_bench_counts_a_synthetic_adapter_as_the_loader_does(tmp_path: Path) -> None:
    """``lorafleet bench`` refuses a --max-cpu-lora-bytes below its largest adapter before building
    anything (``LlamaShape.adapter_nbytes``): the same bytes the loaded adapter takes."""
    from runtime.bench.synthetic import ATTENTION, LlamaShape, build_random_adapter
    from runtime.lora.adapter import load_adapter

    shape = LlamaShape.sized(64, 2)
    folder = build_random_adapter(tmp_path / "a", shape, rank=8, seed=0, targets=ATTENTION)
    targets = {name: (n_in, n_out) for name, (_, n_in, n_out) in shape.module_dims().items()}
    loaded = load_adapter(folder, "a", targets, num_layers=2, max_lora_rank=64)
    assert loaded.nbytes == shape.adapter_nbytes(8, ATTENTION) == 2 * 4 * 8 * (64 + 64) * 4


def test_the_start_up_summary_states_the_host_tier_bounds(tiny_llama_dir: Path) -> None:
    def line(*flags: str) -> str:
        return serve.host_tier_line(serve.load_settings(parse("--model", str(tiny_llama_dir), *flags)).engine)

    assert line() == "at most 32 adapters (--max-cpu-loras)"
    assert line("--max-cpu-lora-bytes", "2G") == "at most 2.0 GiB (2147483648 bytes) of adapter weights; adapters not counted"
    assert line("--max-cpu-lora-bytes", "512M", "--max-cpu-loras", "40") == "at most 40 adapters and 512.0 MiB (536870912 bytes) of adapter weights"

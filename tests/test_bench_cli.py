"""`lorafleet bench` as a command: setup errors are one line and exit 2 before any weights are
written, flags the chosen mode would ignore are refused, failed requests are explained, --json
is checked up front and written atomically, and every flag's help shows its default.

Everything runs in this process through ``runtime.cli.main``; a stub HTTP server stands in for
`lorafleet serve` where a server is needed. One real run, of the smallest size."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from runtime.bench.workload import Workload, WorkloadSpec, generate, spec_from_args
from runtime.commands import bench
from tests.bench_helpers import bench_cli, one_error_line
from tests.json_stub import JsonHandler, StubServer, serving

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden", "64", "--layers", "1", "--num-requests", "4"]


# ---- setup errors: exit 2, one line naming the flag, nothing written --------------------------


@pytest.mark.parametrize("argv, want", [
    (["--max-loras", "0"], "lorafleet bench: --max-loras: must be >= 1, got 0"),
    (["--max-loras", "8", "--max-cpu-loras", "4"], "lorafleet bench: --max-cpu-loras 4 is below --max-loras 8"),
    (["--ranks", "8", "--max-cpu-lora-bytes", "16383"], "lorafleet bench: --max-cpu-lora-bytes: the workload's rank-8 adapters take 16.0 KiB (16384 bytes) each"),
    (["--ranks", "512"], "lorafleet bench: --ranks: cpu: max_rank: adapter 'lora-0000': rank 512 is outside 1..256"),
    (["--ranks", "8,0"], "lorafleet bench: --ranks: need positive ranks"),
    (["--cv", "0"], "lorafleet bench: --cv: must be > 0, got 0.0"),
    (["--num-requests", "0"], "lorafleet bench: --num-requests: must be >= 1, got 0"),
    (["--adapters", "0"], "lorafleet bench: --adapters: must be >= 1, got 0"),
    (["--input-len", "9,3"], "lorafleet bench: --input-len: need 1 <= lo <= hi, got (9, 3)"),
    (["--hidden", "0"], "lorafleet bench: --hidden: "),
    (["--input-len", "900,900"], "lorafleet bench: --input-len/--output-len: 4 of 4 requests do not fit the synthetic model's max_model_len 1024"),
    (["--hidden", "130"], "lorafleet bench: --hidden: hidden size 130 gives 2 heads of 65 channels; rotary embeddings need an even head size"),
    (["--slo-ttft", "0"], "lorafleet bench: --slo-ttft: must be a positive number"),
    (["--alpha", "-3"], "lorafleet bench: --alpha: must be >= 0, got -3.0 (0 is uniform popularity"),
    (["--adapters", "2", "--base-fraction", "1.5"], "lorafleet bench: --base-fraction: must be in [0, 1], got 1.5"),
    (["--ranks", "8", "--base-fraction", "7"], "lorafleet bench: --base-fraction: must be in [0, 1], got 7.0"),
])  # fmt: skip
def test_setup_errors_exit_2_before_any_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], want: str) -> None:
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, *argv)
    assert rc == 2
    assert one_error_line(err).startswith(want)
    assert "Traceback" not in err
    assert not work.exists()  # refused before preparing the synthetic weights


def test_an_unusable_workdir_exits_2_before_any_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for workdir, why in ((a_file, "is a file, not a folder"), (a_file / "below", f"cannot be created: {a_file} is a file")):
        rc, err = bench_cli(capsys, "--workdir", str(workdir), *SMALL)
        assert rc == 2 and one_error_line(err) == f"lorafleet bench: --workdir {workdir}: {why}", err
        assert "Traceback" not in err
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    rc, err = bench_cli(capsys, "--workdir", str(dangling), *SMALL)
    assert rc == 2 and one_error_line(err).endswith(f"{dangling} is a symlink to nothing"), err
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        rc, err = bench_cli(capsys, "--workdir", str(locked / "w"), *SMALL)
        assert rc == 2 and "is not writable" in one_error_line(err), err


def test_unavailable_device_exits_2_before_any_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import backends

    real = backends.availability
    monkeypatch.setattr(backends, "availability", lambda name: (False, f"{name}: no such device here") if name == "cuda" else real(name))
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--device", "cuda")
    assert rc == 2 and one_error_line(err) == "lorafleet bench: --device: cuda: no such device here"
    assert not work.exists()


@pytest.mark.parametrize("argv, flag, why", [
    (["--ranks", "8,x"], "--ranks", "expected comma-separated integer ranks like 8,16,32, got '8,x'"),
    (["--input-len", "8"], "--input-len", "expected two comma-separated integers lo,hi like 8,32, got '8'"),
    (["--output-len", "1,2,3"], "--output-len", "expected two comma-separated integers lo,hi"),
])  # fmt: skip
def test_malformed_values_name_their_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, why: str) -> None:
    rc, err = bench_cli(capsys, "--workdir", str(tmp_path / "w"), *argv)
    assert rc == 2 and f"argument {flag}: {why}" in err
    assert "invalid literal" not in err and "not enough values" not in err


def test_spec_flag_defaults_are_the_workload_spec_defaults() -> None:
    """The flags' defaults (shared with benchmarks/serve.py) still give WorkloadSpec's defaults,
    also from a hand-made Namespace that holds the flags' text."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert spec_from_args(p.parse_args([])) == WorkloadSpec()
    text = argparse.Namespace(**{**vars(p.parse_args([])), "ranks": "8,16", "input_len": "2,3"})
    assert spec_from_args(text) == WorkloadSpec(ranks=(8, 16), input_len=(2, 3))
    with pytest.raises(ValueError, match=r"^--ranks: expected comma-separated integer ranks"):
        spec_from_args(argparse.Namespace(**{**vars(text), "ranks": "8,x"}))


# ---- workload files ----------------------------------------------------------------------


def _saved(tmp_path: Path, **spec: object) -> Path:
    path = tmp_path / "w.jsonl"
    generate(WorkloadSpec(**{"num_requests": 3, "num_adapters": 2, "ranks": (8,), "input_len": (2, 3), "output_len": (2, 3), "rate": 0, **spec})).save(path)
    return path


@pytest.mark.parametrize("edit, want", [
    (lambda lines: ['{"foo": 1}'], "line 1: the header lacks 'spec' and 'adapter_ranks' (has: 'foo')"),
    (lambda lines: [], "empty workload file"),
    (lambda lines: ["not json"] + lines[1:], "line 1: the header is not JSON"),
    (lambda lines: ["[1, 2]"], "line 1: the header must be a JSON object, got list"),
    (lambda lines: lines[:1], "no requests after the header line"),
    (lambda lines: [lines[0].replace('"seed": 0', '"sed": 0')] + lines[1:], "line 1: spec: unknown key(s) sed; missing key(s) seed"),
    (lambda lines: [lines[0].replace('"cv": 1.0', '"cv": 0')] + lines[1:], "line 1: spec.cv: must be > 0"),
    (lambda lines: [lines[0].replace('"ranks": [8]', '"ranks": 8')] + lines[1:], "line 1: spec.ranks: expected a list of integers, got 8"),
    (lambda lines: lines[:2] + ['{"index": 2}'], "line 3: request: missing key(s) arrival_s, adapter, rank, prompt, input_words, output_tokens"),
    (lambda lines: lines[:2] + [lines[2].replace('"lora-000', '"lora-099')], "line 3: adapter: 'lora-0990' is not in the header's adapter_ranks"),
    (lambda lines: lines[:2] + ["{"], "line 3: the request is not JSON"),
    (lambda lines: lines[:2] + [lines[2].replace('"rank": 8', '"rank": 64')], "line 3: rank: expected 8, its adapter's rank in the header, got 64"),
    (lambda lines: lines[:3] + [lines[3].replace('"index": 2', '"index": 0')], "line 4: index: 0 is already the index of line 2"),
    (lambda lines: lines[:3], "the header says 3 request lines follow, found 2: the file was cut short"),
    (lambda lines: [lines[0].replace('"request_lines": 3', '"request_lines": "3"')] + lines[1:], "the header says '3' request lines follow"),
])  # fmt: skip
def test_malformed_workload_file_names_the_file_line_and_what_is_missing(tmp_path: Path, edit, want: str) -> None:  # type: ignore[no-untyped-def]
    path = _saved(tmp_path)
    lines = path.read_text().splitlines()
    assert all(key in lines[0] for key in ('"seed": 0', '"cv": 1.0', '"ranks": [8]', '"request_lines": 3')) and '"lora-000' in lines[2]  # the edits apply
    path.write_text("\n".join(edit(lines)) + "\n")
    with pytest.raises(ValueError) as info:
        Workload.load(path)
    assert str(info.value).startswith(f"{path}: ") and want in str(info.value)


def test_a_header_without_request_lines_still_loads(tmp_path: Path) -> None:
    """Files written before the header recorded its request count load as they did, unchecked."""
    path = _saved(tmp_path)
    complete = Workload.load(path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    del header["request_lines"]
    path.write_text("\n".join([json.dumps(header)] + lines[1:-1]) + "\n")  # the last request dropped too: nothing to check it by
    assert Workload.load(path) == dataclasses.replace(complete, requests=complete.requests[:-1])


@pytest.mark.parametrize("adapter", [["lora-0000"], {"name": "lora-0000"}, 7])
def test_a_request_whose_adapter_is_not_a_name_is_a_line_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                                 adapter: object) -> None:
    """A JSON list or object as a request's adapter made ``Workload.load`` raise TypeError (unhashable,
    from the adapter_ranks lookup): a traceback from `lorafleet bench --workload` instead of the line."""
    path = _saved(tmp_path)
    lines = path.read_text().splitlines()
    request = json.loads(lines[2])
    request["adapter"] = adapter
    lines[2] = json.dumps(request)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"line 3: adapter: "):
        Workload.load(path)
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), "--workload", str(path))
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: {path}: line 3: adapter: ")
    assert not work.exists()


def test_bad_workload_file_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), "--workload", str(bad))
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: {bad}: line 1: the header lacks 'spec'")
    rc, err = bench_cli(capsys, "--workdir", str(work), "--workload", str(tmp_path / "none.jsonl"))
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --workload {tmp_path / 'none.jsonl'}: No such file or directory"
    assert not work.exists()


def test_workload_file_rank_beyond_the_backend_is_refused_before_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _saved(tmp_path, ranks=(512,))
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), "--hidden", "64", "--layers", "1", "--workload", str(path))
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: --workload {path}: cpu: max_rank: adapter 'lora-0000': rank 512 is outside")
    assert not work.exists()


def test_saved_workload_loads_back_unchanged(tmp_path: Path) -> None:
    path = _saved(tmp_path, base_fraction=0.5, seed=4)
    assert Workload.load(path) == generate(WorkloadSpec(num_requests=3, num_adapters=2, ranks=(8,), input_len=(2, 3), output_len=(2, 3),
                                                        rate=0, base_fraction=0.5, seed=4))  # fmt: skip


# ---- flags a mode would ignore --------------------------------------------------------------

SPEC_FLAG_VALUES = [("--num-requests", "4"), ("--adapters", "2"), ("--popularity", "uniform"), ("--alpha", "1.0"), ("--ranks", "8"),
                    ("--rate", "0"), ("--cv", "2"), ("--input-len", "2,3"), ("--output-len", "2,3"), ("--base-fraction", "0.5"),
                    ("--seed", "1")]  # fmt: skip
ENGINE_FLAG_VALUES = [("--device", "cpu"), ("--dtype", "float32"), ("--hidden", "64"), ("--layers", "1"), ("--max-loras", "8"),
                      ("--max-cpu-loras", "32"), ("--max-cpu-lora-bytes", "2G"), ("--workdir", "/tmp/never")]  # fmt: skip


@pytest.mark.parametrize("flag, value", SPEC_FLAG_VALUES)
def test_workload_flags_are_refused_with_a_workload_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    path = _saved(tmp_path)
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), "--workload", str(path), flag, value)  # even at its default value
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: {flag}: not used with --workload")
    assert not work.exists()


def test_an_abbreviated_flag_is_refused_under_its_full_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = bench_cli(capsys, "--workload", str(_saved(tmp_path)), "--num-req", "4")
    assert rc == 2 and one_error_line(err).startswith("lorafleet bench: --num-requests: not used with --workload")


@pytest.mark.parametrize("flag, value", ENGINE_FLAG_VALUES)
def test_engine_flags_are_refused_with_url(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    rc, err = bench_cli(capsys, "--url", "http://127.0.0.1:9", flag, value)
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: {flag}: not used with --url (the server's own settings apply)"


@pytest.mark.parametrize("flag", ["--api-key", "--base-model"])
def test_url_flags_are_refused_without_url(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, flag, "x")
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: {flag}: only used with --url"
    assert not work.exists()


def test_alpha_is_refused_unless_popularity_is_zipf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--popularity", "uniform", "--alpha", "2")
    assert rc == 2 and one_error_line(err) == "lorafleet bench: --alpha: only used with --popularity zipf, not uniform"
    # with zipf (given or the default) --alpha is used: the error is the next one, not about --alpha
    for popularity in (["--popularity", "zipf"], []):
        rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, *popularity, "--alpha", "2", "--max-loras", "0")
        assert rc == 2 and one_error_line(err) == "lorafleet bench: --max-loras: must be >= 1, got 0"


@pytest.mark.parametrize("flags, message", [
    (["--rate", "0", "--cv", "3"], "--cv: only used with arrivals at a --rate above 0 (at 0 every request arrives at once)"),
    (["--base-fraction", "1", "--ranks", "4,8"], "--ranks: no request uses an adapter with --base-fraction 1"),
    (["--popularity", "identical", "--adapters", "40"], "--adapters: with --popularity identical every request uses the one adapter"),
    (["--adapters", "1", "--popularity", "uniform"], "--popularity: with --adapters 1 every request that uses an adapter uses the one adapter"),
    (["--adapters", "1", "--alpha", "2"], "--alpha: with --adapters 1 every request that uses an adapter uses the one adapter"),
])
def test_workload_flags_the_others_make_meaningless_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, message) -> None:
    """Each changed no request (the workload came out the same with or without it), in
    lorafleet bench and in python -m runtime.bench.workload alike."""
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, *flags)
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: {message}"
    assert not work.exists()
    proc = subprocess.run([sys.executable, "-m", "runtime.bench.workload", *flags, "--out", str(tmp_path / "w.jsonl")],
                          cwd=ROOT, timeout=120, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr and not (tmp_path / "w.jsonl").exists()


def test_adapter_names_beyond_the_first_are_refused_when_every_request_uses_one_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    """With --popularity identical every request went to the most popular name; the others got none."""
    rc, err = bench_cli(capsys, "--url", "http://127.0.0.1:9", "--adapter-names", "upper,reverse", "--popularity", "identical")
    assert rc == 2 and one_error_line(err) == ("lorafleet bench: --adapter-names: gives 2 names but --popularity identical sends every "
                                               "request to one adapter; give one name, or another --popularity")  # fmt: skip


def test_every_ignored_flag_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = bench_cli(capsys, "--url", "http://127.0.0.1:9", "--hidden", "64", "--device", "cpu")
    assert rc == 2 and err.count("not used with --url") == 2 and "--hidden:" in err and "--device:" in err


# ---- --url ------------------------------------------------------------------------------------


class _Stub(JsonHandler):
    """A stand-in for `lorafleet serve`: /v1/models per ``server.models`` (status, body); every
    completion answers 404 (no such adapter). Records the paths asked for, and each GET's Authorization header."""

    def do_GET(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self.server.auth.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        if self.path == "/v1/models":
            self._reply(*self.server.models)  # type: ignore[attr-defined]
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if not body.get("stream"):  # the replay's untimed warm-up request
            self._reply(200, {"choices": [{"text": "ok"}]})
            return
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self._reply(404, {"error": {"message": "The model `lora-0000` does not exist.", "code": 404}})


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with serving(_Stub, paths=[], auth=[], models=(200, {"object": "list", "data": [{"id": "base", "object": "model"}]})) as server:
        yield server


def _url(server: StubServer) -> str:
    return server.url


def test_unreachable_server_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, err = bench_cli(capsys, "--url", f"http://127.0.0.1:{port}", "--num-requests", "2")
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: --url http://127.0.0.1:{port}: ConnectError: ")


@pytest.mark.parametrize("url, why", [("ftp://host", "expected http://HOST:PORT or https://HOST:PORT"), ("localhost:8000", "expected http://"),
                                      ("http://[::1", "Invalid IPv6 URL")])  # fmt: skip
def test_malformed_url_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], url: str, why: str) -> None:
    rc, err = bench_cli(capsys, "--url", url, "--num-requests", "2")
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: --url {url}: {why}")


@pytest.mark.parametrize("status, want", [
    (401, "HTTP 401 Unauthorized: {\"detail\": \"bad key\"} (the server wants a key: pass --api-key)"),
    (404, "HTTP 404 Not Found: {\"detail\": \"bad key\"} (is this a lorafleet/OpenAI-compatible server?)"),
])  # fmt: skip
def test_model_list_refused_is_one_line_exit_2(stub: StubServer, capsys: pytest.CaptureFixture[str], status: int, want: str) -> None:
    stub.models = (status, {"detail": "bad key"})  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", _url(stub) + "/", "--num-requests", "2")
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --url {_url(stub)}/: GET {_url(stub)}/v1/models: {want}"
    assert stub.paths == ["/v1/models"]  # the trailing slash is not doubled; nothing else is sent  # type: ignore[attr-defined]


def test_serve_benchmark_sends_the_api_key_and_says_when_one_is_wanted(stub: StubServer, tmp_path: Path) -> None:
    """benchmarks/serve.py had no --api-key: a keyed server was a bare 401 with no way round it."""
    stub.models = (401, {"detail": "bad key"})  # type: ignore[attr-defined]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--out", str(tmp_path / "o"), "--url", _url(stub), "--baselines", "none",
           "--sweep-adapters", "", "--sweep-rates", ""]  # fmt: skip
    for extra, hint in (([], "the server wants a key: pass --api-key"), (["--api-key", "k"], "check --api-key")):
        proc = subprocess.run(cmd + extra, cwd=ROOT, timeout=120, capture_output=True, text=True)
        assert proc.returncode == 2 and "HTTP 401 Unauthorized" in proc.stderr and hint in proc.stderr, proc.stderr
    assert stub.auth == [None, "Bearer k"]  # type: ignore[attr-defined]


def test_not_a_model_list_is_one_line_exit_2(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    stub.models = (200, {"data": []})  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", _url(stub), "--num-requests", "2")
    assert rc == 2 and "not an OpenAI model list with at least one model" in one_error_line(err)


def test_served_base_model_strips_the_trailing_slash(stub: StubServer) -> None:
    from runtime.bench.replay import served_base_model

    assert served_base_model(_url(stub) + "/") == "base"
    assert stub.paths == ["/v1/models"]  # type: ignore[attr-defined]


def test_failed_requests_exit_1_and_say_why(stub: StubServer, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    stub.models = (200, {"object": "list", "data": [{"id": "base", "object": "model"}, {"id": "lora-0000", "object": "model"}]})  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", _url(stub), "--num-requests", "4", "--rate", "0", "--popularity", "identical", "--json", str(out))
    assert rc == 1
    lines = [line for line in err.splitlines() if line.startswith(("lorafleet bench:", "  "))]
    assert lines[0] == "lorafleet bench: 4 of 4 requests failed; the distinct errors:"
    assert lines[1].startswith("  HTTP 404: ") and "The model `lora-0000` does not exist." in lines[1] and lines[1].endswith("(4 requests)")
    data = json.loads(out.read_text())
    assert data["summary"]["requests_failed"] == 4 and data["setup"] == {"url": _url(stub), "base_model": "base"}
    assert "machine" not in data  # over --url the server's machine is unknown here: not described as this one
    assert stub.paths.count("/v1/completions") == 4  # type: ignore[attr-defined]


def test_failures_show_at_most_three_distinct_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.bench.replay import RequestRecord

    records = [RequestRecord(i, None, 0.0, error=f"error {i % 5}") for i in range(10)] + [RequestRecord(10, None, 0.0)]
    bench._report_failures(records)
    err = capsys.readouterr().err.splitlines()
    assert err == ["lorafleet bench: 10 of 11 requests failed; the first 3 of 5 distinct errors:",
                   "  error 0 (2 requests)", "  error 1 (2 requests)", "  error 2 (2 requests)"]  # fmt: skip


def test_missing_httpx_is_a_clear_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx -> ImportError
    rc, err = bench_cli(capsys, "--url", "http://127.0.0.1:9", "--num-requests", "2")
    assert rc == 2 and one_error_line(err).startswith("lorafleet bench: --url: needs the httpx package")


def test_httpx_is_a_main_dependency() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "httpx" for d in deps), deps


# ---- --json ---------------------------------------------------------------------------------


def test_json_folder_is_checked_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "w"
    missing = tmp_path / "no" / "s.json"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--json", str(missing))
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --json {missing}: folder {missing.parent} does not exist"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--json", str(tmp_path))
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --json {tmp_path}: is a folder; give a file path"
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--json", str(a_file / "s.json"))
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --json {a_file / 's.json'}: {a_file} is a file, not a folder"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a read-only folder (root may write anywhere)
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--json", str(tmp_path / "s.json"))
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --json {tmp_path / 's.json'}: folder {tmp_path} is not writable"
    assert not work.exists()


def test_an_existing_file_is_kept_unless_forced_and_the_workload_always(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json (and the workload tool's --out) used to replace any file there, the workload being
    replayed included; now an existing file needs --force, and the input file is never written."""
    saved = tmp_path / "w.jsonl"
    make = [sys.executable, "-m", "runtime.bench.workload", "--num-requests", "3", "--adapters", "2", "--input-len", "2,3",
            "--output-len", "2,3", "--rate", "0", "--out", str(saved)]  # fmt: skip
    assert subprocess.run(make, cwd=ROOT, timeout=120, capture_output=True, text=True).returncode == 0
    workload = saved.read_bytes()
    again = subprocess.run(make, cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert again.returncode == 2 and f"--out {saved}: already exists; choose a new file or pass --force" in again.stderr, again.stderr
    assert subprocess.run([*make, "--force"], cwd=ROOT, timeout=120, capture_output=True, text=True).returncode == 0
    work = tmp_path / "w"
    tiny = ["--hidden", "64", "--layers", "1"]
    for extra in ([], ["--force"]):
        rc, err = bench_cli(capsys, "--workdir", str(work), *tiny, "--workload", str(saved), "--json", str(saved), *extra)
        assert rc == 2 and one_error_line(err) == f"lorafleet bench: --json {saved}: is the input file {saved}; write elsewhere", err
    precious = tmp_path / "precious.json"
    precious.write_text("precious")
    rc, err = bench_cli(capsys, "--workdir", str(work), *tiny, "--workload", str(saved), "--json", str(precious))
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: --json {precious}: already exists; choose a new file or pass --force to replace it"
    rc, err = bench_cli(capsys, "--workdir", str(work), *SMALL, "--force")
    assert rc == 2 and one_error_line(err) == "lorafleet bench: --force: only applies to --json, which was not given"
    assert precious.read_text() == "precious" and not work.exists()
    assert len(saved.read_bytes()) == len(workload)  # rewritten by --force with the same spec, never by bench
    rc, err = bench_cli(capsys, "--workdir", str(work), *tiny, "--workload", str(saved), "--json", str(precious), "--force")
    assert rc == 0, err
    assert json.loads(precious.read_text())["summary"]


def test_json_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.json"
    path.write_text("old")

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("disk full")

    monkeypatch.setattr(bench.json, "dumps", broken)
    with pytest.raises(RuntimeError):
        bench._write_json(path, {"a": 1})
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # no half-written file, no temp left


@pytest.mark.parametrize("damage", ["truncated model", "broken config", "truncated adapter"])
def test_a_damaged_file_left_in_the_workdir_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    """The synthetic files are reused by later runs; one damaged since (a disk filled up mid-write)
    gave a traceback and exit 1."""
    work = tmp_path / "w"
    flags = ["--workdir", str(work), *SMALL, "--adapters", "2", "--ranks", "8", "--rate", "0", "--input-len", "2,3", "--output-len", "2,3"]
    assert bench_cli(capsys, *flags)[0] == 0
    model = next(work.glob("llama-*"))
    if damage == "truncated model":
        (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:1000])
    elif damage == "broken config":
        (model / "config.json").write_text("{")
    else:
        weights = next(work.glob("adapters/*/adapter_model.safetensors"))
        weights.write_bytes(weights.read_bytes()[:100])
    rc, err = bench_cli(capsys, *flags)
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]  # after the progress lines
    assert line.startswith(f"lorafleet bench: --workdir {work}: a file an earlier run left there does not load (") and "delete it" in line, line


def test_a_small_run_exits_0_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "summary.json"
    from runtime.cli import main

    rc = main(["bench", "--workdir", str(tmp_path / "w"), *SMALL, "--adapters", "2", "--popularity", "distinct", "--ranks", "8", "--rate", "0",
               "--input-len", "2,3", "--output-len", "2,3", "--json", str(out)])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(out.read_text())
    assert data["summary"]["requests_ok"] == 4 and data["summary"]["requests_failed"] == 0
    # two requests per adapter (distinct): tied for most and for fewest, so both are on both sides
    fair = data["summary"]["fairness"]
    assert sorted(fair["most_popular"]) == sorted(fair["least_popular"]) == ["lora-0000", "lora-0001"]
    assert fair["ratio"] == pytest.approx(fair["least_popular_p99_ttft_s"] / fair["most_popular_p99_ttft_s"], rel=1e-12) and fair["ratio"] >= 1
    assert f"fairness: p99 TTFT of the least popular adapter / the most popular = {fair['ratio']:.2f}" in captured.out
    assert "SLO: share of requests with TTFT <= 2 s and TPOT <= 0.5 s (--slo-ttft, --slo-tpot)" in captured.out  # what the SLO column is
    assert data["workload"]["spec"]["num_requests"] == 4
    assert data["setup"]["device"] == "cpu" and data["setup"]["hidden_size"] == int(SMALL[SMALL.index("--hidden") + 1])
    assert data["setup"]["max_num_batched_tokens"] == 256  # the cpu's default step budget, spelt out
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"] and data["machine"]["torch"]  # which machine these figures are from
    # the line that says what ran, above the table
    assert "4 requests, arriving all at once, in-process on cpu (float32;" in captured.out and "tok/s = output tokens / that time" in captured.out
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open() makes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "w"]
    assert "requests failed" not in captured.err
    assert "warming up" not in captured.err  # the CPU backend compiles nothing: no untimed run first
    # stderr is no terminal here (a CI log, `2> file`): plain progress lines, none of a bar's \r redraws
    assert "\r" not in captured.err and "requests: 4/4 req (100%)" in captured.err.splitlines(), captured.err


def test_off_the_cpu_an_untimed_run_of_the_same_requests_comes_first(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the first launch of each kernel variant compiles it; the timed run must not pay that.
    Stood in for on the CPU: the warm-up decision says cuda, the runs still use the CPU engine."""
    from runtime.bench import suite

    calls = []
    real = suite.run_lorafleet

    def spy(workload, setup, model_dir, adapters, label="lorafleet", **kwargs):  # type: ignore[no-untyped-def]
        calls.append((label, [(r.index, r.arrival_s) for r in workload.requests]))
        return real(workload, setup, model_dir, adapters, label, **kwargs)

    monkeypatch.setattr(suite, "run_lorafleet", spy)
    monkeypatch.setattr(suite, "full_warmup_device", lambda device: "cuda")
    rc, err = bench_cli(capsys, "--workdir", str(tmp_path / "w"), *SMALL, "--adapters", "2", "--ranks", "8", "--rate", "50",
                        "--input-len", "2,3", "--output-len", "2,3")  # fmt: skip
    assert rc == 0, err
    assert "warming up on cuda: one untimed run of the 4 requests" in err
    assert [label for label, _ in calls] == ["warm-up", "lorafleet"]
    (_, warm), (_, timed) = calls
    assert [i for i, _ in warm] == [i for i, _ in timed] and all(t == 0.0 for _, t in warm)
    assert any(t > 0 for _, t in timed)  # the timed run keeps the workload's arrival times
    assert "arrive over" not in err  # 4 requests at 50/s: no notice


def test_a_long_replay_says_how_long_before_it_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """At 0.001 requests/s four requests arrive over about an hour; the bar alone would look stuck.
    The run is stood in for by a Ctrl-C, so the test does not wait."""
    from runtime.bench import suite

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "run_lorafleet", interrupted)
    flags = ["--workdir", str(tmp_path / "w"), *SMALL, "--adapters", "2", "--ranks", "8", "--rate", "0.001", "--input-len", "2,3", "--output-len", "2,3"]
    rc, err = bench_cli(capsys, *flags)
    assert rc == 130, err
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    span = generate(spec_from_args(p.parse_args(flags))).arrival_span_s
    assert span > 600  # the workload it announces is that long
    notice = f"the requests arrive over {bench.duration_text(span)}, so the run takes at least that long (Ctrl-C stops it; a higher --rate shortens it)"
    assert notice in err, err
    assert err.index(notice) < err.index("interrupted")


@pytest.mark.parametrize("seconds, text", [(45, "45 s"), (119.4, "119 s"), (600, "10 min"), (5400, "90 min"), (9000, "2.5 h"), (259200, "3.0 days")])
def test_durations_read_as_people_say_them(seconds: float, text: str) -> None:
    assert bench.duration_text(seconds) == text


# ---- help ------------------------------------------------------------------------------------


def test_every_flag_has_help_with_its_default_and_the_exit_codes_are_documented() -> None:
    p = argparse.ArgumentParser(prog="lorafleet bench")
    bench.add_arguments(p)
    for action in p._actions:
        if action.dest != "help":
            assert action.help and "(default: " in action.help, action.option_strings
    text = p.format_help()
    assert str(bench.DEFAULT_WORKDIR) in text and "(default: 8,16,32,64)" in text
    assert "exit codes:\n  0  every request succeeded\n  1  the run finished but some requests failed" in text
    assert "Exit codes: 0 every request succeeded; 1 the run finished but some requests failed" in bench.__doc__
    assert "2  bad input or setup" in text and "2 bad input or setup" in bench.__doc__
    assert "130  stopped with Ctrl-C: no summary or --json written" in text and "130 stopped with Ctrl-C" in bench.__doc__  # as README says


def test_the_length_check_counts_the_synthetic_tokenizer_exactly(tmp_path: Path) -> None:
    """A prompt is its bytes + the bos on the synthetic model's tokenizer: a request that fills the
    context exactly passes the check, one token more is refused."""
    from types import SimpleNamespace

    from runtime.bench.synthetic import write_byte_tokenizer
    from runtime.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path, 300, model_max_length=1024)
    prompt = "héllo wörld " * 40
    assert len(Tokenizer(tmp_path).encode(prompt)) == len(prompt.encode()) + bench.SYNTHETIC_PROMPT_SPECIAL_TOKENS
    args = argparse.Namespace(workload=None)
    fits = len(prompt.encode()) + bench.SYNTHETIC_PROMPT_SPECIAL_TOKENS
    request = SimpleNamespace(prompt=prompt, index=0)
    bench._check_fits(args, SimpleNamespace(requests=[SimpleNamespace(**vars(request), output_tokens=1024 - fits)]), 1024)
    with pytest.raises(bench.SetupError, match="1 of 1 requests do not fit"):
        bench._check_fits(args, SimpleNamespace(requests=[SimpleNamespace(**vars(request), output_tokens=1025 - fits)]), 1024)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path, interactive_sigint: None) -> None:
    """Ctrl-C during the replay printed three chained tracebacks (asyncio's, the engine's and its
    thread join's); now one line, exit 130, and no --json written."""
    import signal

    json_path = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "--hidden", "64", "--layers", "1", "--workdir", str(tmp_path / "w"),
           "--num-requests", "40", "--rate", "2", "--json", str(json_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        seen = ""
        while "requests:" not in seen:  # the replay's progress bar has started
            char = proc.stderr.read(1)  # type: ignore[union-attr]
            assert char, "bench ended before its replay started"
            seen += char
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "lorafleet bench: interrupted; no summary or --json written" in err and "Traceback" not in err, err[-2000:]
    assert not json_path.exists()

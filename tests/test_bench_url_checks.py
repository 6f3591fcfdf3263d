"""`lorafleet bench --url`: what the server's model list (GET /v1/models) must allow before any
request is sent, and --adapter-names, which maps the workload's adapters onto served ones.

A stub HTTP server checks that a refused run sends nothing but GET /v1/models; the bundled demo
server (in this process, on a free port) shows the user's case end to end: the workload's
lora-0000... names are refused, too-long prompts are refused, and --adapter-names
upper,reverse,rot13 with prompts that fit runs with no failures."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.bench.replay import base_model_of
from runtime.bench.workload import WorkloadSpec, generate
from runtime.commands import bench
from tests.bench_helpers import bench_cli, one_error_line
from tests.json_stub import JsonHandler, StubServer, serving


def card(name: str, parent: str | None = "base", **extra: Any) -> dict[str, Any]:
    return {"id": name, "object": "model", "parent": parent, **extra}


class _Stub(JsonHandler):
    """/v1/models answers ``server.cards``; POST /tokenize is a 404 (an OpenAI-style server without
    vLLM's route) unless ``server.tokens_per_byte`` is set, then it counts that many tokens per
    prompt byte; each completion is recorded (its body's model) and fails with 500, so a run that
    sends any exits 1."""

    def do_GET(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self._reply(200, {"object": "list", "data": self.server.cards})  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.path == "/tokenize":
            per_byte = getattr(self.server, "tokens_per_byte", None)
            if per_byte is None:
                self._reply(404, {"detail": "Not Found"})
            else:
                self._reply(200, {"count": int(len(body["prompt"].encode()) * per_byte), "max_model_len": 0, "tokens": []})
            return
        if not body.get("stream"):  # the replay's untimed warm-up request
            self.server.warmups.append(body["model"])  # type: ignore[attr-defined]
            self._reply(200, {"choices": [{"text": "ok"}]})
            return
        self.server.models.append(body["model"])  # type: ignore[attr-defined]
        self._reply(500, {"error": {"message": "stub", "code": "stub"}})


def completions_sent(server: StubServer) -> bool:
    return any(p not in ("/v1/models", "/tokenize") for p in server.paths)  # type: ignore[attr-defined]


def test_an_untimed_warm_up_goes_to_the_base_model_first(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = bench_cli(capsys, "--url", stub.url, "--num-requests", "3", "--rate", "0", "--adapters", "1", "--adapter-names", "upper")
    assert rc == 1 and stub.warmups == ["base"] and len(stub.models) == 3  # type: ignore[attr-defined]


@pytest.fixture
def stub() -> Iterator[StubServer]:
    cards = [card("base", None, max_model_len=4096), *(card(n, max_model_len=4096) for n in ("upper", "reverse", "rot13"))]
    with serving(_Stub, paths=[], models=[], warmups=[], cards=cards) as server:
        yield server


def url(server: StubServer) -> str:
    return server.url


SMALL = ["--num-requests", "6", "--rate", "0", "--output-len", "4,8"]


# ---- adapter names ------------------------------------------------------------------------------


def test_unserved_workload_adapters_are_refused_before_any_request(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, "--adapters", "3", "--popularity", "distinct")
    line = one_error_line(err)
    assert rc == 2 and line.startswith(f"lorafleet bench: --url {url(stub)}: does not serve the adapters lora-0000, lora-0001, lora-0002 that")
    assert "lists: base (base), upper, reverse, rot13" in line and "--adapter-names upper,reverse,rot13" in line
    assert stub.paths == ["/v1/models"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("argv, hint", [
    (["--adapters", "5", "--popularity", "distinct"], "--adapter-names upper,reverse,rot13 in place of --adapters 5, or"),
    ([], "--adapter-names upper,reverse,rot13, or"),  # the default 16 adapters: it named a redundant --adapters 3
    (["--popularity", "identical"], "--adapter-names upper, or"),  # one adapter takes every request: three names were refused
])
def test_the_fix_for_fewer_served_adapters_is_a_command_that_works(stub: StubServer, capsys: pytest.CaptureFixture[str],
                                                                   argv: list[str], hint: str) -> None:
    """The hint, applied as it says (the names added, the --adapters it names dropped), passes
    every check: the run sends its requests (which the stub fails: exit 1)."""
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, *argv)
    line = one_error_line(err)
    assert rc == 2 and f"map them onto served adapters with {hint}" in line, line
    names = hint.split()[1].rstrip(",")
    fixed = list(argv)
    if "in place of --adapters" in hint:
        at = fixed.index("--adapters")
        del fixed[at:at + 2]
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, *fixed, "--adapter-names", names)
    assert rc == 1 and completions_sent(stub), err


def test_the_fix_says_when_the_server_lists_no_adapters(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    stub.cards = [card("base", None)]  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL)
    assert rc == 2 and "the server lists no adapters: load some, or pass --base-fraction 1" in one_error_line(err)
    assert "/v1/completions" not in stub.paths  # type: ignore[attr-defined]


def test_unserved_base_model_is_refused(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--base-model", "nope")
    assert rc == 2 and one_error_line(err).startswith(f"lorafleet bench: --base-model nope: not served by {url(stub)} (GET /v1/models lists: base (base),")
    assert stub.paths == ["/v1/models"]  # type: ignore[attr-defined]


def test_the_base_is_the_card_without_a_parent() -> None:
    assert base_model_of([card("upper"), card("base", None)]) == "base"
    assert base_model_of([{"id": "first"}, {"id": "second"}]) == "first"  # an OpenAI-style list: no parent fields


# ---- --adapter-names ----------------------------------------------------------------------------


def test_adapter_names_map_the_most_requested_adapter_to_the_first_name(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num-requests", "30", "--rate", "0", "--output-len", "2,2", "--popularity", "uniform", "--seed", "3"]
    workload = generate(WorkloadSpec(num_requests=30, num_adapters=3, popularity="uniform", rate=0, output_len=(2, 2), seed=3))
    counts = {a: sum(r.adapter == a for r in workload.requests) for a in workload.adapter_ranks}
    assert sorted(counts.values(), reverse=True) != list(counts.values())  # lora-0000 is not the most requested: the order matters
    rc, _ = bench_cli(capsys, "--url", url(stub), *argv, "--adapter-names", "upper,reverse,rot13")
    assert rc == 1 and len(stub.models) == 30  # sent (the stub fails every completion); requests run concurrently: compare counts  # type: ignore[attr-defined]
    by_popularity = sorted(counts, key=lambda a: (-counts[a], a))
    want = dict(zip(by_popularity, ["upper", "reverse", "rot13"]))
    sent = {name: stub.models.count(name) for name in ("upper", "reverse", "rot13")}  # type: ignore[attr-defined]
    assert sent == {want[a]: counts[a] for a in counts} and sent["upper"] >= sent["reverse"] >= sent["rot13"]


def test_adapter_names_ties_keep_the_workload_order() -> None:
    workload = generate(WorkloadSpec(num_requests=6, num_adapters=3, popularity="distinct", rate=0))
    args = argparse.Namespace(adapter_names=("c", "b", "a"), workload=None)
    assert bench._adapter_mapping(args, workload) == {"lora-0000": "c", "lora-0001": "b", "lora-0002": "a"}


@pytest.mark.parametrize("argv, want", [
    (["--adapters", "4", "--adapter-names", "upper,reverse,rot13"],
     "lorafleet bench: --adapter-names: gives 3 names but --adapters is 4; give one name per adapter, or drop --adapters"),
    (["--base-fraction", "1", "--adapter-names", "upper,reverse,rot13"],
     "lorafleet bench: --adapter-names: not used: every request names the base model (--base-fraction 1)"),
])  # fmt: skip
def test_contradictory_adapter_names_are_refused_before_the_model_list(stub: StubServer, capsys: pytest.CaptureFixture[str],
                                                                        argv: list[str], want: str) -> None:  # fmt: skip
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, *argv)
    assert rc == 2 and one_error_line(err).startswith(want)
    assert stub.paths == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("names, want", [
    ("upper,nope", "lorafleet bench: --adapter-names: nope: not served by {url} (GET /v1/models lists: base (base), upper, reverse, rot13)"),
    ("upper,base", "lorafleet bench: --adapter-names: base is the base model, not an adapter"),
])  # fmt: skip
def test_unserved_adapter_names_are_refused(stub: StubServer, capsys: pytest.CaptureFixture[str], names: str, want: str) -> None:
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, "--adapter-names", names)
    assert rc == 2 and one_error_line(err).startswith(want.format(url=url(stub)))
    assert stub.paths == ["/v1/models"]  # type: ignore[attr-defined]


def test_adapter_names_must_match_a_workload_files_adapters(stub: StubServer, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    generate(WorkloadSpec(num_requests=4, num_adapters=2, rate=0, input_len=(2, 3), output_len=(2, 3))).save(path)
    rc, err = bench_cli(capsys, "--url", url(stub), "--workload", str(path), "--adapter-names", "upper,reverse,rot13")
    assert rc == 2 and one_error_line(err) == (f"lorafleet bench: --adapter-names: gives 3 names but --workload {path} has 2 adapters "
                                               "(lora-0000, lora-0001); give one name per adapter")  # fmt: skip
    assert stub.paths == []  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", url(stub), "--workload", str(path))  # the file's own names: refused, with the fix
    assert rc == 2 and one_error_line(err).endswith("map them onto served adapters with --adapter-names upper,reverse")
    rc, _ = bench_cli(capsys, "--url", url(stub), "--workload", str(path), "--adapter-names", "upper,reverse")
    assert rc == 1 and set(stub.models) <= {"upper", "reverse"} and len(stub.models) == 4  # type: ignore[attr-defined]


@pytest.mark.parametrize("argv, want", [
    (["--adapter-names", "a,b,a"], "argument --adapter-names: each name at most once (one served adapter per workload adapter); repeated: a"),
    (["--adapter-names", "a,,b"], "argument --adapter-names: expected comma-separated adapter names"),
])  # fmt: skip
def test_malformed_adapter_names(capsys: pytest.CaptureFixture[str], argv: list[str], want: str) -> None:
    rc, err = bench_cli(capsys, "--url", "http://127.0.0.1:9", *argv)
    assert rc == 2 and want in err


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_a_url_ending_in_v1_is_refused_with_the_root_to_give(stub: StubServer, capsys: pytest.CaptureFixture[str], suffix: str) -> None:
    """The OpenAI client's base_url ends in /v1 (README's example: base_url="http://127.0.0.1:8000/v1"),
    and so does a copy of it into --url. bench adds /v1/models itself, so it asked for /v1/v1/models:
    lorafleet's 404 came back as "is this a lorafleet/OpenAI-compatible server?", and a server that
    answers any path would have been benchmarked at /v1/v1/completions."""
    rc, err = bench_cli(capsys, "--url", url(stub) + suffix, *SMALL, "--base-fraction", "1")
    assert rc == 2 and one_error_line(err) == (f"lorafleet bench: --url {url(stub)}{suffix}: give the server's root, without /v1 "
                                               f"(bench adds /v1/models, /v1/completions and /tokenize itself): --url {url(stub)}")
    assert stub.paths == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("argv", [["--adapter-names", "upper"], ["--no-length-check"]])
def test_url_only_flags_are_refused_without_url(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    work = tmp_path / "w"
    rc, err = bench_cli(capsys, "--workdir", str(work), "--hidden", "64", "--layers", "1", *argv)
    assert rc == 2 and one_error_line(err) == f"lorafleet bench: {argv[0]}: only used with --url"
    assert not work.exists()


# ---- max_model_len --------------------------------------------------------------------------


def test_requests_that_may_not_fit_max_model_len_are_refused(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    stub.cards = [card("base", None, max_model_len=128), *(card(n, max_model_len=128) for n in ("upper", "reverse", "rot13"))]  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--input-len", "30,30")
    line = one_error_line(err)
    assert rc == 2 and line.startswith("lorafleet bench: --input-len/--output-len: ") and "may not fit the server's max_model_len" in line
    assert "> 128 for base" in line and "e.g. --input-len 17,17 always fits with --output-len up to 8" in line and "--no-length-check" in line
    assert not completions_sent(stub)
    # the suggestion fits; --no-length-check sends the long ones anyway
    rc, _ = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--input-len", "17,17")
    assert rc == 1 and len(stub.models) == 6  # type: ignore[attr-defined]
    rc, _ = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--input-len", "30,30", "--no-length-check")
    assert rc == 1 and len(stub.models) == 12  # type: ignore[attr-defined]


def test_the_length_check_uses_each_models_card(stub: StubServer, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    stub.cards = [card("base", None, max_model_len=4096), card("upper", max_model_len=40)]  # type: ignore[attr-defined]
    path = tmp_path / "w.jsonl"
    generate(WorkloadSpec(num_requests=4, num_adapters=1, rate=0, input_len=(8, 8), output_len=(4, 4))).save(path)
    rc, err = bench_cli(capsys, "--url", url(stub), "--workload", str(path), "--adapter-names", "upper")
    line = one_error_line(err)
    assert rc == 2 and line.startswith(f"lorafleet bench: --workload {path}: ") and "> 40 for upper" in line
    assert "python -m runtime.bench.workload" in line and not completions_sent(stub)


def test_prompts_are_counted_by_the_servers_tokenize_when_it_has_one(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    """The byte bound refuses 30-word prompts at max_model_len 128; a server whose /tokenize counts
    a quarter token per byte lets them through, and one counting 2 per byte refuses short ones."""
    stub.cards = [card("base", None, max_model_len=128)]  # type: ignore[attr-defined]
    stub.tokens_per_byte = 0.25  # type: ignore[attr-defined]
    rc, _ = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--input-len", "30,30")
    assert rc == 1 and len(stub.models) == 6  # type: ignore[attr-defined]
    stub.tokens_per_byte = 2  # type: ignore[attr-defined]
    rc, err = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--input-len", "12,12")
    line = one_error_line(err)
    assert rc == 2 and "do not fit" in line and "counted by the server's /tokenize" in line and "> 128 for base" in line
    assert len(stub.models) == 6  # nothing more was sent  # type: ignore[attr-defined]


def test_a_card_without_max_model_len_is_not_checked(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    stub.cards = [card("base", None)]  # type: ignore[attr-defined]
    rc, _ = bench_cli(capsys, "--url", url(stub), *SMALL, "--base-fraction", "1", "--input-len", "500,500")
    assert rc == 1 and len(stub.models) == 6  # type: ignore[attr-defined]


def test_the_prompt_bound_holds_for_the_demo_tokenizer_and_the_suggested_input_len() -> None:
    """The documented count (bytes + PROMPT_SPECIAL_TOKENS) is never below the demo tokenizer's, and
    MAX_WORD_BYTES bounds a generated prompt, so the suggested --input-len always fits."""
    from runtime.demo import demo_model_dir
    from runtime.tokenizer import Tokenizer

    tok = Tokenizer(demo_model_dir())
    workload = generate(WorkloadSpec(num_requests=200, rate=0, input_len=(1, 40), seed=7))
    for r in workload.requests:
        n = len(tok.encode(r.prompt))
        assert n <= len(r.prompt.encode()) + bench.PROMPT_SPECIAL_TOKENS, r
        assert len(r.prompt.encode()) <= bench.MAX_WORD_BYTES * r.input_words - 1, r


# ---- help ------------------------------------------------------------------------------------


def test_help_says_what_url_requires() -> None:
    p = argparse.ArgumentParser(prog="lorafleet bench")
    bench.add_arguments(p)
    url_help = next(a.help for a in p._actions if "--url" in a.option_strings)
    assert "/v1/models" in url_help and "lora-0000" in url_help and "--adapter-names" in url_help and "max_model_len" in url_help
    assert "--adapter-names upper,reverse,rot13" in p.format_help()


# ---- the bundled demo server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_url() -> Iterator[str]:
    from runtime.commands import serve
    from runtime.server.app import create_app
    from tests.server_harness import running_server

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    settings = serve.load_settings(parser.parse_args(["--device", "cpu"]))  # no --model: the bundled demo
    engine = serve.build_engine(settings)
    try:
        with running_server(create_app(engine, settings.server)) as served:
            yield served
    finally:
        engine.shutdown()


def test_demo_server_refuses_the_workloads_names_and_runs_with_adapter_names(demo_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["--url", demo_url, "--num-requests", "6", "--rate", "0", "--output-len", "4,8"]
    rc, err = bench_cli(capsys, *argv, "--adapters", "3")  # the user's command
    assert rc == 2 and "does not serve the adapters lora-0000" in one_error_line(err) and "--adapter-names reverse,rot13,upper" in err
    rc, err = bench_cli(capsys, *argv, "--adapter-names", "upper,reverse,rot13")  # default --input-len 8,32: too long for 128
    assert rc == 2 and "> 128 for " in one_error_line(err) and "e.g. --input-len 8,17 always fits" in err
    out = tmp_path / "s.json"
    rc, err = bench_cli(capsys, *argv, "--adapter-names", "upper,reverse,rot13", "--input-len", "8,17", "--json", str(out))
    assert rc == 0, err
    data = json.loads(out.read_text())
    assert data["summary"]["requests_ok"] == 6 and data["summary"]["requests_failed"] == 0
    assert sorted(data["workload"]["adapter_names"].values()) == ["reverse", "rot13", "upper"]


def test_demo_server_would_fail_what_the_length_check_refuses(demo_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", demo_url, "--num-requests", "6", "--rate", "0", "--output-len", "4,8", "--base-fraction", "1"]
    rc, err = bench_cli(capsys, *argv)
    assert rc == 2 and "1 of 6 requests do not fit" in one_error_line(err) and "counted by the server's /tokenize" in err
    rc, err = bench_cli(capsys, *argv, "--no-length-check")
    assert rc == 1 and "context_length_exceeded" in err and "1 of 6 requests failed" in err


def test_serve_benchmark_checks_the_servers_adapters_before_any_run(stub: StubServer, tmp_path: Path) -> None:
    """benchmarks/serve.py runs its online HTTP replay last: a server without the workload's
    adapters is refused at start-up, not after minutes of offline runs."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "serve.py"), "--out", str(tmp_path / "out"), "--url", stub.url,
                           "--num-requests", "4", "--adapters", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"--url {stub.url} does not serve lora-0000, lora-0001 (it serves base, reverse, rot13, upper)" in done.stderr
    assert stub.paths == ["/v1/models"] and not (tmp_path / "out" / "weights").exists()


def test_serve_benchmark_refuses_prompts_the_server_cannot_fit(demo_url: str, tmp_path: Path) -> None:
    """benchmarks/serve.py counts the workload's prompts with the server's /tokenize at start-up."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "serve.py"), "--out", str(tmp_path / "out"), "--url", demo_url,
                           "--num-requests", "4", "--base-fraction", "1", "--input-len", "30,30", "--output-len", "4,8",
                           "--baselines", "none", "--sweep-adapters", "", "--sweep-rates", ""], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "do not fit the server's max_model_len" in done.stderr and "counted by the server's /tokenize" in done.stderr, done.stderr

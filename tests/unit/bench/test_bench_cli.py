"""`pdserve bench` end to end against a fake OpenAI server whose answers are known."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench_fake_server import PROMPT_TOKENS_BASE, Behavior, prompt_text
from pdserve.bench.cli import main

SMALL_RUN = ["--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "6",
             "--random-range-ratio", "0.5", "--disable-tqdm"]


@pytest.fixture
def serve(serve, tokenizer_dir):
    """Servers that list the tokenizer directory as their model, so bench loads it from there."""
    def start(behavior: Behavior | None = None):
        behavior = behavior or Behavior()
        behavior.model_id = tokenizer_dir
        return serve(behavior)
    return start


def refuse_multiples_of_three(body):
    return 429 if body["max_tokens"] % 3 == 0 else None


def test_counts_and_token_totals_match_what_the_server_reports(serve, tmp_path, capsys):
    server = serve(Behavior(refuse=refuse_multiples_of_three))
    out = tmp_path / "result.json"
    assert main(["--base-url", server.base_url, *SMALL_RUN, "--json", str(out)]) == 0
    bodies = server.behavior.bodies
    accepted = [b for b in bodies if refuse_multiples_of_three(b) is None]
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (len(accepted), len(bodies) - len(accepted))
    assert result["failed"] > 0 and result["completed"] > 0
    assert result["total_input_tokens"] == sum(PROMPT_TOKENS_BASE + len(prompt_text(b)) for b in accepted)
    assert result["total_output_tokens"] == sum(b["max_tokens"] for b in accepted)
    assert sorted(result["errors"]) == [""] * len(accepted) + ["HTTP 429: refused"] * result["failed"]
    assert result["tokenizer_id"] == result["model_id"] == server.behavior.model_id
    assert "Failed requests:" in capsys.readouterr().out


def test_the_seed_makes_two_runs_send_identical_requests(serve):
    def bodies(seed):
        server = serve()
        assert main(["--base-url", server.base_url, *SMALL_RUN, "--seed", str(seed),
                     "--endpoint", "/v1/chat/completions"]) == 0
        return sorted(json.dumps(b, sort_keys=True) for b in server.behavior.bodies)
    first = bodies(3)
    assert len(first) == 12
    assert first == bodies(3)
    assert first != bodies(4)


def test_warmups_are_sent_first_and_left_out_of_the_result(serve, tmp_path):
    server = serve()
    out = tmp_path / "result.json"
    plot = tmp_path / "plot.png"
    assert main(["--base-url", server.base_url, *SMALL_RUN, "--num-warmups", "2", "--max-concurrency", "3",
                 "--request-rate", "200", "--slo", "ttft=10s", "--json", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    assert len(server.behavior.bodies) == 14
    assert (result["completed"], result["num_warmups"], result["max_concurrency"]) == (12, 2, 3)
    assert result["request_goodput"] == pytest.approx(12 / result["duration"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_request_refused_exits_one_with_the_first_error(serve, capsys):
    server = serve(Behavior(refuse=lambda body: 503))
    assert main(["--base-url", server.base_url, *SMALL_RUN]) == 1
    assert capsys.readouterr().err == "pdserve bench: error: every request failed; first error: HTTP 503: refused\n"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, code, message", [
    (["--dataset-name", "imaginary"], 2, "--dataset-name='imaginary': choose from"),
    (["--slo", "ttft=soon"], 2, "--slo='soon': expected a duration"),
    (["--num-prompts", "many"], 2, "argument --num-prompts: invalid int value: 'many'"),
    (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    (["--max-concurrency", "0"], 2, "--max-concurrency=0: must be at least 1"),
    (["--json", "/nonexistent-dir/x.json"], 2, "--json='/nonexistent-dir/x.json': its directory does not exist"),
])
def test_bad_arguments_exit_nonzero_with_one_line(capsys, args, code, message):
    assert main(["--base-url", "http://127.0.0.1:9", *args]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pdserve bench: error: ")
    assert message in err


def test_unreachable_url_exits_one_with_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--base-url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve bench: error: cannot reach {url}/v1/models: ConnectError")
    assert err.count("\n") == 1


def test_console_script_runs_without_torch_or_a_traceback(serve, tmp_path):
    server = serve()
    code = ("import sys; from pdserve.bench.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules, 'pdserve.engine' in sys.modules); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "--base-url", server.base_url, *SMALL_RUN],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False False"
    bad = subprocess.run([str(Path(sys.executable).parent / "pdserve"), "bench", "--slo", "x"],
                         capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stderr) == (2, "pdserve bench: error: --slo='x': expected METRIC=VALUE\n")


def test_vllm_save_result_flags_name_the_json_file(serve, tmp_path):
    server = serve()
    assert main(["--base-url", server.base_url, *SMALL_RUN, "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "run.json"]) == 0
    assert json.loads((tmp_path / "run.json").read_text())["completed"] == 12


def test_a_served_model_that_is_not_a_local_path_needs_a_tokenizer_flag(serve, tokenizer_dir, capsys):
    server = serve()
    server.behavior.model_id = "org/some-remote-model"
    assert main(["--base-url", server.base_url, *SMALL_RUN, "--num-prompts", "2"]) == 2
    assert capsys.readouterr().err == (
        "pdserve bench: error: --tokenizer=None: the served model 'org/some-remote-model' is not a local path; "
        "pass --tokenizer PATH (its tokenizer), or --model PATH if the server serves it by path\n")
    assert server.behavior.bodies == []  # stopped before sending anything
    out = main(["--base-url", server.base_url, *SMALL_RUN, "--num-prompts", "2", "--tokenizer", tokenizer_dir])
    assert out == 0 and len(server.behavior.bodies) == 2


def test_the_bundled_model_under_its_own_name_uses_its_own_tokenizer() -> None:
    from pdserve.bench.cli import _tokenizer_path
    from pdserve.common.model_source import default_model_path, served_name

    assert _tokenizer_path(None, served_name(default_model_path())) == default_model_path()


def test_a_server_that_wants_a_key_gets_it_from_the_flag_or_the_environment(serve, monkeypatch, capsys):
    server = serve(Behavior(api_key="sk-bench"))
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["--base-url", server.base_url, *SMALL_RUN]) == 1  # no key: /v1/models is refused
    assert main(["--base-url", server.base_url, *SMALL_RUN, "--api-key", "sk-bench"]) == 0
    monkeypatch.setenv("OPENAI_API_KEY", "sk-bench")
    assert main(["--base-url", server.base_url, *SMALL_RUN]) == 0
    assert "sk-bench" not in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_one_line_error_before_any_request(serve, tmp_path, capsys, monkeypatch):
    server = serve()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as in an install without the bench extra
    plot = tmp_path / "plot.png"
    assert main(["--base-url", server.base_url, *SMALL_RUN, "--plot", str(plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve bench: error: --plot={str(plot)!r}: needs matplotlib (")
    assert err.endswith("; install it with pip install 'pdserve[bench]'\n")
    assert err.count("\n") == 1 and server.behavior.bodies == [] and not plot.exists()

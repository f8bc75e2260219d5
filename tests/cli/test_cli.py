"""`compiled run`: JSON output, prompts files, and one-line errors without tracebacks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import make_checkpoint, one_line_error

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), moe=True)


def _run(*args: str):
    return runner.invoke(app, ["run", *args])


def test_json_output_from_prompts_file(ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n\n[4, 5]\n')
    result = _run(ckpt, "--prompts-file", str(prompts), "--json", "--max-new-tokens", "5", "--ignore-eos",
                  "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in lines] == [[1, 2, 3], [4, 5]]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in lines)


def test_demo_model_default_prints_text():
    result = _run("--prompt", "count 3:", "--max-new-tokens", "8", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.splitlines()[0])
    assert record["prompt"] == "count 3:" and record["text"] and record["token_ids"]


def test_no_overlap_schedule_gives_the_same_text():
    args = ["--prompt", "count 3:", "--prompt", "copy Bird wax:", "--max-new-tokens", "12", "--device", "cpu", "--json"]
    outs = []
    for flag in ("--overlap-schedule", "--no-overlap-schedule"):
        result = _run(*args, flag)
        assert result.exit_code == 0, result.output
        outs.append([json.loads(line)["token_ids"] for line in result.stdout.splitlines() if line.startswith("{")])
    assert outs[0] == outs[1] and len(outs[0]) == 2


@pytest.mark.parametrize("args, needle", [
    (["/nonexistent/model", "-p", "x"], "/nonexistent/model"),
    (["--temperature", "-1", "-p", "x"], "temperature"),
    (["--top-p", "1.5", "-p", "x"], "top_p"),
    (["--dtype", "int8", "-p", "x"], "int8"),
])
def test_bad_input_is_one_line_without_traceback(args, needle):
    result = _run(*args, "--device", "cpu")
    assert result.exit_code == 1
    assert needle in one_line_error(result.output), result.output


def test_bad_prompts_file_names_the_line(ckpt, tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('"ok"\n{oops\n')
    result = _run(ckpt, "--prompts-file", str(prompts), "--device", "cpu")
    assert result.exit_code == 1 and f"{prompts}:2" in result.output


def test_debug_shows_traceback():
    result = _run("/nonexistent/model", "-p", "x", "--debug")
    assert result.exit_code != 0 and result.exception is not None


def test_demo_adapters_by_name_and_per_line_adapters(tmp_path):
    """With the demo model a shipped adapter loads by name alone; --adapter picks one for the
    --prompt prompts and a prompts-file line names its own."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "copy Bird wax:", "lora": "first"}\n{"prompt": "copy Bird wax:"}\n')
    result = _run("--lora", "upper", "--lora", "first", "--adapter", "upper", "--prompt", "copy Bird wax:",
                  "--prompts-file", str(prompts), "--json", "--max-new-tokens", "8", "--device", "cpu")
    assert result.exit_code == 0, result.output
    texts = [json.loads(line)["text"] for line in result.stdout.splitlines() if line.startswith("{")]
    assert texts == [" BIRD WA", " Bird", " Bird wa"]   # upper, first (then EOS), base


def test_lora_without_a_path_outside_the_demo_model_is_one_line(ckpt):
    result = _run(ckpt, "--lora", "mine", "--prompt", "x", "--device", "cpu")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--lora 'mine': expected NAME=PATH" in lines[0]


def test_piped_output_is_one_unwrapped_line_per_prompt():
    """Output on stdout is data: with a 30-column console (COLUMNS) and generations longer than
    that, two prompts give two lines, each prompt followed by its whole generation."""
    import subprocess
    import sys
    code = "from cli.main import app; app()"
    args = ["run", "--prompt", "count 17:", "--prompt", "copy Bird wax:", "--max-new-tokens", "40"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env=dict(__import__("os").environ, COLUMNS="30"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("count 17: 17 18 19") and lines[0].endswith("tokens, length)") and len(lines[0]) > 60
    assert lines[1].startswith("copy Bird wax:") and "\x1b[" not in proc.stdout

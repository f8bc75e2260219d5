"""The CLI's errors are one `error: ...` line: exit code 2 for a command line that does not parse
(as Click and argparse), 1 for input that parses but is bad. The terminal shows nothing but the
program's own output, on success, on error and on Ctrl-C."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import one_line_error

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.mark.parametrize("args, start", [
    (["run", "--temperature", "abc"], "error: Invalid value for '--temperature': "),
    (["run", "--max-new-tokens", "1.5"], "error: Invalid value for '--max-new-tokens': "),
    (["run", "--bogus"], "error: No such option: --bogus"),
    (["export", "--buckets", "1"], "error: Missing option '--out'"),
    (["bench", "latency", "--max-num-seqs", "x"], "error: Invalid value for '--max-num-seqs': "),
    (["nope"], "error: No such command 'nope'"),
])
def test_usage_error_is_one_line_with_exit_code_2(args, start):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert one_line_error(result.output).startswith(start), result.output


@pytest.mark.parametrize("args, line", [
    (["run", "--max-model-len", "-5", "-p", "x"], "error: max_model_len=-5: expected None or an int >= 2"),
    (["run", "--max-model-len", "0", "-p", "x"], "error: max_model_len=0: expected None or an int >= 2"),
    (["run", "--max-new-tokens", "0", "-p", "x"], "error: SamplingParams.max_new_tokens must be >= 1, got 0"),
    (["run", "--logprobs", "-2", "-p", "x"],
     "error: SamplingParams.logprobs must be None, -1 (whole vocab) or an int >= 0, got -2"),
    (["export", "--out", "unused", "--buckets", "1,x"],
     "error: --buckets '1,x': expected comma-separated ints >= 1, e.g. 1,2,4,8"),
    (["export", "--out", "unused", "--buckets", "0,2"],
     "error: --buckets '0,2': expected comma-separated ints >= 1, e.g. 1,2,4,8"),
])
def test_bad_value_is_one_line_with_exit_code_1(args, line):
    result = runner.invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 1
    assert one_line_error(result.output) == line


def test_empty_prompts_file_is_an_error_naming_it(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    result = runner.invoke(app, ["run", "--prompts-file", str(empty), "--device", "cpu"])
    assert result.exit_code == 1
    assert one_line_error(result.output) == (f"error: {empty}: no prompts in the file (expected one JSON string, list of token "
                                   "ids, or object with 'prompt' or 'prompt_token_ids' per line)")


def test_export_defaults_to_the_demo_model(tmp_path):
    """Like run, bench and graph: without MODEL, export reaches the demo model (here it stops at
    the pass list, before compiling)."""
    result = runner.invoke(app, ["export", "--out", str(tmp_path / "a"), "--passes", "bogus", "--device", "cpu"])
    assert result.exit_code == 1
    assert one_line_error(result.output).startswith("error: unknown pass 'bogus' (available: ")


# ---- the terminal shows the program's own output only ---------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPILED_")}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)


def test_run_on_cpu_writes_nothing_to_stderr_but_its_timing_line():
    result = _cli("run", "-p", "copy hi:", "--max-new-tokens", "3", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "copy hi:" in result.stdout
    # run reports its timing on stderr (stdout holds only the generations); nothing else may be
    # there, e.g. an extension's leak report at interpreter exit.
    assert re.fullmatch(r"\S+ on cpu \(float32\): load [\d.]+s, \d+ tokens in [\d.]+s\n", result.stderr), result.stderr


def test_error_after_start_up_is_the_only_line_on_stderr():
    result = _cli("run", "-p", "count 7: 8 9 10", "--max-model-len", "4", "--device", "cpu")
    assert result.returncode == 1
    assert result.stderr == "error: prompt 0 has 11 tokens; the context holds 4 (max_model_len), so a prompt may have at most 3\n"


def test_interrupted_process_prints_no_leak_report():
    code = ("import os, signal\nfrom compiled import LLM\nLLM(device='cpu')\nos.kill(os.getpid(), signal.SIGINT)\n"
            "import time\ntime.sleep(5)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1] == "KeyboardInterrupt", result.stderr
    assert "nanobind" not in result.stderr, result.stderr


def test_run_with_cp_matches_without_and_keeps_the_terminal_clean():
    args = ("run", "-p", "count 7: 8 9 10 11 12 13 14 15 16", "--max-new-tokens", "5", "--device", "cpu",
            "--temperature", "0", "--json")
    alone = _cli(*args)
    split = _cli(*args, "--cp", "2", "--cp-min-tokens", "4")
    assert alone.returncode == 0 and split.returncode == 0, split.stderr
    assert split.stdout == alone.stdout
    assert split.stderr == "", split.stderr

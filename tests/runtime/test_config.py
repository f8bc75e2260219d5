"""One source of truth for every default: the engine config. `LLM`, `compiled run`, `compiled bench`
and `compiled export` take theirs from it, and environment variables are read in one place."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from compiled.runtime import config as config_module
from compiled.runtime.config import DEFAULTS, EngineConfig

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
# Values no default has, to tell a default read from the config from a literal of the same value.
ODD = dict(max_num_seqs=123, max_num_batched_tokens=4567, mem_fraction=0.37, seed=11, load_format="dummy",
           overlap_schedule=False, enforce_eager=True, max_model_len=321, kv_cache_tokens=999, device="cpu",
           dtype="float16", artifact="/odd", recompile_on_mismatch=True, compile=False)


def _command_defaults(fn) -> dict[str, object]:
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        default = p.default
        default = getattr(default, "default", default)  # typer.Option holds its default
        out[name] = default
    return out


@pytest.fixture
def odd_defaults(monkeypatch):
    """Reload the CLI with DEFAULTS holding unusual values; restore it afterwards."""
    monkeypatch.setattr(config_module, "DEFAULTS", dataclasses.replace(DEFAULTS, **ODD))
    names = ("cli.engine_options", "cli.run", "cli.export", "cli.bench", "cli.serve", "cli.main")
    try:
        yield [importlib.reload(importlib.import_module(n)) for n in names]
    finally:
        monkeypatch.undo()
        for n in names:
            importlib.reload(importlib.import_module(n))


def test_cli_commands_take_engine_defaults_from_the_config(odd_defaults):
    _, run_module, export_module, bench_module, _, _ = odd_defaults
    commands = {"run": run_module.run, "export": export_module.export}
    commands.update({c.callback.__name__: c.callback for c in bench_module.bench_app.registered_commands})
    assert {"latency", "throughput", "serving", "startup"} <= set(commands)
    # export reads no weights by default (its load_format is its own, documented choice); run's
    # --seed is the requests' sampling seed, a SamplingParams default.
    own = {("export", "load_format"), ("run", "seed")}
    checked = 0
    for command, fn in commands.items():
        for name, default in _command_defaults(fn).items():
            if name in ODD and (command, name) not in own:
                assert default == ODD[name], f"compiled {command} --{name}: default {default!r} is not the config's"
                checked += 1
    assert checked >= 40


def test_llm_takes_every_setting_from_the_config():
    from compiled import LLM
    params = list(inspect.signature(LLM.__init__).parameters.values())
    assert [p.name for p in params] == ["self", "model", "kwargs"]
    assert params[1].default is DEFAULTS.model
    assert params[2].kind is inspect.Parameter.VAR_KEYWORD


def test_llm_rejects_an_unknown_setting_listing_the_valid_ones():
    from compiled import LLM
    with pytest.raises(TypeError) as e:
        LLM(max_num_seq=8)
    message = str(e.value)
    assert "'max_num_seq'" in message and "max_num_seqs" in message and "\n" not in message


@pytest.mark.parametrize("kwargs, culprit", [
    (dict(attention_backend="cuda"), "attention_backend"),
    (dict(lora_backend="cuda"), "lora_backend"),
    (dict(load_format="pickle"), "load_format"),
    (dict(dtype="int3"), "dtype"),
    (dict(device="tpu"), "device"),
])
def test_bad_settings_are_one_line_errors(kwargs, culprit):
    from compiled.errors import CompiledError
    with pytest.raises(CompiledError) as e:
        EngineConfig(**kwargs).resolve(128)
    assert culprit in str(e.value) and "\n" not in str(e.value)


def test_every_backend_switch_is_a_config_field_the_engine_applies(monkeypatch):
    """Each op family's switch is a `<family>_backend` field, applied to that family's ops (the
    environment variable, when set, wins)."""
    from compiled.linear import lora
    from compiled.runtime.backends import FAMILY_MODULES, configure_backends
    assert set(FAMILY_MODULES) == set(config_module.BACKEND_FAMILIES)
    assert all(f"{family}_backend" in FIELDS for family in config_module.BACKEND_FAMILIES)
    monkeypatch.delenv("COMPILED_LORA_BACKEND", raising=False)
    previous = lora.BACKEND.name
    try:
        configure_backends(EngineConfig(lora_backend="torch"))
        assert lora.BACKEND.name == "torch"
        monkeypatch.setenv("COMPILED_LORA_BACKEND", "triton")
        lora.BACKEND.set("auto")
        configure_backends(EngineConfig(lora_backend="torch"))
        assert lora.BACKEND.name == "auto"      # unchanged: the environment wins over the config
    finally:
        lora.BACKEND.set(previous)


def test_environment_is_read_only_in_envs():
    out = subprocess.run(["grep", "-rn", "-E", r"os\.environ|getenv", "compiled", "cli"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    readers = {line.split(":")[0] for line in out.splitlines()}
    assert readers <= {"compiled/envs.py"}, out


def test_readme_lists_every_environment_variable():
    from compiled.envs import VARIABLES
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in VARIABLES if f"`{name}" not in readme]
    assert not missing, f"README does not list {missing}"


def test_a_bad_environment_value_is_a_one_line_error_naming_the_variable():
    code = "from compiled import LLM; LLM()"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={**_clean_env(), "COMPILED_ATTENTION_BACKEND": "cudnn"})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "COMPILED_ATTENTION_BACKEND='cudnn'" in last and "auto|torch|triton" in last


def test_a_bad_environment_value_reaches_the_cli_as_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cli.main", "run", "--prompt", "x", "--max-new-tokens", "1"],
                            cwd=ROOT, capture_output=True, text=True,
                            env={**_clean_env(), "COMPILED_PDL": "yes"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: environment variable COMPILED_PDL='yes': expected 0 or 1"]


def _clean_env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if not k.startswith("COMPILED_")}

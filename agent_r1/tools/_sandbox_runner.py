"""The interpreter that runs inside the sandbox (`agent_r1.tools.sandbox`). Standard library only.

It is started as `python -I -S -c <this file's text> <limits as JSON>`, sets its own resource limits
before it runs any model code (a process may always lower its limits, never raise a hard one), then
answers one JSON line per JSON request line `{"code": ...}` on its original stdin/stdout, which it
keeps on private descriptors. The model's code sees an empty stdin, and its stdout and stderr
(including those of any subprocess it starts) go to one unlinked temporary file that is read back
after each cell, so output interleaves as in a terminal and is capped by RLIMIT_FSIZE.

Each cell runs in the same globals, like a notebook: the value of a final expression is printed.
"""

import ast
import builtins
import io
import json
import linecache
import os
import resource
import signal
import sys
import tempfile
import traceback


class CPULimitExceeded(BaseException):
    """Raised in the cell by SIGXCPU. A BaseException, so the model's `except Exception` cannot hide it."""


def set_limits(cfg: dict) -> None:
    """Lower every limit this process and its children live under (hard limits cannot be raised again)."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb, cfg["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_mb"] * mb, cfg["file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["processes"], cfg["processes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["open_files"], cfg["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # CPU: the soft limit is moved before each cell (per-call budget); the hard one bounds the session.
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["session_cpu_seconds"]))


def cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def on_xcpu(signum, frame):  # a signal handler's signature
    raise CPULimitExceeded


def run_cell(code: str, index: int, env: dict) -> None:
    """Exec `code` in `env`; a final expression's value is printed, as a notebook or the REPL does."""
    name = f"<cell {index}>"
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # source lines in tracebacks
    tree = ast.parse(code, name)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, name, "exec"), env)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), name, "eval"), env)
        if value is not None:
            print(repr(value))


def format_error(exc: BaseException) -> str:
    """The traceback without this runner's own frames: the model should see its code, not ours."""
    tb = traceback.TracebackException.from_exception(exc)
    tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename != "<string>"])
    return "".join(tb.format()).rstrip()


def unbuffered(fd: int) -> io.TextIOWrapper:
    """A text stream with no buffer at any level: prints and errors interleave as they happened, and a
    write that fails at the file-size limit leaves nothing behind to spill into the next cell."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    requests = os.fdopen(os.dup(0), "r")  # os.dup gives non-inheritable copies: subprocesses never see them
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    with tempfile.TemporaryFile() as out:  # unlinked at once: nothing in the scratch directory to tamper with
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout, sys.stderr = unbuffered(1), unbuffered(2)
    sys.path[:0] = [os.getcwd()]  # modules the code writes into its scratch directory import
    sys.path += cfg["paths"]  # the installed packages (started with -S: no site, so no .pth files run)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the file limit a write fails (EFBIG), no kill
    signal.signal(signal.SIGXCPU, on_xcpu)
    set_limits(cfg)
    main_pid = os.getpid()
    env: dict = {"__name__": "__main__", "__builtins__": builtins}
    for index, line in enumerate(requests, start=1):
        code = json.loads(line)["code"]
        os.ftruncate(1, 0)
        os.lseek(1, 0, os.SEEK_SET)
        # RLIMIT_CPU counts whole seconds of the process's life: this call's budget is right to +-0.5 s
        soft = min(max(1, round(cpu_used() + cfg["cpu_seconds"])), cfg["session_cpu_seconds"])
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cfg["session_cpu_seconds"]))
        kind, error = None, None
        try:
            run_cell(code, index, env)
        except CPULimitExceeded:
            kind, error = "cpu_limit", f"CPU time limit exceeded ({cfg['cpu_seconds']} s per call)"
        except MemoryError as e:
            kind, error = "memory_limit", format_error(e) + f"\n(memory limit: {cfg['memory_mb']} MB)"
        except BaseException as e:  # SystemExit, KeyboardInterrupt: all are the code's own errors
            kind, error = "exception", format_error(e)
        if os.getpid() != main_pid:  # a process the cell forked must not go on serving requests
            os._exit(0)
        size = os.fstat(1).st_size
        text = os.pread(1, cfg["max_output_bytes"], 0).decode("utf-8", errors="replace")
        if size >= cfg["file_mb"] * 1024 * 1024:  # the print that hit the limit failed with EFBIG
            kind, error = "output_limit", f"output limit reached ({cfg['file_mb']} MB); the rest was not printed"
        replies.write(json.dumps({"output": text, "size": size, "kind": kind, "error": error}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()

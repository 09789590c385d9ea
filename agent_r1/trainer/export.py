"""`agent-r1 export CHECKPOINT --out DIR`: a training checkpoint -> a Hugging Face directory.

A checkpoint holds only what training changed (every weight, or only the LoRA adapters) and the run's
config. Export rebuilds the policy from the base model named in that config, loads the trained
tensors, merges LoRA into the weights, and writes model + tokenizer (chat template included) + an
`agent_r1.json` recording how the model was trained to be prompted: its prompt format and its
tool-call format. `AutoModelForCausalLM.from_pretrained(DIR)` loads the result; so do
`agent-r1 chat --model DIR` and `agent-r1 serve model=DIR`, which read the recorded format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.env.tool_formats import TOOL_FORMATS, ToolFormat
from agent_r1.models.loading import is_chat_model, load_model, load_processor
from agent_r1.models.lora import LoraConfig, with_lora
from agent_r1.task import resolve_tool_format
from agent_r1.trainer.checkpoint import export_policy, latest_checkpoint, load_sharded_weights, load_trained_state


@dataclass
class ExportConfig:
    checkpoint: str = ""
    """a checkpoint (RUN_DIR/checkpoints/step_N), or a run directory (its newest checkpoint)"""
    out: str = ""
    """the Hugging Face directory to write (replaced if it exists)"""
    model: str | None = None
    """base model; None = the model recorded in the checkpoint's config"""

    def __post_init__(self) -> None:
        if not self.checkpoint or not self.out:
            raise ValueError("usage: agent-r1 export RUN_DIR[/checkpoints/step_N] --out DIR")


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint, a run directory or its checkpoints/ directory."""
    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    found = latest_checkpoint(p) or (latest_checkpoint(p.parent) if p.name == "checkpoints" else None)
    if found is None:
        raise ValueError(f"no checkpoint in {path}: give RUN_DIR or RUN_DIR/checkpoints/step_N")
    return found


def load_policy(checkpoint: Path, model: str | None = None) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """(policy with the trained weights, tokenizer, the run's config) of a checkpoint."""
    config = json.loads((checkpoint / "meta.json").read_text()).get("config", {})
    base = model or config.get("model")
    if not base:
        raise ValueError(f"checkpoint {checkpoint} records no base model: pass model=NAME_OR_DIR")
    policy, tokenizer = load_model(base)
    tokenizer = load_processor(base) or tokenizer  # a vision-language model's processor is exported whole
    lora = config.get("lora") or {}
    if lora.get("enabled"):
        policy = with_lora(policy, LoraConfig(**lora))
    if (checkpoint / "state").is_dir():  # written by a torchrun job: every rank's shards
        load_sharded_weights(checkpoint, "policy", policy)
    else:
        load_trained_state(checkpoint / "policy.safetensors", policy)
    return policy.eval(), tokenizer, config | {"model": base}


def policy_info(
    base_model: str, chat: bool, task: dict[str, Any] | None, calls: ToolFormat = TOOL_FORMATS["hermes"], **extra: Any
) -> dict[str, Any]:
    """What a policy directory's agent_r1.json records: how the model was trained to be prompted (prompt
    format, tool-call format: chat, serve and eval read both back) and on which task (name and options,
    whose instructions chat reuses)."""
    return {
        "base_model": base_model,
        "prompt_format": "chat" if chat else "text",
        "task": task,
        "tool_call_format": {
            "name": calls.name,
            "call": calls.format_call("tool_name", {"argument": "value"}),
            "stop": list(calls.stop),
        },
        **extra,
    }


def run_export(cfg: ExportConfig) -> Path:
    checkpoint = find_checkpoint(cfg.checkpoint)
    policy, tokenizer, config = load_policy(checkpoint, cfg.model)
    fmt = config.get("prompt_format", "auto")
    chat = is_chat_model(config["model"], tokenizer) if fmt == "auto" else fmt == "chat"
    meta = json.loads((checkpoint / "meta.json").read_text())
    fmt = prompt_format_for(tokenizer, chat, resolve_tool_format(config.get("tool_format", "auto"), config["model"]))
    info = policy_info(
        config["model"], chat, meta.get("task", config.get("task")), fmt.tool_format,  # RL: None for an env passed in
        exported_from=str(checkpoint.resolve()),
        step=meta.get("step"),
        lora_merged=bool((config.get("lora") or {}).get("enabled")),
    )  # fmt: skip
    out = export_policy(policy, tokenizer, cfg.out, info=info)
    print(f"exported {checkpoint} -> {out}")
    return out

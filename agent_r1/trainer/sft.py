"""`agent-r1 sft`: the cold start, supervised fine-tuning on multi-turn tool-use demonstrations.

The loss is the negative log-likelihood of the model's own turns only, using the loss masks the RL
path builds (`data.demos.demo_to_sequence` lays a demonstration out exactly as a rollout). Rows are
packed into micro-batches. Checkpoints and the exported policy use the RL format, so
`agent-r1 train model=RUN_DIR/policy` starts RL from the SFT result.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from rich.console import Console

from agent_r1.config import to_dict
from agent_r1.data.demos import calculator_demo, demo_to_sequence, gsm8k_demo
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.env.tool_env import ToolEnv
from agent_r1.models.loading import is_chat_model, load_model
from agent_r1.models.lora import with_lora
from agent_r1.models.onednn import use_onednn
from agent_r1.recipes import calculator as calc_recipe
from agent_r1.recipes import gsm8k, hotpotqa, tasks_and_env
from agent_r1.trainer.batching import Row, pack, token_logprobs
from agent_r1.trainer.checkpoint import export_policy, save_checkpoint
from agent_r1.trainer.common import adamw, lr_schedule, progress_bar
from agent_r1.trainer.config import LoraConfig
from agent_r1.types import Message
from agent_r1.utils.jsonl import append_jsonl


@dataclass
class SFTConfig:
    model: str = "default"
    """"default", a bundled model name or a Hugging Face directory"""
    source: Literal["calculator", "gsm8k", "hotpotqa"] = "calculator"
    """demonstrations: synthetic calculator problems, GSM8K's calculator annotations, or HotpotQA searches"""
    data: str | None = None
    """GSM8K / HotpotQA jsonl (None = the file in ../shared/data)"""
    num_examples: int = 128
    """demonstrations to train on (from the training split)"""
    ops: tuple[int, ...] = (1,)
    """calculator source: operations per problem"""
    few_shot: bool = False
    """put the recipe's worked example in the prompt (keep equal to the RL/eval setting)"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    epochs: int = 2
    """passes over the demonstrations"""
    batch_size: int = 16
    """demonstrations per optimizer step"""
    lr: float = 3e-5
    """peak learning rate (AdamW), cosine decay after warm-up"""
    warmup_steps: int = 2
    """optimizer steps of linear warm-up"""
    grad_clip: float = 1.0
    """max global grad norm"""
    micro_batch_tokens: int = 1024
    """token budget of one packed micro-batch"""
    seed: int = 0
    """data order and sampling seed"""
    run_dir: str = "runs/sft"
    """where config, metrics, the checkpoint and the exported policy go"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off = full fine-tuning)"""
    retriever: str = "bm25"
    """hotpotqa source: the search index the demonstrations' tool responses come from (as in RL)"""
    max_tool_tokens: int = 256
    """hotpotqa source: each search result is cut to this many tokens (as in RL)"""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.num_examples < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("num_examples, epochs and batch_size must be >= 1")


def demonstrations(cfg: SFTConfig, env: ToolEnv) -> list[list[Message]]:
    """Demonstrations from the training split of the chosen source (GSM8K ones that disagree with
    the calculator are skipped); tool responses come from `env`'s tools."""
    if cfg.source == "hotpotqa":
        return [hotpotqa.demo(t, env) for t in hotpotqa.load(cfg.data, n=cfg.num_examples)]
    if cfg.source == "calculator":
        return [calculator_demo(t) for t in calc_recipe.make_tasks(cfg.num_examples, seed=cfg.seed, ops=cfg.ops)]
    demos = []
    for task in gsm8k.load(cfg.data or gsm8k.DEFAULT_PATH):
        try:
            demos.append(gsm8k_demo(task["question"], task["solution"]))
        except ValueError:
            continue
        if len(demos) == cfg.num_examples:
            break
    return demos


def sft(cfg: SFTConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None, console=None) -> list[dict]:
    console = console or Console()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    torch.manual_seed(cfg.seed)
    if model is None:
        model, tokenizer = load_model(cfg.model)
    use_onednn(model)  # a model passed in gets the same kernels as a loaded one (no-op if it has them)
    policy = with_lora(model, cfg.lora) if cfg.lora.enabled else model
    chat = is_chat_model(cfg.model, tokenizer) if cfg.prompt_format == "auto" else cfg.prompt_format == "chat"
    fmt = prompt_format_for(tokenizer, chat=chat)

    # the prompt prefix RL and eval will use: system (tools + instructions) and optional example
    _, make_env = tasks_and_env(
        cfg.source, fmt, split="train", n=1, few_shot=cfg.few_shot, retriever=cfg.retriever,
        max_tool_tokens=cfg.max_tool_tokens,
    )  # fmt: skip
    env = make_env()
    prefix = env.prompt_prefix
    rows = []
    for demo in demonstrations(cfg, env):
        seq = demo_to_sequence(demo, prefix, fmt, tokenizer)
        n = len(seq.input_ids)
        rows.append(
            Row(
                input_ids=torch.tensor(seq.input_ids),
                mask=torch.tensor(seq.loss_mask, dtype=torch.float32),
                old_logp=torch.zeros(n),
                adv=torch.zeros(n),
                seg=torch.zeros(n, dtype=torch.long),
            )
        )

    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = adamw(params, cfg.lr)
    total = cfg.epochs * -(-len(rows) // cfg.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(total, cfg.warmup_steps, "cosine"))
    order_rng = random.Random(cfg.seed)
    history = []
    policy.train()
    with progress_bar(console) as bar:
        task = bar.add_task("SFT", total=total)
        step = 0
        for epoch in range(cfg.epochs):
            order = order_rng.sample(range(len(rows)), len(rows))
            for start in range(0, len(rows), cfg.batch_size):
                t0 = time.perf_counter()
                batch = [rows[i] for i in order[start : start + cfg.batch_size]]
                n_tokens = float(sum(r.mask.sum() for r in batch))
                optimizer.zero_grad(set_to_none=True)
                nll = 0.0
                tokens = 0
                for mb in pack(batch, cfg.micro_batch_tokens):
                    logp, _, _ = token_logprobs(policy, mb)
                    loss = -(logp * mb.mask).sum() / n_tokens  # mean NLL over the batch's trainable tokens
                    loss.backward()
                    nll += loss.item()
                    tokens += mb.num_tokens
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if torch.isfinite(grad_norm):
                    optimizer.step()
                scheduler.step()
                step += 1
                seconds = time.perf_counter() - t0
                metrics = {
                    "step": step,
                    "epoch": epoch,
                    "loss": nll,
                    "grad_norm": float(grad_norm),
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": tokens / seconds,
                }
                append_jsonl(run_dir / "metrics.jsonl", metrics)
                history.append(metrics)
                bar.update(task, advance=1, description=f"SFT epoch {epoch + 1}: loss {nll:.3f}")
    policy.eval()
    save_checkpoint(run_dir, step, {"policy": policy}, optimizer, scheduler, {"cursor": 0, "config": to_dict(cfg)})
    export_policy(policy, tokenizer, run_dir / "policy")
    console.print(f"SFT done: {len(rows)} demonstrations, final loss {history[-1]['loss']:.3f} -> {run_dir / 'policy'}")
    return history

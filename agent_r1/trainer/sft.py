"""`agent-r1 sft`: the cold start, supervised fine-tuning on multi-turn tool-use demonstrations.

The loss is the negative log-likelihood of the model's own turns only, using the loss masks the RL
path builds (`demo_to_sequence` lays a task's demonstration out exactly as a rollout). Rows are
packed into micro-batches. Checkpoints and the exported policy use the RL format, so
`agent-r1 train model=RUN_DIR/policy` starts RL from the SFT result.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from agent_r1.config import to_dict
from agent_r1.env.base import Env
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_formats import ToolFormatName
from agent_r1.models.lora import LoraConfig
from agent_r1.models.precision import Device, Precision, model_device
from agent_r1.models.vision import image_token_id, is_vision_parameter
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.task import TaskSpec, resolve_chat, resolve_tool_format
from agent_r1.trainer.batching import Row, image_row_key, pack, token_logprobs
from agent_r1.trainer.checkpoint import export_policy, save_checkpoint
from agent_r1.trainer.common import adamw, lr_schedule, trained_model
from agent_r1.trainer.export import policy_info
from agent_r1.types import Action, Message, Step, TrainSequence, Trajectory
from agent_r1.utils.jsonl import append_jsonl
from agent_r1.utils.malloc import trim_heap
from agent_r1.utils.paths import write_text_atomic
from agent_r1.utils.progress import progress_bar

MAX_DEMO_TURNS = 64  # a replayed demonstration's turn budget (env/context.py): the demo decides its length


@dataclass
class SFTConfig:
    model: str = "default"
    """"default", a bundled model name or a Hugging Face directory"""
    device: Device = "auto"
    """where the model runs: auto = cuda when a GPU is visible, else cpu"""
    dtype: Precision = "fp32"
    """fp32, or bf16 compute with fp32 master weights, optimizer state and log-softmax (GPU)"""
    task: TaskSpec = field(default_factory=TaskSpec)
    """the task whose demonstrations to train on (its `demos`), with its prompt: keep its options equal to RL's"""
    num_examples: int = 128
    """demonstrations to train on (from the training split)"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    tool_format: ToolFormatName = "auto"
    """how the model writes tool calls: auto = its chat template's family (hermes, llama3_json, mistral,
    mistral_args, qwen3_coder, harmony); hermes for a model without a template"""
    epochs: int = 2
    """passes over the demonstrations"""
    batch_size: int = 16
    """training rows per optimizer step (a demonstration is one row, or one per rewrite under task.context)"""
    lr: float = 3e-5
    """peak learning rate (AdamW), cosine decay after warm-up"""
    vision_lr: float | None = None
    """peak learning rate of a vision-language model's vision tower and projector (None = lr): a tower
    initialised at random needs far more than the pretrained language model (LLaVA trains its new
    projector at 1e-3)"""
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

    def __post_init__(self) -> None:
        if self.lr <= 0 or (self.vision_lr is not None and self.vision_lr <= 0):
            raise ValueError(f"lr and vision_lr must be > 0, got {self.lr} and {self.vision_lr}")
        if self.num_examples < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("num_examples, epochs and batch_size must be >= 1")
        if not hasattr(self.task.module, "demos"):
            raise ValueError(f"task {self.task.name!r} has no demonstrations for SFT (it defines no demos())")


def demo_to_sequence(
    demo: list[Message], prefix: list[Message], fmt: PromptFormat, tokenizer: PreTrainedTokenizerBase
) -> TrainSequence:
    """One training row of a demonstration, laid out exactly as a rollout: prompt = `prefix` (system,
    few-shot) + the question; a tool-call turn ends at its format's stop string (`</tool_call>`, no EOS)
    or, in families without one (Llama 3, Mistral), with EOS, as the model ends it; the final answer with
    EOS; tool results enter through the format's continuation ids. The rollout path's own
    `merge_trajectory` then gives the loss mask: 1 on the assistant turns, 0 on prompt, markup and tools.
    """
    if len(demo) < 2 or demo[0]["role"] != "user" or demo[-1]["role"] != "assistant":
        raise ValueError("a demonstration is [user, assistant, (tool results, assistant)...]")
    context, images = fmt.initial([*prefix, demo[0]]), fmt.images([*prefix, demo[0]])
    turns = [k for k, m in enumerate(demo) if m["role"] == "assistant"]
    steps = []
    for k, following in zip(turns, [*turns[1:], None], strict=True):
        ids = tokenizer.encode(demo[k]["content"], add_special_tokens=False)
        ended = following is not None and demo[k]["content"].endswith(fmt.tool_format.stop)
        if not ended:
            ids.append(tokenizer.eos_token_id)  # the final answer (or an EOS-ended call) ends the turn
        steps.append(Step(list(context), ids, [0.0] * len(ids), index=len(steps), images=list(images)))
        if following is not None:
            results = demo[k + 1 : following]  # one user turn of results, or a "tool" message per call
            context = context + ids + fmt.continuation(results, after_eos=not ended)
            images = images + fmt.images(results)
    (row,) = merge_trajectory(Trajectory(task={}, traj_id="demo", group_id="demo", steps=steps))
    return row


def replay_demo(
    demo: list[Message], task: dict[str, Any], env: Env, summary: Callable[[dict, list[Message]], str] | None
) -> list[Step]:
    """The steps of a demonstration under a managed context (`task.context`, env/context.py): its
    assistant turns are replayed through the env, which runs the tools and shows each next prompt as a
    rollout would (truncated, elided, with notes), so SFT sees the rows RL will (`merge_trajectory`: each
    rewrite starts a new row). When the env asks for a summary, the task's `summary(task, history)`
    writes it from what the model sees then."""
    fmt, tokenizer = env.format, env.format.tokenizer
    turns = iter(m["content"] for m in demo if m["role"] == "assistant")

    async def run() -> list[Step]:
        obs, steps = await env.reset(task), []
        while obs is not None:
            managed = getattr(env, "managed", None)  # ToolEnv's managed context, if any
            if managed is not None and managed.awaiting_summary:
                if summary is None:
                    raise ValueError(
                        "task.context.strategy=summarize needs the task's summary() for SFT demonstrations"
                    )
                text = summary(task, managed.view(request=True))  # what the model sees when it writes one
            elif (text := next(turns, None)) is None:
                break
            ids = tokenizer.encode(text, add_special_tokens=False)
            finish = "stop" if text.endswith(fmt.tool_format.stop) else "eos"
            if finish == "eos":
                ids.append(tokenizer.eos_token_id)
            prompt = list(obs.token_ids)
            obs, *_ = await env.step(Action(ids, [0.0] * len(ids), text, finish))
            steps.append(Step(prompt, ids, [0.0] * len(ids), text=text, index=len(steps)))
        return steps

    async def run_and_close() -> list[Step]:
        try:
            return await run()
        finally:
            await env.close()

    return asyncio.run(run_and_close())


def demo_rows(
    cfg: SFTConfig, env: Env, make_env: Callable[[], Env], console: Console | None = None
) -> list[TrainSequence]:
    """Every demonstration as training rows: one row each (`demo_to_sequence`), or, under a managed
    context or for an env without a fixed prompt prefix (an agent program's), the rows of its replay through the
    env (demo i must be of `tasks(train)[i]`, which is checked)."""
    module, options = cfg.task.module, cfg.task.options
    demos = module.demos(options, env, cfg.num_examples, cfg.seed)
    prefix = getattr(env, "prompt_prefix", None)  # a ToolEnv's (or one that wraps it): its system prompt, few-shot
    if prefix is not None:
        demos = [env.in_model_format(d) for d in demos]
        if env.context_cfg is None:
            return [demo_to_sequence(d, prefix, env.format, env.format.tokenizer) for d in demos]
    # a managed context, or an env whose prompts only it knows (an agent program's, through the gateway)
    tasks = module.tasks(options, "train", len(demos), cfg.seed)
    rows = []
    with progress_bar(console or Console()) as bar:  # a harness's replay takes seconds a demonstration
        progress = bar.add_task("demonstrations replayed", total=len(demos))
        for demo, task in zip(demos, tasks, strict=True):
            if demo[0]["content"] != task.get("question"):
                raise ValueError(f"task {cfg.task.name!r}: demos() must follow tasks('train') order to replay them")
            steps = replay_demo(demo, task, make_env(), getattr(module, "summary", None))
            rows += merge_trajectory(Trajectory(task=task, traj_id="demo", group_id="demo", steps=steps))
            bar.advance(progress)
    return rows


def sft(cfg: SFTConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None, console=None) -> list[dict]:
    console = console or Console()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    torch.manual_seed(cfg.seed)
    chat_hint = cfg.model if model is None else None
    model, processor, tokenizer, policy = trained_model(cfg, model, tokenizer)
    chat = resolve_chat(cfg.prompt_format, processor, chat_hint)

    # the prompt prefix RL and eval will use: system (tools + instructions) and optional example
    make_env = cfg.task.env_factory(processor, chat, MAX_DEMO_TURNS, resolve_tool_format(cfg.tool_format, chat_hint))
    env = make_env()
    rows = []
    for seq in demo_rows(cfg, env, make_env, console):
        n = len(seq.input_ids)
        rows.append(
            Row(
                input_ids=torch.tensor(seq.input_ids),
                mask=torch.tensor(seq.loss_mask, dtype=torch.float32),
                old_logp=torch.zeros(n),
                adv=torch.zeros(n),
                seg=torch.zeros(n, dtype=torch.long),
                images=seq.images,
                key=image_row_key(seq.input_ids, seq.images, image_token_id(model)),
            )
        )

    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups: list = params
    if cfg.vision_lr is not None:  # the vision tower and projector at their own rate
        vision = {id(p) for n, p in named if is_vision_parameter(n)}
        groups = [
            {"params": [p for p in params if id(p) not in vision]},
            {"params": [p for p in params if id(p) in vision], "lr": cfg.vision_lr},
        ]
    optimizer = adamw(groups, cfg.lr)
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
                for mb in pack(batch, cfg.micro_batch_tokens, device=model_device(policy)):
                    logp, _, _ = token_logprobs(policy, mb)
                    loss = -(logp * mb.mask).sum() / n_tokens  # mean NLL over the batch's trainable tokens
                    loss.backward()
                    trim_heap()  # the micro-batch's freed activations back to the OS (utils/malloc.py)
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
    info = policy_info(cfg.model, chat, cfg.task.to_raw(), env.format.tool_format, step=step)
    export_policy(policy, processor, run_dir / "policy", info=info)
    console.print(f"SFT done: {len(rows)} demonstrations, final loss {history[-1]['loss']:.3f} -> {run_dir / 'policy'}")
    return history

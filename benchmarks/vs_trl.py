"""One GRPO step on the same single-turn task: agent-r1's `train` vs TRL's `GRPOTrainer`, in one invocation.

Both sides use SmolLM2-135M-Instruct in fp32 on CPU, single-turn calculator questions (one operation) rendered
with the chat template, `--tasks` prompts x `--group-size` completions of at most 64 new tokens at T = 1,
reward = numeric match of the last number, beta / KL = 0 (no reference model), lr 1e-5, grad clip 1.0. Each side
runs two steps and the second one is timed (the first includes warm-up). agent-r1's time is `time/step` from the
returned history (rollout + rows + update); TRL's is on_step_begin -> on_step_end of its second step (generation,
rewards, forward + backward, optimizer step). agent-r1 keeps zero-variance groups (`algo.zero_variance_groups=keep`)
so both sides update on every completion. TRL gets a stock Hugging Face model and runs three times: with its
default `gradient_checkpointing=True`, with it off (agent-r1 does not checkpoint activations), and with it off and
agent-r1's oneDNN linear layers swapped into its model (agent_r1/models/onednn.py), which separates the kernel's
share of the gap from the rest. Step times vary with how long the sampled completions are, so the mean completion
length of the timed step is printed too.

Two prompts (`--prompt both`, the default): "bare" is the question alone (the chat template adds its default
system prompt, 53 tokens in all); "tools" is the calculator recipe's own system prompt with the tool schema
(265 tokens), what an agent is trained on. Both trainers render the same messages with the same chat template.

TRL is an optional extra for this script only:

    pip install trl
    python benchmarks/vs_trl.py [--tasks 2] [--group-size 8] [--prompt bare|tools|both]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from typing import Any

from transformers import AutoTokenizer

from agent_r1.config import load_config
from agent_r1.env.base import Env, StepResult
from agent_r1.models import load_model, resolve_model_path
from agent_r1.models.onednn import use_onednn
from agent_r1.rewards.numeric import numeric_match
from agent_r1.tasks.calculator import make_tasks
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.rl import train
from agent_r1.types import Action, Observation, Termination

MAX_NEW_TOKENS = 64
LR = 1e-5


def prompt_messages(question: str, prefix: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation both trainers render with the chat template: `prefix` + the question."""
    return [*prefix, {"role": "user", "content": question}]


class SingleTurnEnv(Env):
    """One user question, one answer, reward = numeric match; no tool calls, no stop strings."""

    def __init__(self, tokenizer: Any, prefix: list[dict[str, str]]) -> None:
        self.tokenizer = tokenizer
        self.prefix = prefix
        self.answer = ""

    async def reset(self, task: dict[str, Any]) -> Observation:
        self.answer = str(task["answer"])
        messages = prompt_messages(task["question"], self.prefix)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return Observation(token_ids=list(ids))

    async def step(self, action: Action) -> StepResult:
        reward = numeric_match(action.text, self.answer)
        return StepResult(None, reward, True, {"termination": Termination.ANSWERED})


def run_agent_r1(
    tasks: list[dict[str, Any]], n_tasks: int, group_size: int, run_dir: str, prefix: list[dict[str, str]]
) -> tuple[float, float]:
    model, tokenizer = load_model("default")
    overrides = [
        "steps=2",
        f"run_dir={run_dir}",
        "resume=false",
        "save_every=1000",
        f"rollout.tasks_per_step={n_tasks}",
        f"rollout.group_size={group_size}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        "rollout.max_turns=1",
        "rollout.temperature=1.0",
        "algo.kl_coef=0",
        "algo.zero_variance_groups=keep",
        f"optim.lr={LR}",
    ]
    cfg = load_config(TrainConfig, None, overrides)
    history = train(
        cfg, model=model, tokenizer=tokenizer, make_env=lambda: SingleTurnEnv(tokenizer, prefix), tasks=tasks
    )
    last = history[-1]
    print(
        f"agent-r1 step 2: {last['time/step']:.1f}s (rollout {last['time/rollout']:.1f}s, "
        f"update {last['time/update']:.1f}s), reward {last['reward_mean']:.2f}, "
        f"mean completion {last['response_tokens']:.1f} tokens"
    )
    return last["time/step"], last["response_tokens"]


def run_trl(
    tasks: list[dict[str, Any]],
    n_tasks: int,
    group_size: int,
    out_dir: str,
    checkpointing: bool,
    onednn: bool,
    prefix: list[dict[str, str]],
) -> tuple[float, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    def reward(completions: list, answer: list[str], **kwargs) -> list[float]:
        return [numeric_match(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    path = resolve_model_path("default")  # a stock Hugging Face model, as a TRL user loads it
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if onednn:
        use_onednn(model)
    generate, generations = model.generate, []

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        out = generate(*a, **kw)
        generations.append((start, time.perf_counter() - start))
        return out

    model.generate = timed_generate  # to split TRL's step into generation and the rest
    data = Dataset.from_list(
        [{"prompt": prompt_messages(t["question"], prefix), "answer": str(t["answer"])} for t in tasks]
    )
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=n_tasks * group_size,
        gradient_accumulation_steps=1,
        num_generations=group_size,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        learning_rate=LR,
        max_grad_norm=1.0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        gradient_checkpointing=checkpointing,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[timer]
    )
    trainer.train()
    seconds = timer.end[1] - timer.begin[1]
    logged = [h for h in trainer.state.log_history if "reward" in h][-1]
    length = float(logged["completions/mean_length"])
    gen = sum(d for start, d in generations if start >= timer.begin[1])
    print(
        f"TRL step 2: {seconds:.1f}s (generate {gen:.1f}s, rest {seconds - gen:.1f}s), reward {logged['reward']:.2f}, "
        f"mean completion {length:.1f} tokens"
    )
    return seconds, length


def prompt_prefix(kind: str, tokenizer: Any) -> list[dict[str, str]]:
    """ "bare": the question alone (the chat template adds its default system prompt); "tools": the
    calculator recipe's own system prompt (instructions + the tool schema), what an agent trains on."""
    if kind == "bare":
        return []
    from agent_r1.env.prompt_format import prompt_format_for
    from agent_r1.tasks.calculator import Options, make_env

    return make_env(Options(few_shot=False), prompt_format_for(tokenizer, chat=True)).prompt_prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt", choices=("bare", "tools", "both"), default="both", help="prompt(s) to run")
    parser.add_argument("--skip-trl", action="store_true", help="time agent-r1 alone (e.g. to compare two commits)")
    args = parser.parse_args()
    import torch
    import transformers

    if not args.skip_trl:
        try:
            import trl
        except ImportError:
            print("TRL is not installed: pip install trl (an optional extra for this benchmark only)")
            sys.exit(2)
        print(f"trl {trl.__version__}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"torch threads {torch.get_num_threads()}, {args.tasks} prompts x {args.group_size} completions")
    tasks = make_tasks(max(64, 4 * args.tasks), ops=(1,))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    table = []
    for kind in ("bare", "tools") if args.prompt == "both" else (args.prompt,):
        prefix = prompt_prefix(kind, tokenizer)
        n_prompt = len(
            tokenizer.apply_chat_template(
                prompt_messages(tasks[0]["question"], prefix),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        print(f"\n=== prompt {kind!r}: {n_prompt} tokens ===")
        tmp = tempfile.mkdtemp(prefix="vs_trl_")
        try:
            results = {"agent-r1": run_agent_r1(tasks, args.tasks, args.group_size, f"{tmp}/agent_r1", prefix)}
            for ckpt, onednn in () if args.skip_trl else ((True, False), (False, False), (False, True)):
                name = f"TRL, gradient_checkpointing={ckpt}" + (" (default)" if ckpt else "")
                name += ", oneDNN linears" if onednn else ""
                results[name] = run_trl(
                    tasks, args.tasks, args.group_size, f"{tmp}/trl_{ckpt}_{onednn}", ckpt, onednn, prefix
                )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        table += [(f"{kind} ({n_prompt} tok)", name, *r, r[0] / results["agent-r1"][0]) for name, r in results.items()]
    print(f"\n{'prompt':16} {'':58} {'s/step':>7} {'mean completion tokens':>23} {'ratio vs agent-r1':>18}")
    for prompt, name, seconds, length, ratio in table:
        print(f"{prompt:16} {name:58} {seconds:7.1f} {length:23.1f} {ratio:17.2f}x")


if __name__ == "__main__":
    main()

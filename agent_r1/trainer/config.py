"""The one typed config of `agent-r1 train` (YAML + key.sub=value overrides, see agent_r1.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agent_r1.algos.advantages import GROUP_ESTIMATORS
from agent_r1.engines import EngineSpec, VLLMConfig
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.tool_formats import ToolFormatName
from agent_r1.models.lora import LoraConfig
from agent_r1.models.precision import Device, Precision
from agent_r1.observe.health import HealthConfig
from agent_r1.observe.loggers import LogConfig
from agent_r1.task import TaskSpec
from agent_r1.trainer.curriculum import CurriculumConfig

Estimator = Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "turn_grpo", "gigpo", "ppo"]


@dataclass
class RolloutConfig:
    tasks_per_step: int = 8
    """tasks per RL step"""
    group_size: int = 8
    """samples per task (the GRPO / RLOO group)"""
    max_turns: int = 3
    """turn budget per episode"""
    max_new_tokens: int = 96
    """sampled tokens per turn"""
    temperature: float = 1.0
    """sampling temperature (the training log-probs use the same one)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    max_staleness: int = 0
    """asynchronous RL: how many policy versions (RL steps) older than the trainer's a trained token may
    be; rollout then runs continuously beside the update, with partial rollouts. 0 = lockstep (each
    step rolls out on the current weights, then updates); docs/training.md, Asynchronous RL"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose samples all got the same return (no group-relative signal)
    is left out and another task drawn in its place, at any max_staleness (counted as dynamic_sampling/*;
    docs/training.md)"""
    max_draws: int = 4
    """rollout.dynamic_sampling: groups looked at per step at most, in steps' worth (max_draws x
    tasks_per_step); past it the step takes the groups as they come"""
    max_batch_size: int = 64
    """rows the engine decodes together"""
    kv_cache_gb: float = 4.0
    """rollout.engine=local: KV memory for running rows and for finished turns kept for the next one
    (evicted first, then rows wait); freed for the update; at most half the memory free at start-up"""
    max_prefill_tokens: int = 2048
    """rollout.engine=local: prompt tokens one forward pass prefills beside the decoding rows (chunked
    prefill; a longer prompt takes several steps)"""
    engine: Literal["local", "remote", "vllm"] = "local"
    """local: the trainer's own model object samples (no copy, no weight sync); vllm: vLLM in this
    process; remote: an OpenAI-compatible server that speaks token ids (vllm serve, agent-r1 serve).
    vllm and remote get the weights after every optimizer step"""
    url: str = ""
    """rollout.engine=remote: the server's base URL (http://host:port)"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """rollout.engine=vllm: vLLM's own settings"""

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    def engine_spec(self, seed: int, dtype: str = "fp32", **kw: Any) -> EngineSpec:
        """The rollout engine these keys describe (`make_engine`), in the trainer or on a Ray worker."""
        return EngineSpec(
            self.engine, self.url, self.max_batch_size, self.kv_cache_gb, self.max_prefill_tokens, seed=seed,
            dtype=dtype, vllm=self.vllm, **kw,
        )  # fmt: skip


@dataclass
class AlgoConfig:
    estimator: Estimator = "grpo"
    """advantage estimator: grpo, drgrpo (no std), rloo, reinforce_pp, reinforce_pp_baseline, turn_grpo
    (GRPO on per-turn returns-to-go), gigpo (episode + step groups), ppo (GAE + critic)"""
    gae_level: Literal["step", "token"] = "step"
    """PPO: one value per step (gamma/lambda across steps) or per token"""
    gamma: float = 1.0
    """discount per step (turn); token-level GAE applies it between steps only"""
    lam: float = 0.95
    """GAE lambda"""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """token-level PPO clip, or GSPO's sequence-level ratio"""
    clip_low: float | None = None
    """ratio lower clip 1 - clip_low; None = the loss's default: 0.2 (ppo), 3e-4 (gspo, sequence ratios)"""
    clip_high: float | None = None
    """ratio upper clip 1 + clip_high; None = 0.28 (ppo, DAPO clip-higher), 4e-4 (gspo)"""
    dual_clip: float | None = None
    """dual-clip constant c > 1 for negative advantages (None = off)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how token losses become one number"""
    epochs: int = 1
    """passes over each rollout batch"""
    mini_batches: int = 1
    """optimizer steps per epoch"""
    kl_coef: float = 0.0
    """KL penalty coefficient (0 = off, no reference policy is built)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator"""
    kl_mode: Literal["loss", "reward"] = "loss"
    """add the KL to the loss, or subtract it from each step's reward"""
    reference_on_disk: bool = False
    """keep the reference's weights in run_dir/reference.safetensors between reference passes, not in
    memory during the update (full fine-tuning in one process; exact, one file read per step)"""
    entropy_coef: float = 0.0
    """entropy bonus coefficient"""
    zero_variance_groups: Literal["skip", "keep"] = "skip"
    """groups whose rewards are all equal carry no GRPO signal: drop them from the update, or keep them"""
    process_reward_norm: bool = False
    """PRIME-style: divide process rewards by the batch max of |reverse cumulative sum|"""
    process_reward_weight: float = 1.0
    """weight of process (per-step / per-tool-call) rewards next to the outcome reward"""
    process_reward_potential: bool = False
    """process rewards are differences of a potential: the episode ends at potential 0, so returns stay
    the outcome's (unbiased) and the potential is a per-turn baseline (docs/algorithms.md)"""
    step_advantage_weight: float = 1.0
    """gigpo: weight omega of the step-group advantage next to the episode one"""
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"
    """log-probs of the importance ratio's old policy: the engine's, or recomputed by the trainer (with
    TIS); auto = recompute unless the trainer's own model sampled them in fp32 (rollout.engine=local)
    and in lockstep (rollout.max_staleness=0)"""
    tis_cap: float = 2.0
    """truncated importance sampling: tokens are weighted by min(p_trainer / p_rollout, tis_cap) when
    old log-probs are recomputed (0 = no correction)"""

    def recompute_old_logprobs(self, engine: str, dtype: str, max_staleness: int = 0) -> bool:
        """Whether the trainer recomputes old log-probs: another engine's kernels, or bf16, make the
        rollout's log-probs differ from the trainer's, and under asynchronous RL older policies sampled
        them (docs/algorithms.md, "Off-policy correction")."""
        if self.old_logprobs != "auto":
            return self.old_logprobs == "recompute"
        return engine != "local" or dtype != "fp32" or max_staleness > 0

    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high), each the loss's default when unset: sequence-level ratios sit near 1, so
        GSPO's paper clips them at 3e-4 / 4e-4; token-level PPO uses 0.2 / 0.28 (DAPO's clip-higher)."""
        low, high = (3e-4, 4e-4) if self.policy_loss == "gspo" else (0.2, 0.28)
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    critic: Literal["head", "separate"] = "head"
    """PPO critic: a value head on the policy backbone, or a separate copy of the model"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    value_clip: float = 0.2
    """value clipping range"""


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """peak learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """max global grad norm"""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """learning-rate schedule after warm-up"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up"""
    micro_batch_tokens: int = 1024
    """token budget of one packed micro-batch (gradient accumulation covers the rest)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, more compute; shared prefixes become packing)"""


@dataclass
class ValConfig:
    every: int = 0
    """validate greedily every N RL steps, before the first and after the last (0 = never)"""
    num_tasks: int = 32
    """tasks of the task's validation split (disjoint from training and from the held-out test split)"""
    task: dict[str, Any] = field(default_factory=dict)
    """task options that differ for validation, e.g. val.task.ops=[1,2] or val.task.data=FILE (jsonl)"""
    metric: str = "accuracy"
    """eval metric that picks the best step, higher is better (accuracy, accuracy/ops=2, reward, reward/f1, ...)"""
    keep_best: bool = True
    """export the policy of the best validation step (ties: the earlier step) as RUN_DIR/policy"""


@dataclass
class ClusterConfig:
    rollout_workers: int = 0
    """Ray actors that roll out, each with its own engine and envs (0 = roll out in the trainer's
    process; under torchrun every rank rolls out its share of the tasks)"""
    address: str = ""
    """an existing Ray cluster to join (host:6379 or ray://host:10001); empty = start a local Ray"""
    worker_cpus: float = 1.0
    """CPUs each rollout worker reserves (its torch threads)"""
    worker_gpus: float = 0.0
    """GPUs each rollout worker reserves (1 for a vLLM worker on a GPU node)"""
    retries: int = 1
    """a worker that dies is restarted, and its tasks are rolled out again this many times before
    they count as errored episodes"""
    retrieval_actor: bool = False
    """the task's shared service (hotpotqa: its search index) runs as one more Ray actor that every
    worker's envs query over HTTP, for tasks that declare one (service(options), using_service)"""


@dataclass
class TrainConfig:
    model: str = "default"
    """"default", a bundled model name, a Hugging Face directory, or a checkpoint export"""
    task: TaskSpec = field(default_factory=TaskSpec)
    """calculator, gsm8k, hotpotqa, or an import path (my_pkg.my_task); its options: task.KEY=VALUE"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    tool_format: ToolFormatName = "auto"
    """how the model writes tool calls: auto = its chat template's family (hermes, llama3_json, mistral,
    mistral_args, qwen3_coder, harmony); hermes for a model without a template"""
    device: Device = "auto"
    """where the model runs: auto = cuda when a GPU is visible, else cpu"""
    dtype: Precision = "fp32"
    """fp32, or bf16 compute with fp32 master weights, optimizer state and log-softmax (GPU)"""
    steps: int = 20
    """RL steps (rollout + update)"""
    seed: int = 0
    """seed of sampling, data order and mini-batch shuffling"""
    run_dir: str = "runs/calculator"
    """where config, metrics, checkpoints and the exported policy go"""
    save_every: int = 10
    """checkpoint every N steps (and at the end)"""
    keep_last: int = 2
    """checkpoints to keep"""
    resume: bool = True
    """continue from the newest checkpoint in run_dir if there is one"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """sampling and episode settings"""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """estimator, losses, KL"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimizer and batching"""
    log: LogConfig = field(default_factory=LogConfig)
    """loggers (JSONL always; TensorBoard, W&B) and trajectory records"""
    health: HealthConfig = field(default_factory=HealthConfig)
    """training-health diagnostics and their thresholds"""
    val: ValConfig = field(default_factory=ValConfig)
    """validation during training and best-checkpoint selection"""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray rollout workers (training on N processes is torchrun's: docs/distributed.md)"""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """a task option raised value by value as the policy masters each (agent_r1/trainer/curriculum.py)"""

    def __post_init__(self) -> None:
        a, r, o = self.algo, self.rollout, self.optim
        checks = [
            (o.lr > 0, f"optim.lr must be > 0, got {o.lr}"),
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (r.tasks_per_step >= 1, f"rollout.tasks_per_step must be >= 1, got {r.tasks_per_step}"),
            (
                r.group_size >= 2 or a.estimator not in GROUP_ESTIMATORS,
                f"algo.estimator={a.estimator} compares samples of a task: rollout.group_size must be >= 2",
            ),
            (a.dual_clip is None or a.dual_clip > 1, f"algo.dual_clip must be > 1, got {a.dual_clip}"),
            ((a.clip_low or 1) > 0 and (a.clip_high or 1) > 0, "algo.clip_low and algo.clip_high must be > 0"),
            (
                r.temperature > 0,
                "rollout.temperature must be > 0 for training: the importance ratio and log-probs are taken "
                "at the sampling temperature (greedy decoding has no log-probs to train on)",
            ),
            (r.engine != "remote" or r.url, "rollout.engine=remote needs rollout.url (the server's base URL)"),
            (0 < r.vllm.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization must be in (0, 1]"),
            ((r.vllm.kv_cache_gb or 1) > 0, f"rollout.vllm.kv_cache_gb must be > 0, got {r.vllm.kv_cache_gb}"),
            (r.kv_cache_gb > 0, f"rollout.kv_cache_gb must be > 0, got {r.kv_cache_gb}"),
            (r.max_prefill_tokens > 0, f"rollout.max_prefill_tokens must be > 0, got {r.max_prefill_tokens}"),
            (a.tis_cap == 0 or a.tis_cap >= 1, f"algo.tis_cap must be 0 (off) or >= 1, got {a.tis_cap}"),
            (
                not (self.val.every and getattr(self.task.options, "data", None) and "data" not in self.val.task),
                "task.data is used whole, for every split: validating on it would select on training tasks; "
                "give val.task.data (a validation file) too",
            ),
            (0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "algo.gamma and algo.lam must be in [0, 1]"),
            (a.epochs >= 1 and a.mini_batches >= 1, "algo.epochs and algo.mini_batches must be >= 1"),
            (a.kl_coef >= 0, f"algo.kl_coef must be >= 0, got {a.kl_coef}"),
            (o.micro_batch_tokens >= 64, f"optim.micro_batch_tokens must be >= 64, got {o.micro_batch_tokens}"),
            (o.grad_clip > 0, f"optim.grad_clip must be > 0, got {o.grad_clip}"),
            (self.save_every >= 1 and self.keep_last >= 1, "save_every and keep_last must be >= 1"),
            (self.val.every >= 0 and self.val.num_tasks >= 1, "val.every must be >= 0 and val.num_tasks >= 1"),
            (self.cluster.rollout_workers >= 0, "cluster.rollout_workers must be >= 0"),
            (
                r.engine != "remote" or not self.cluster.rollout_workers,
                "rollout.engine=remote already rolls out elsewhere: cluster.rollout_workers must be 0",
            ),
            (self.cluster.retries >= 0, f"cluster.retries must be >= 0, got {self.cluster.retries}"),
            (r.max_staleness >= 0, f"rollout.max_staleness must be >= 0, got {r.max_staleness}"),
            (r.max_draws >= 1, f"rollout.max_draws must be >= 1, got {r.max_draws}"),
            (
                not r.max_staleness or a.old_logprobs != "rollout",
                "rollout.max_staleness > 0 samples with older policies: algo.old_logprobs must be auto or "
                "recompute (the trainer's log-probs anchor the ratio, the engine's weight it)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        r.sampling()  # validates temperature, top_p, max_new_tokens
        self.val.task = {**self.val.task}
        self.task.with_options(self.val.task, prefix="val.task.")  # an unknown or bad validation option fails now

"""`AgentEnvLoop`: run N tasks × G samples through env + engine until every trajectory ends.

Every trajectory is its own coroutine; their `generate` calls meet in the engine, which decodes them
as one batch, and their tool calls run concurrently. Whatever the model writes or a tool does, a
trajectory ends with a termination reason; an env exception ends that trajectory as `error`, never
the run. Steps keep the exact prompt ids and sampled ids (see `merge` for training rows).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from agent_r1.engines.protocol import Engine, SamplingParams
from agent_r1.env.base import Env
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.types import Action, Image, Observation, Step, Termination, Trajectory


class AgentEnvLoop:
    """Roll out a policy (an `Engine`) in fresh envs made by `make_env`."""

    def __init__(
        self,
        engine: Engine,
        make_env: Callable[[], Env],
        sampling: SamplingParams,
        *,
        prompt_format: PromptFormat | None = None,
        max_steps: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.engine = engine
        self.make_env = make_env
        self.sampling = sampling
        self.prompt_format = prompt_format  # only needed by envs that return messages or text
        # The env ends its episodes (its turn budget is the task's `max_turns`, τ²'s and the gateway's their
        # own); a cap here would cut them short whatever the config says. `max_steps` is a caller's own cap.
        self.max_steps = max_steps
        self.seed = seed

    async def run(
        self,
        tasks: list[dict[str, Any]],
        group_size: int = 1,
        first_index: int = 0,
        cohort: bool = True,
        on_done: Callable[[Trajectory, int], None] | None = None,
        positions: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """Trajectories of every task × `group_size` samples, grouped task by task. Sample g of the task at
        position p (`positions[j]` for task j, else j) is seeded as the loop's `first_index + p * group_size
        + g`-th: a worker given a share of a batch, or a resumed eval given the tasks a killed one left,
        samples its trajectories exactly as one loop over the whole batch would. `cohort=False` lets other
        callers' requests share the engine's batches as they come (an asynchronous producer's groups), and
        so does an env factory whose `slow_steps` is true (`SLOW_STEPS` in the task): a lockstep batch
        waits for every episode's step before it decodes on, so steps of seconds (τ²'s customer, a model
        on the same machine) would run one at a time. Such rollouts are reproducible up to fp32 rounding
        between batch shapes, not bit for bit.
        `on_done(traj, index)` is called as each episode ends, in the order they end, with its sample index
        (eval's progress, and the records it keeps as it goes: the index says which sample each one is)."""
        if positions is not None and len(positions) != len(tasks):
            raise ValueError(f"positions: {len(positions)} for {len(tasks)} tasks")
        trajs, indices = [], []
        for j, task in enumerate(tasks):
            group, p = uuid.uuid4().hex[:12], j if positions is None else positions[j]
            trajs += [Trajectory(task=task, traj_id=f"{group}-{g}", group_id=group) for g in range(group_size)]
            indices += [first_index + p * group_size + g for g in range(group_size)]
        cohort = cohort and not getattr(self.make_env, "slow_steps", False)
        # LocalEngine batches a cohort independently of timing; others batch as requests come
        with self.engine.cohort(len(trajs)) if cohort else contextlib.nullcontext() as members:
            await asyncio.gather(*(self._episode(t, i, members, on_done) for t, i in zip(trajs, indices, strict=True)))
        return trajs

    def run_sync(
        self,
        tasks: list[dict[str, Any]],
        group_size: int = 1,
        first_index: int = 0,
        on_done: Callable[[Trajectory, int], None] | None = None,
        positions: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        return asyncio.run(self.run(tasks, group_size, first_index, on_done=on_done, positions=positions))

    async def _episode(
        self, traj: Trajectory, index: int, cohort: Any = None, on_done: Callable[[Trajectory, int], None] | None = None
    ) -> None:
        if cohort is not None:
            cohort.join()
        env = None
        try:
            env = self.make_env()  # inside: a server that cannot (re)start ends this episode, not the group
            if not isinstance(env, Env):
                raise TypeError(f"{type(env).__name__} is not an agent_r1.env.base.Env: subclass it")
            obs: Observation | None = await env.reset(traj.task)
            traj.termination = Termination.MAX_TURNS
            for turn in itertools.count() if self.max_steps is None else range(self.max_steps):
                prompt, images = self._prompt(obs)
                if len(prompt) >= self.engine.max_context:
                    traj.termination = Termination.CONTEXT_OVERFLOW
                    break
                params = self._params(env, index, turn)
                n = env.samples  # samples of this step (each its own seed: the engine's seed + k)
                if images:  # only engines that read images are asked to
                    outs = await self.engine.generate([prompt] * n, params, images=[images] * n)
                else:
                    outs = await self.engine.generate([prompt] * n, params)
                first, *others = (Action(o.token_ids, o.logprobs, o.text, o.finish_reason) for o in outs)
                first.alternatives = others
                state = obs_state(obs, prompt, images)  # the state the step acts from, before the env moves on
                obs, reward, done, info = await env.step(first)
                out = outs[info.get("choice", 0)]  # the sample the episode went on from
                traj.steps.append(
                    Step(
                        prompt,
                        out.token_ids,
                        out.logprobs,
                        reward,
                        info,
                        out.text,
                        turn,
                        out.finish_reason,
                        done,
                        state,
                        images,
                        out.versions,
                        params.grammar,
                    )
                )
                if done:
                    traj.termination = Termination(info.get("termination", Termination.ANSWERED))
                    for k, r in info.get("step_rewards", {}).items():  # the env scored earlier steps at the end
                        traj.steps[k].reward = r
                    break
        except Exception as exc:  # a broken env or engine ends this trajectory, not the run
            fail(traj, exc)
        finally:
            if cohort is not None:
                cohort.leave()
            if isinstance(env, Env):
                with contextlib.suppress(Exception):
                    await env.close()
        try:
            traj.metrics = trajectory_metrics(traj)
        except Exception as exc:  # an env's info that is not numbers (a reward part "n/a"): the episode errors
            fail(traj, exc)
            traj.metrics = {"reward": 0.0, "turns": float(len(traj.steps))}
        if on_done is not None:
            on_done(traj, index)

    def _params(self, env: Env, index: int, turn: int) -> SamplingParams:
        """The loop's sampling params + the env's stop strings and grammar + a per-(trajectory, turn) seed."""
        stop = tuple(dict.fromkeys(self.sampling.stop + tuple(env.stop)))
        seed = None if self.seed is None else (self.seed * 1_000_003 + index) * 1_009 + turn
        return dataclasses.replace(self.sampling, stop=stop, seed=seed, grammar=env.grammar)

    def _prompt(self, obs: Observation | None) -> tuple[list[int], list[Image]]:
        """The prompt's ids and the images of its placeholders."""
        if obs is None:
            raise ValueError("env returned no observation but did not end the episode")
        if obs.token_ids is not None:
            return obs.token_ids, list(obs.images)
        if self.prompt_format is None:
            raise ValueError("env returned messages/text: give AgentEnvLoop a prompt_format")
        messages = obs.messages if obs.messages is not None else [{"role": "user", "content": obs.text}]
        return self.prompt_format.initial(messages), self.prompt_format.images(messages)


def fail(traj: Trajectory, exc: BaseException) -> None:
    """End `traj` as errored, saying why: it is counted, left out of the update, and the run goes on."""
    traj.termination = Termination.ERROR
    traj.error = f"{type(exc).__name__}: {exc}"[:500]


def obs_state(obs: Observation | None, prompt: list[int], images: list[Image] = ()) -> str:
    """The state a step acts from, for GiGPO's step groups: the env's own `state`, else a digest of the
    whole prompt and its images (identical contexts are identical states)."""
    if obs is not None and obs.state is not None:
        return obs.state
    digest = hashlib.sha1(array("l", prompt).tobytes())
    for image in images:
        digest.update(image.digest.encode())
    return digest.hexdigest()[:16]


def trajectory_metrics(traj: Trajectory) -> dict[str, float]:
    """Per-trajectory counts the trainer and eval aggregate."""
    infos = [s.info for s in traj.steps]
    parts = {f"reward/{k}": float(v) for i in infos for k, v in i.get("reward_parts", {}).items()}
    kinds: Counter = Counter()
    for i in infos:
        kinds.update(i.get("tool_errors", {}))
    parts |= {f"tool_errors/{k}": float(n) for k, n in kinds.items()}  # timeout, memory_limit, parse_error, ...
    used = Counter(r["name"] for i in infos for r in i.get("tool_results", []))
    parts |= {f"tool_calls/{name}": float(n) for name, n in used.items()}  # each tool's calls per episode
    for i in infos:  # an env's own per-step counts (the gateway's merged and fresh steps), summed per episode
        for name, value in i.get("metrics", {}).items():
            parts[name] = parts.get(name, 0.0) + float(value)
    if constrained := sum(s.grammar is not None for s in traj.steps):  # sampled under a grammar (models/grammar.py)
        parts["constrained_steps"] = float(constrained)
    return parts | {
        "reward": traj.reward,
        "turns": float(len(traj.steps)),
        "tool_calls": float(sum(i.get("tool_calls", 0) for i in infos)),
        "tool_errors": float(sum(sum(i.get("tool_errors", {}).values()) for i in infos)),
        "format_errors": float(sum(i.get("format_errors", 0) for i in infos)),
        "response_tokens": float(sum(len(s.response_ids) for s in traj.steps)),
        "truncated": float(
            any(s.finish_reason == "length" for s in traj.steps) or traj.termination == Termination.CONTEXT_OVERFLOW
        ),
    }


def correct(traj: Trajectory) -> float:
    """Whether the episode solved its task: the reward's `correct` part when it reports one (a format
    bonus must not count), else whether the outcome reward reached 1."""
    return traj.metrics.get("reward/correct", float(traj.outcome >= 1.0))


def summarize(trajs: list[Trajectory]) -> dict[str, float]:
    """Batch means of the per-trajectory metrics, plus the share of each termination reason."""
    if not trajs:
        return {}
    keys = dict.fromkeys(k for t in trajs for k in t.metrics)
    out = {k: sum(t.metrics.get(k, 0.0) for t in trajs) / len(trajs) for k in keys}
    for reason in Termination:
        out[f"termination/{reason.value}"] = sum(t.termination == reason for t in trajs) / len(trajs)
    if (rep := sample_repetition(trajs)) is not None:
        out["repetition"] = rep
    return out


def sample_repetition(trajs: list[Trajectory]) -> float | None:
    """How alike the samples of one task are: per group (G >= 2) of identical responses,
    (G - distinct) / (G - 1), from 0 (all differ) to 1 (all the same token for token); batch mean.

    Rising repetition with falling entropy and reward variance is the "echo trap" of multi-turn agent
    RL (RAGEN, Wang et al. 2025, arXiv 2504.20073): the policy collapses onto one template.
    """
    groups: dict[str, list[tuple]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(tuple(tok for s in t.steps for tok in s.response_ids))
    scores = [(len(g) - len(set(g))) / (len(g) - 1) for g in groups.values() if len(g) > 1]
    return sum(scores) / len(scores) if scores else None

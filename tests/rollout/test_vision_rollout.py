"""The log-prob guard rail with images: an image in the first observation and another in each tool
result, through the engine (prefix sharing, parked slots), merging and the trainer's micro-batches."""

import pytest
import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.base import Env, StepResult
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.models.vision import image_token_id
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.trainer.batching import pack, token_logprobs
from agent_r1.trainer.rows import build_rows, row_logprobs
from agent_r1.types import Observation, Termination
from tests.conftest import picture

QUESTION = "Look at the picture below and the pictures the zoom tool returns, then say what they show. " * 2


class ZoomEnv(Env):
    """A task's picture with a long question, then a tool response holding a new picture every turn, added
    as ToolEnv adds it (the format's continuation); the third turn ends the episode."""

    def __init__(self, processor, turns=3):
        self.fmt, self.turns = prompt_format_for(processor), turns

    async def reset(self, task):
        self.n = 0
        messages = [
            {
                "role": "user",
                "content": [{"type": "text", "text": QUESTION}, {"type": "image", "image": picture(task["seed"])}],
            }
        ]
        self.context, self.images = self.fmt.initial(messages), self.fmt.images(messages)
        return Observation(token_ids=list(self.context), images=list(self.images))

    async def step(self, action):
        self.n += 1
        if self.n >= self.turns:
            return StepResult(None, 1.0, True, {"termination": Termination.ANSWERED})
        tool = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<tool_response>\n"},
                    {"type": "image", "image": picture(100 + self.n)},
                ],
            }
        ]
        self.context = (
            self.context + action.token_ids + self.fmt.continuation(tool, after_eos=action.finish_reason == "eos")
        )
        self.images += self.fmt.images(tool)
        return StepResult(Observation(token_ids=list(self.context), images=list(self.images)), 0.0, False, {})


def rollout(model, processor, tasks, group=2):
    engine = LocalEngine(model, processor.tokenizer, seed=0, max_context=1024)
    loop = AgentEnvLoop(engine, lambda: ZoomEnv(processor), SamplingParams(max_new_tokens=8), seed=3)
    return engine, loop.run_sync(tasks, group_size=group)


def reference(model, ids, images):
    """Log-probs [T-1] of a row from the model's own forward: its own placeholder scatter, and for
    Qwen2-VL its own mrope positions of the whole row."""
    inputs = {k: torch.cat([i.inputs[k] for i in images]) for k in images[0].inputs}
    t = torch.tensor([ids])
    if "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = (t == image_token_id(model)).int()
    with torch.no_grad():
        logits = model(input_ids=t, **inputs).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, t[0, 1:, None]).squeeze(-1)


@pytest.fixture(params=["llava", "qwen2_vl", "qwen2_5_vl", "smolvlm"])
def vlm(request):
    """LLaVA and SmolVLM (1D positions; SmolVLM's image is markers around its placeholders), Qwen2-VL and
    Qwen2.5-VL (mrope positions from get_rope_index), each with its processor."""
    if request.param == "llava":
        return request.getfixturevalue("tiny_llava")
    return request.getfixturevalue("tiny_vlm")(request.param)


def test_image_trajectories_are_token_exact_in_rollout_and_training(vlm):
    model, processor = vlm
    token = image_token_id(model)
    tasks = [{"seed": 1}, {"seed": 2}]  # the same text, different pictures
    engine, trajs = rollout(model, processor, tasks)
    assert all(t.termination == Termination.ANSWERED and len(t.steps) == 3 for t in trajs), [t.error for t in trajs]
    assert [len(s.images) for s in trajs[0].steps] == [1, 2, 3]
    assert engine.stats["reused"] > 0  # later turns continued parked slots, the group shared its prompt
    seqs = [merge_trajectory(t) for t in trajs]
    assert all(len(s) == 1 and len(s[0].images) == 3 for s in seqs)  # images extend: one row per episode
    for (row,) in seqs:
        assert row.input_ids.count(token) == sum(i.num_tokens for i in row.images) >= 12
        mask = torch.tensor(row.loss_mask[1:], dtype=torch.bool)
        ref = reference(model, row.input_ids, row.images)
        assert (ref[mask] - torch.tensor(row.logprobs[1:])[mask]).abs().max().item() <= 1e-4
    rows, _ = build_rows(trajs, seqs, token)
    # the two tasks' rows share the question's ids but not the picture: a shared prefix stops there
    first_image = seqs[0][0].input_ids.index(token)
    assert [mb.prefix_len for mb in pack(rows, 4096)] == [first_image]  # by ids it would run past the image
    for row, got in zip(rows, row_logprobs(model, rows, 4096, 1.0), strict=True):
        assert (got - row.old_logp)[row.mask > 0].abs().max().item() <= 1e-4
    # the other forward: rows packed one after another
    assert trainer_gap(model, pack(rows, 4096, min_shared_prefix=10**6)) <= 1e-4


def trainer_gap(model, micro_batches) -> float:
    """Largest |trainer - rollout| log-prob over the sampled tokens of the micro-batches."""
    with torch.no_grad():
        return max(((token_logprobs(model, mb)[0] - mb.old_logp) * mb.mask).abs().max().item() for mb in micro_batches)


def test_same_ids_different_pictures_are_never_shared(vlm):
    """Two prompts whose ids are equal (placeholders alike) but whose pictures differ sample as if each
    were alone."""
    model, processor = vlm
    fmt = prompt_format_for(processor)
    msgs = [
        [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "image": picture(s)}]}]
        for s in (5, 6)
    ]
    ids = [fmt.initial(m) for m in msgs]
    images = [fmt.images(m) for m in msgs]
    assert ids[0] == ids[1]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    engine = LocalEngine(model, processor.tokenizer, seed=0, max_context=1024)
    both = engine.generate_batch(ids, params, [0, 0], images=images)
    alone = [
        LocalEngine(model, processor.tokenizer, seed=0).generate_batch([p], params, [0], images=[i])[0]
        for p, i in zip(ids, images, strict=True)
    ]
    for a, b in zip(both, alone, strict=True):
        assert (
            a.token_ids == b.token_ids and max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        )
    assert both[0].logprobs != both[1].logprobs

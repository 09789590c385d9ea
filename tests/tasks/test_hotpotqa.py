"""The HotpotQA task on the shared data: splits, the pooled corpus, demonstrations, and a tiny-model run."""

import pytest

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import parse_tool_calls
from agent_r1.retrieval import Passage, load_retriever
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
from agent_r1.task import TaskSpec
from agent_r1.tasks import hotpotqa

pytestmark = pytest.mark.skipif(not hotpotqa.DATA_DIR.is_dir(), reason="needs ../shared/data/hotpotqa")


def test_test_is_the_dev_file_and_val_a_bucket_of_the_train_file():
    train, val, dev = hotpotqa.load(), hotpotqa.load(split="val"), hotpotqa.load(split="test")
    assert len(train) + len(val) == len(dev) == 300 and 10 < len(val) < 60
    ids = [t["id"] for t in train + val + dev]
    assert len(set(ids)) == len(ids)
    assert all(t["question"] and t["answer"] and len(t["supporting_titles"]) == 2 for t in dev)


def test_corpus_pools_every_paragraph_once_per_title():
    passages = hotpotqa.corpus()
    titles = [p.title for p in passages]
    assert len(titles) == len(set(titles)) == 5912
    support = {title for t in hotpotqa.load(split="test") for title in t["supporting_titles"]}
    assert support <= set(titles)  # every supporting paragraph can be found


def test_demonstration_searches_the_question_then_the_missing_paragraph(tokenizer, tmp_path):
    task = {"question": "Which band released Tinted Windows?", "answer": "Tinted Windows",
            "supporting_titles": ["Tinted Windows (album)", "Fountains of Wayne"]}  # fmt: skip
    corpus = [
        Passage("Tinted Windows (album)", "Tinted Windows is the debut album of the band Tinted Windows. " * 20),
        Passage("Fountains of Wayne", "Fountains of Wayne was an American rock group from New Jersey. " * 20),
    ]  # the question's words only match the first paragraph: the second needs a search by its title
    env = hotpotqa.make_env(
        hotpotqa.Options(max_tool_tokens=32),
        ChatFormat(tokenizer),
        index=load_retriever(corpus, "bm25", cache=tmp_path),
    )
    demo = hotpotqa.demo(task, env)
    assert [m["role"] for m in demo] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    queries = [parse_tool_calls(m["content"])[0].arguments["query"] for m in demo[1:-1:2]]
    assert queries == [task["question"], "Fountains of Wayne"]
    assert "(Title: Tinted Windows (album))" in demo[2]["content"] and "Fountains" not in demo[2]["content"]
    assert all(m["content"].count("...[truncated]") == 1 for m in demo[2:-1:2])  # the env's own token cut
    assert demo[-1]["content"].endswith("<answer>Tinted Windows</answer>")
    total, parts = hotpotqa.reward(task, [m["content"] for m in demo[1::2]])
    assert total == pytest.approx(0.3 + 1.0) and parts["em"] == parts["f1"] == parts["correct"] == 1.0


def test_tiny_model_rolls_out_in_the_search_env(tokenizer, tiny_model):
    spec = TaskSpec("hotpotqa")
    tasks, make_env = spec.tasks("test", 2), spec.env_factory(tokenizer, chat=True, max_turns=2)
    engine = LocalEngine(tiny_model, tokenizer, max_batch_size=8, seed=0)
    loop = AgentEnvLoop(engine, make_env, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0)
    trajs = loop.run_sync(tasks, group_size=2)
    assert len(trajs) == 4 and all(t.termination is not None and t.error is None for t in trajs)
    for t in trajs:
        assert t.steps[0].prompt_ids[-3:] == tokenizer.encode("<|im_start|>assistant\n")[-3:]
        assert "search" in tokenizer.decode(t.steps[0].prompt_ids)  # the tool schema is in the prompt
        assert {"reward/em", "reward/f1", "reward/sub_em", "reward/format"} <= set(t.metrics)

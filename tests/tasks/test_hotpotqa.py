"""The HotpotQA task on the bundled data: splits, the pooled corpus, demonstrations, and a tiny-model run."""

import pytest

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import format_tool_call, parse_tool_calls
from agent_r1.retrieval import Passage, load_retriever
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.task import TaskSpec
from agent_r1.tasks import hotpotqa
from agent_r1.types import Action


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
        hotpotqa.Options(max_tool_tokens=32, tools="search"),
        ChatFormat(tokenizer),
        index=load_retriever(corpus, "bm25", cache=tmp_path),
    )
    assert set(env.tools) == {"search"}
    demo = hotpotqa.demo(task, env)
    assert [m["role"] for m in demo] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    queries = [parse_tool_calls(m["content"])[0].arguments["query"] for m in demo[1:-1:2]]
    assert queries == [task["question"], "Fountains of Wayne"]
    assert "(Title: Tinted Windows (album))" in demo[2]["content"] and "Fountains" not in demo[2]["content"]
    assert all(m["content"].count("...[truncated]") == 1 for m in demo[2:-1:2])  # the env's own token cut
    assert demo[-1]["content"].endswith("<answer>Tinted Windows</answer>")
    total, parts = hotpotqa.reward(task, [m["content"] for m in demo[1::2]])
    assert total == pytest.approx(0.3 + 1.0) and parts["em"] == parts["f1"] == parts["correct"] == 1.0


BRIDGE_TASK = {
    "question": "Which city was the first show of the supergroup with the Fountains of Wayne singer?",
    "answer": "Tulsa",
    "supporting_titles": ["Tinted Windows (band)", "Adam Schlesinger"],
}
BRIDGE_CORPUS = [
    Passage("Tinted Windows (band)", "Tinted Windows was an American power pop supergroup with Adam Schlesinger. "
            "Their first show was in Tulsa, Oklahoma, in 2009."),
    Passage("Adam Schlesinger", "Adam Schlesinger was a singer of Fountains of Wayne."),
    Passage("Tulsa Zoo", "The Tulsa Zoo is a zoo in Tulsa, Oklahoma, with 2,600 animals."),
]  # fmt: skip


def bridge_env(tokenizer, tmp_path, **options):
    return hotpotqa.make_env(
        hotpotqa.Options(max_tool_tokens=64, **options),
        ChatFormat(tokenizer),
        max_turns=6,
        index=load_retriever(BRIDGE_CORPUS, "bm25", cache=tmp_path),
        corpus_pages=BRIDGE_CORPUS,
    )


def test_search_and_open_demonstration_opens_each_supporting_page(tokenizer, tmp_path):
    env = bridge_env(tokenizer, tmp_path)
    assert set(env.tools) == {"search", "open"}
    demo = hotpotqa.demo(BRIDGE_TASK, env)
    calls = [parse_tool_calls(m["content"])[0] for m in demo[1:-1:2]]
    assert [(c.name, c.arguments) for c in calls] == [
        ("search", {"query": BRIDGE_TASK["question"]}),
        ("open", {"title": "Tinted Windows (band)"}),
        ("open", {"title": "Adam Schlesinger"}),  # named by the first page: opened without a search
    ]
    assert "Tulsa" not in demo[2]["content"]  # search shows 12-word snippets: the answer is in the page
    assert "Their first show was in Tulsa" in demo[4]["content"]  # the opened paragraph, whole
    # the last thought quotes where the opened page states the answer, then answers
    assert demo[-1]["content"] == (
        "<think>American power pop supergroup with Adam Schlesinger. Their first show was in Tulsa, Oklahoma, in "
        "2009.</think>\n<answer>Tulsa</answer>"
    )
    assert hotpotqa.evidence("Doc 1 (Title: X) nothing here", "Tulsa") is None
    assert hotpotqa.evidence("(Title: X) a b c d Tulsa e f g", "tulsa", words=2) == "c d Tulsa e f"
    assert hotpotqa.evidence("(Title: X) Is it so?", "yes") is None  # yes/no is never quoted


def test_gold_context_demonstration_answers_from_the_paragraphs_without_a_tool(tokenizer, tmp_path):
    """The reading oracle's cold start: the supporting paragraphs and the question, then the answer,
    quoting where a paragraph states it."""
    env = bridge_env(tokenizer, tmp_path, gold_context=True)
    prompt = f"(Title: Tinted Windows (band)) {BRIDGE_CORPUS[0].text}\n\nQuestion: {BRIDGE_TASK['question']}"
    task = dict(BRIDGE_TASK, messages=[{"role": "user", "content": prompt}])
    demo = hotpotqa.demo(task, env)
    assert demo[:-1] == task["messages"] and demo[-1]["role"] == "assistant"
    assert not parse_tool_calls(demo[-1]["content"])
    assert demo[-1]["content"].startswith("<think>American power pop") and demo[-1]["content"].endswith(
        "Tulsa, Oklahoma, in 2009.</think>\n<answer>Tulsa</answer>"
    )
    real = hotpotqa.demos(hotpotqa.Options(gold_context=True), env, 3)  # the bundled train split
    for d, t in zip(real, hotpotqa.load(n=3), strict=True):
        assert len(d) == 2 and d[0]["content"].endswith(f"Question: {t['question']}")
        assert all(f"(Title: {title})" in d[0]["content"] for title in t["supporting_titles"])
        assert d[1]["content"].endswith(f"<answer>{t['answer']}</answer>")
    assert hotpotqa.demos(hotpotqa.Options(), env, 1)[0][0]["content"] == hotpotqa.load(n=1)[0]["question"]


async def test_process_reward_is_the_share_of_supporting_pages_read(tokenizer, tmp_path):
    env = bridge_env(tokenizer, tmp_path, process_reward=True)
    await env.reset(BRIDGE_TASK)

    async def step(name, **args):
        text = "<think>.</think>\n" + format_tool_call(name, args)
        ids = tokenizer.encode(text)
        return await env.step(Action(ids, [0.0] * len(ids), text))

    assert (await step("search", query="Tinted Windows supergroup")).reward == 0.0  # snippets are not reading
    assert (await step("open", title="Tinted Windows (band)")).reward == 0.5
    assert (await step("open", title="tinted windows (band)")).reward == 0.0  # read already
    missing = await step("open", title="Adam Schlesingr")
    assert missing.reward == 0.0 and missing.info["tool_errors"] == {"unknown_title": 1}
    assert "Closest titles: Adam Schlesinger" in tokenizer.decode(missing.observation.token_ids[-40:])
    assert (await step("open", title="Adam Schlesinger")).reward == 0.5
    whole = bridge_env(tokenizer, tmp_path, tools="search", process_reward=True)
    await whole.reset(BRIDGE_TASK)
    text = format_tool_call("search", {"query": "Adam Schlesinger Fountains of Wayne", "k": 1})
    ids = tokenizer.encode(text)
    assert (await whole.step(Action(ids, [0.0] * len(ids), text))).reward == 0.5  # a whole passage is read
    assert bridge_env(tokenizer, tmp_path).potential is None  # off unless asked for


async def test_call_error_reward_charges_the_learned_shortcut(tokenizer, tmp_path):
    """RL learned open({"query": title}) -> invalid arguments -> answer with the title (docs/search.md):
    with call_error_reward that call costs; an unknown title (a helpful observation) does not."""
    env = bridge_env(tokenizer, tmp_path, process_reward=True, call_error_reward=-1.0)
    await env.reset(BRIDGE_TASK)

    async def step(name, **args):
        text = "<think>.</think>\n" + format_tool_call(name, args)
        ids = tokenizer.encode(text)
        return await env.step(Action(ids, [0.0] * len(ids), text))

    shortcut = await step("open", query="Tinted Windows (band)")
    assert shortcut.reward == -1.0 and shortcut.info["tool_errors"] == {"invalid_arguments": 1}
    assert (await step("open", title="Adam Schlesingr")).reward == 0.0
    assert (await step("open", title="Adam Schlesinger")).reward == 0.5


async def test_episode_format_reward_pays_the_demonstration_once(tokenizer, tmp_path):
    """format_reward=episode: the demonstration (3 calls, then the answer) ends on 1.0 + 0.2 from the
    env, where the per-call term pays 1.0 + 0.4; five more calls would raise only the per-call one."""
    for fmt, outcome in (("per_call", 1.0 + 0.4), ("episode", 1.0 + 0.2)):
        env = bridge_env(tokenizer, tmp_path, format_reward=fmt)
        await env.reset(BRIDGE_TASK)
        for m in hotpotqa.demo(BRIDGE_TASK, bridge_env(tokenizer, tmp_path))[1::2]:
            ids = tokenizer.encode(m["content"])
            result = await env.step(Action(ids, [0.0] * len(ids), m["content"]))
        assert result.done and result.reward == pytest.approx(outcome)
        assert result.info["reward_parts"]["format"] == pytest.approx(outcome - 1.0)
    calls = [m["content"] for m in hotpotqa.demo(BRIDGE_TASK, bridge_env(tokenizer, tmp_path))[1::2]]
    padded = calls[:1] * 5 + calls
    assert hotpotqa.reward(BRIDGE_TASK, padded, "episode")[0] == pytest.approx(1.2)
    assert hotpotqa.reward(BRIDGE_TASK, padded)[0] == pytest.approx(1.5)


def test_bad_options_are_one_line_errors():
    with pytest.raises(ValueError, match=r"task.tools must be search\+open or search"):
        hotpotqa.Options(tools="open")
    with pytest.raises(ValueError, match=r"task.snippet_words must be >= 1"):
        hotpotqa.Options(snippet_words=0)
    with pytest.raises(ValueError, match=r"task.format_reward must be per_call or episode, got 'once'"):
        hotpotqa.Options(format_reward="once")


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

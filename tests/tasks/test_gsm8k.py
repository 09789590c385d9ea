from agent_r1.tasks import calculator, gsm8k
from agent_r1.tasks.gsm8k import demo as gsm8k_demo


def test_splits_are_disjoint_and_answers_parsed():
    train = gsm8k.load(n=200)
    held_out, val = gsm8k.load(split="test"), gsm8k.load(split="val")
    assert len(train) == 200 and 600 < len(held_out) < 900 and 600 < len(val) < 900  # ~10% of 7,473 each
    everything = gsm8k.load() + held_out + val
    assert len({t["question"] for t in everything}) == len(everything) > 7400  # disjoint, nothing lost
    first = train[0]
    assert first["answer"] == 72.0 and first["solution"].endswith("#### 72")


def test_most_training_solutions_become_tool_demonstrations():
    ok = 0
    for task in gsm8k.load(n=100):
        try:
            demo = gsm8k_demo(task["question"], task["solution"])
        except ValueError:
            continue
        ok += 1
        assert demo[-1]["content"].endswith(
            f"<answer>{task['solution'].rsplit('####', 1)[1].strip().replace(',', '')}</answer>"
        )
    assert ok >= 80  # annotations the real calculator disagrees with are skipped, not trained on


def test_reward_matches_the_final_number():
    task = gsm8k.load(n=1)[0]
    assert calculator.reward(task, "so <answer>72</answer>")[0] == 1.0  # gsm8k's env uses the calculator's
    assert calculator.reward(task, "<answer>71</answer>")[0] == 0.0

"""The main job end to end with a tiny random model: eval -> SFT -> RL -> eval, every artefact written."""

import json

from agent_r1.cli import main
from tests.conftest import make_tiny_llama


def test_demo_pipeline_smoke(tmp_path, tokenizer):
    make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id).save_pretrained(
        tmp_path / "tiny"
    )
    tokenizer.save_pretrained(tmp_path / "tiny")
    run = tmp_path / "demo"
    args = [
        "demo", f"run_dir={run}", f"model={tmp_path / 'tiny'}",
        "eval.num_tasks=4", "eval.max_new_tokens=8", "eval.max_turns=2", "eval.task.few_shot=false",
        "sft.task.few_shot=false", "sft.num_examples=4", "sft.epochs=1", "sft.batch_size=2",
        "rl.steps=2", "rl.save_every=1", "rl.task.few_shot=false",
        "rl.rollout.tasks_per_step=2", "rl.rollout.group_size=2",
        "rl.rollout.max_new_tokens=8", "rl.rollout.max_turns=2", "rl.val.every=1", "rl.val.num_tasks=2",
    ]  # fmt: skip
    assert main(args) == 0
    results = json.loads((run / "results.json").read_text())["results"]
    assert set(results) == {"untrained", "sft", "rl"}
    for r in results.values():  # eval cycles ops (1, 2): two tasks of each kind
        assert 0.0 <= r["accuracy"] <= 1.0
        assert (r["accuracy/ops=1"] + r["accuracy/ops=2"]) / 2 == r["accuracy"]
    for name in ("untrained", "sft", "rl"):
        lines = (run / f"eval_{name}.jsonl").read_text().splitlines()
        assert len(lines) == 4 and json.loads(lines[0])["turns"]
    assert (run / "curves.png").stat().st_size > 1000
    assert (run / "rl/policy/config.json").is_file() and (run / "sft/policy/config.json").is_file()
    steps = [json.loads(x) for x in (run / "rl/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [0, 1, 2] and all("val/accuracy" in m for m in steps)
    selected = json.loads((run / "results.json").read_text())["rl_selected"]
    assert selected == json.loads((run / "rl/policy/best.json").read_text())
    assert selected["step"] == max((m for m in steps), key=lambda m: m["val/accuracy"])["step"]
    assert sorted(p.name for p in (run / "rl/trajectories").iterdir()) == [
        "step_000001.jsonl.gz",
        "step_000002.jsonl.gz",
    ]
    assert (run / "rl/plots/curves.png").stat().st_size > 1000
    # a second run keeps the first one instead of overwriting it
    assert main(args) == 0
    assert len(list(tmp_path.glob("demo-*"))) == 1


def test_the_results_table_keeps_every_name_and_value_whole_at_any_width():
    """A log file is an 80-column console (not a TTY): nothing may be cut to `untrain…`; narrower still,
    each model's results come one per line."""
    import io

    from rich.console import Console

    from agent_r1.pipeline import print_results

    m = {"accuracy": 0.016, "accuracy/ops=1": 0.045, "accuracy/ops=2": 0.0, "accuracy/ops=3": 0.0}
    usage = {"tool_calls": 1.0, "format_errors": 0.0, "turns": 2.0}
    results = {"untrained": m | usage, "sft": m | usage | {"accuracy": 0.453}, "rl": m | usage}
    for width in (30, 60, 80, 200):
        out = io.StringIO()
        print_results(Console(file=out, width=width, force_terminal=False), results)
        text = out.getvalue()
        assert "…" not in text and all(len(line) <= width for line in text.splitlines()), (width, text)
        lines = text.splitlines()
        for name in results:  # each model's name whole
            assert f"{name}:" in lines or any(f" {name} │" in line for line in lines), (width, text)
        assert "1.6%" in text and "45.3%" in text and "4.5%" in text, (width, text)
    assert "┃" in out.getvalue()  # wide enough: the table

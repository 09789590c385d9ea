"""`agent-r1 view`: the JSON API, and the page itself in a real headless Chromium."""

import shutil
from dataclasses import replace

import pytest
import torch
from fastapi.testclient import TestClient

from agent_r1.observe.records import step_path, trajectory_records, write_records
from agent_r1.observe.viewer.app import create_app
from agent_r1.types import Termination
from tests.conftest import serving
from tests.observe.test_records import two_turn_trajectory


@pytest.fixture
def run_dir(tmp_path, tokenizer):
    """Two steps; step 2 has one group of 3 samples (rewards 1, 0, 0.5; one ran out of turns) and one of 1."""
    base = two_turn_trajectory(tokenizer, images=True)
    for step in (1, 2):
        trajs = []
        for i, (group, reward, end) in enumerate(
            [("ga", 1.0, "answered"), ("ga", 0.0, "answered"), ("ga", 0.5, "max_turns"), ("gb", 1.0, "answered")]
        ):
            steps = [replace(s) for s in base.steps]
            steps[-1].reward = reward
            trajs.append(
                replace(base, traj_id=f"{group}-{i}", group_id=group, steps=steps, termination=Termination(end))
            )
        n = [len(trajs[0].steps[-1].prompt_ids + trajs[0].steps[-1].response_ids)]
        advs = [[torch.full(n, 1.0 - i)] for i in range(len(trajs))]  # sample 1 gets A=0, 2 gets A<0
        write_records(step_path(tmp_path, step), trajectory_records(trajs, tokenizer, step=step, advantages=advs))
    return tmp_path


def test_api_lists_filters_and_serves_trajectories(run_dir):
    client = TestClient(create_app(run_dir))
    assert client.get("/api/run").json()["steps"] == [1, 2]
    listing = client.get("/api/trajectories", params={"step": 2}).json()
    assert [t["traj_id"] for t in listing["trajectories"]] == ["ga-0", "ga-1", "ga-2", "gb-3"]
    assert listing["terminations"] == ["answered", "max_turns"]

    def only(**query) -> list[str]:
        listing = client.get("/api/trajectories", params={"step": 2, **query}).json()
        return [t["traj_id"] for t in listing["trajectories"]]

    assert only(termination="max_turns") == ["ga-2"]
    assert only(min_reward=0.5) == ["ga-0", "ga-2", "gb-3"]
    assert only(min_reward=0.1, max_reward=0.9) == ["ga-2"]
    record = client.get("/api/trajectory/2/ga-1").json()
    assert record["reward"] == 0.0 and record["rows"][0]["advantages"][0] == 0.0
    assert client.get("/api/trajectory/2/nope").status_code == 404
    assert client.get("/api/trajectories", params={"step": 9}).status_code == 404
    assert "<title>agent-r1" in client.get("/").text


def test_api_reads_a_single_eval_file(tmp_path, tokenizer):
    path = write_records(tmp_path / "eval.jsonl", trajectory_records([two_turn_trajectory(tokenizer)], tokenizer))
    client = TestClient(create_app(path))
    assert client.get("/api/run").json()["steps"] == [0]
    assert client.get("/api/trajectory/0/g1-0").json()["turns"][1]["observation"] == " result: 84"


def test_missing_run_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="no trajectories/step_"):
        create_app(tmp_path)
    with pytest.raises(ValueError, match="no such run directory"):
        create_app(tmp_path / "absent")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture
def served(run_dir):
    with serving(create_app(run_dir)) as url:
        yield url + "/"


@pytest.mark.skipif(chromium() is None, reason="no Chromium on this machine (make test installs it with apt-get)")
def test_page_in_headless_chromium(served, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(served)
        page.wait_for_selector("#rows tr.traj")
        assert page.locator("#step").input_value() == "2"  # opens on the newest step
        assert page.locator("#rows tr.traj").count() == 4

        page.locator("#rows tr.traj").first.click()  # open ga-0 (A = 1 on its trained tokens)
        page.wait_for_selector(".pane .tok.train")
        pane = page.locator(".pane").first
        assert "ga-0" in pane.locator("h2").first.inner_text()
        assert pane.locator(".turn").count() == 2 and "result: 84" in pane.locator(".turn").nth(1).inner_text()
        assert "calculator" in pane.locator(".tool").first.inner_text()
        assert pane.locator(".turn").nth(1).locator("img.picture").count() == 1  # the tool result's picture
        assert pane.locator("img.picture").first.evaluate("e => e.naturalWidth") == 256
        style = "e => [getComputedStyle(e).backgroundColor, getComputedStyle(e).color]"
        trained = pane.locator(".tok.train").first.evaluate(style)
        masked = pane.locator(".tok.ctx").first.evaluate(style)
        assert trained != masked and masked[0] == "rgba(0, 0, 0, 0)"  # masked tokens have no highlight
        assert pane.locator(".tok.train.pos").count() > 0 and pane.locator(".tok.train.neg").count() == 0
        assert "logp" in pane.locator(".tok.train").first.get_attribute("title")

        page.select_option(".pane .compare", "ga-2")  # side by side with another sample of the group
        page.wait_for_function("document.querySelectorAll('.pane').length === 2")
        second = page.locator(".pane").nth(1)
        assert second.get_attribute("data-traj-id") == "ga-2" and second.locator(".tok.train.neg").count() > 0
        page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)

        page.select_option("#termination", "max_turns")  # filters re-query the server
        page.wait_for_function("document.querySelectorAll('#rows tr.traj').length === 1")
        page.fill("#min-reward", "0.9")
        page.select_option("#termination", "")
        page.wait_for_function("document.querySelectorAll('#rows tr.traj').length === 2")
        browser.close()
    assert (tmp_path / "viewer.png").stat().st_size > 10_000


def test_view_command_rejects_a_missing_run_in_one_line(tmp_path, capsys):
    from agent_r1.cli import main

    assert main(["view", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no such run directory" in err
    assert main(["view", str(tmp_path), "port=0"]) == 2
    assert "port must be in 1..65535" in capsys.readouterr().err


@pytest.mark.skipif(chromium() is None, reason="no Chromium on this machine (make test installs it with apt-get)")
async def test_the_page_shows_what_a_managed_context_did(tmp_path, tokenizer):
    """A summarize episode (tests/env/test_context.py's reader): the summary step is labelled, and the turn
    after it says the context restarted from the summary."""
    from playwright.async_api import async_playwright

    from agent_r1.env.context import ContextConfig
    from agent_r1.types import Trajectory
    from tests.env.test_context import episode, reader

    cfg = ContextConfig(strategy="summarize", budget=500, summary_tokens=64)
    _, _, _, steps = await episode(tokenizer, cfg, reader(8, "<summary>fruit0 first.</summary>"))
    traj = Trajectory({"question": "q"}, "g-0", "g", steps=steps, termination=Termination.ANSWERED)
    write_records(step_path(tmp_path, 1), trajectory_records([traj], tokenizer, step=1))
    with serving(create_app(tmp_path)) as url:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            page = await browser.new_page()
            await page.goto(url + "/")
            await page.locator("#rows tr.traj").first.click()
            await page.wait_for_selector(".pane .turn")
            heads = await page.locator(".pane .turn .head").all_inner_texts()
            await browser.close()
    k = next(i for i, h in enumerate(heads) if "summary step" in h)
    assert "context rewritten" not in heads[k]  # the request is appended: it extends the prompt before
    assert "context rewritten (summarize:" in heads[k + 1] and "restarted from the summary" in heads[k + 1]
    assert "summary step" not in heads[k + 1]

"""The gateway's HTTP side, driven by programs written with the OpenAI SDK and by raw requests, with the env
stepped by hand (scripted answers): refusals that name what is wrong, one request in flight, streamed tool
calls, a history re-sent with other JSON whitespace still extending the prompt, tool_choice (`required` and a
named function force a call's opening into the prompt), `n` answers with the program going on from any of them,
a call whose arguments are not JSON sent back, the turn cap and a posted reward."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
from openai import APITimeoutError, BadRequestError, OpenAI

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import CALL_CLOSE, format_tool_call, format_tool_responses, tools_system_prompt
from agent_r1.gateway import ProgramEnv, gateway
from agent_r1.models.grammar import Grammars
from agent_r1.types import Action, Termination
from tests.gateway.sdk_agent import CALCULATOR


def say(tokenizer, text: str, finish: str = "stop") -> Action:
    """A scripted answer: `text` as the ids a model would have sampled (with its end-of-turn id for "eos")."""
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if finish == "eos" else [])
    return Action(ids, [0.0] * len(ids), text, finish)


def ask_once(task, base_url, api_key):
    reply = OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="any-model-name", messages=[{"role": "user", "content": "hi"}]
    )
    return reply.choices[0].message.content


async def test_refusals_name_what_is_wrong_and_one_request_is_in_flight(tokenizer):
    env = ProgramEnv(ask_once, ChatFormat(tokenizer), reward=lambda task, episode, output: float(output.value == "hi!"))
    await env.reset({})  # the program's request is in flight now: the env has not answered it
    url, auth = f"{env.base_url}/chat/completions", {"Authorization": f"Bearer {env.api_key}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with httpx.AsyncClient() as http:
        second = await http.post(url, json=body, headers=auth)
        assert second.status_code == 409 and "in flight" in second.json()["error"]["message"]
        for n in (0, 17):
            refused = await http.post(url, json=body | {"n": n}, headers=auth)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
            assert f"n={n} is out of range" in refused.json()["error"]["message"]
        wrong_key = await http.post(url, json=body, headers={"Authorization": "Bearer nope"})
        assert wrong_key.status_code == 401
        port = gateway().port
        unknown = await http.post(f"http://127.0.0.1:{port}/episodes/no-such-episode/v1/chat/completions", json=body)
        assert unknown.status_code == 404 and "no-such-episode" in unknown.json()["error"]["message"]
        models = await http.get(f"{env.base_url}/models", headers=auth)
        assert models.status_code == 200 and models.json()["data"][0]["id"]
    result = await env.step(say(tokenizer, "hi!", "eos"))
    assert result.done and result.reward == 1.0 and result.info["termination"] == Termination.ANSWERED
    await env.close()
    async with httpx.AsyncClient() as http:  # the episode is over: its routes are gone
        gone = await http.post(url, json=body, headers=auth)
        assert gone.status_code == 404


def streamed_tool_loop(task, base_url, api_key):
    """Streams the first answer (two tool calls), then sends the history back with the calls' arguments
    re-serialised (other whitespace, other key order) and the tool results."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "What are 6 * 7 and 1 + 6?"}]
    stream = client.chat.completions.create(
        model="m", messages=messages, tools=[CALCULATOR], parallel_tool_calls=True, stream=True
    )
    content, calls = "", {}
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            blank = {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}}
            call = calls.setdefault(c.index, blank)
            call["function"]["name"] += c.function.name or ""
            call["function"]["arguments"] += c.function.arguments or ""
    tool_calls = [calls[k] for k in sorted(calls)]
    for c in tool_calls:
        c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), indent=2, sort_keys=True)
    messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
    for c, result in zip(tool_calls, ("42", "7"), strict=True):
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    reply = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    return {"first": [content, tool_calls], "answer": reply.choices[0].message.content}


async def test_streamed_calls_and_a_repeated_history_extend_the_prompt(tokenizer):
    fmt, seen = ChatFormat(tokenizer), {}
    env = ProgramEnv(streamed_tool_loop, fmt, reward=lambda task, episode, output: seen.update(vars(output)) or 0.5)
    first = await env.reset({})
    assert CALL_CLOSE not in env.stop  # parallel_tool_calls=true: the model ends its turn itself
    calls = format_tool_call("calculator", {"expression": "6 * 7"}) + "\n"
    calls += format_tool_call("calculator", {"expression": "1 + 6"})
    act = say(tokenizer, "Two sums.\n" + calls)
    second = await env.step(act)
    assert not second.done and second.info["metrics"] == {
        "gateway/merged_steps": 1.0,
        "gateway/branched_steps": 0.0,
        "gateway/fresh_steps": 0.0,
        "gateway/unseen_steps": 0.0,
    }
    results = [{"role": "user", "content": format_tool_responses(["42", "7"])}]
    assert second.observation.token_ids == first.token_ids + act.token_ids + fmt.continuation(results, False)
    assert CALL_CLOSE in env.stop  # the second request leaves parallel_tool_calls out: one call per turn
    end = await env.step(say(tokenizer, "42 and 7.", "eos"))
    assert end.done and end.reward == 0.5 and end.info["termination"] == Termination.ANSWERED
    await env.close()
    content, tool_calls = seen["value"]["first"]  # what the program assembled from the stream
    assert content == "Two sums.\n" and seen["value"]["answer"] == "42 and 7."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls] == [
        ("calculator", {"expression": "6 * 7"}), ("calculator", {"expression": "1 + 6"}),
    ]  # fmt: skip
    assert seen["exit_code"] == 0 and seen["reward"] is None


def edit_then_ask(task, base_url, api_key):
    """Asks, then sends the history back with its answer edited, then with no tools and tool_choice none."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Hello"}]
    answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": answer + " (edited)"}, {"role": "user", "content": "Again"}]
    client.chat.completions.create(model="m", messages=messages)
    reply = client.chat.completions.create(model="m", messages=messages[:1], tools=[CALCULATOR], tool_choice="none")
    auth = {"Authorization": f"Bearer {api_key}"}
    httpx.post(base_url.removesuffix("/v1") + "/reward", json={"reward": 0.25}, headers=auth).raise_for_status()
    return reply.choices[0].message


async def test_an_edited_history_is_rendered_afresh_and_tool_choice_none_hides_the_tools(tokenizer):
    fmt, seen = ChatFormat(tokenizer), {}
    env = ProgramEnv(edit_then_ask, fmt, reward=lambda task, episode, output: seen.update(vars(output)) or 1.0)
    await env.reset({})
    edited = await env.step(say(tokenizer, "Hi there.", "eos"))
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there. (edited)"}]
    assert edited.observation.token_ids == fmt.initial([*history, {"role": "user", "content": "Again"}])
    # a branch of the episode's tree: it shares the first message with the first request
    assert edited.info["metrics"] == {
        "gateway/merged_steps": 0.0,
        "gateway/branched_steps": 1.0,
        "gateway/fresh_steps": 0.0,
        "gateway/unseen_steps": 0.0,
    }
    hidden = await env.step(say(tokenizer, "Fine.", "eos"))
    # tool_choice none: the tools are not in the prompt, and a call the model writes stays text
    assert hidden.observation.token_ids == fmt.initial([{"role": "user", "content": "Hello"}])
    assert CALL_CLOSE not in env.stop
    call = format_tool_call("calculator", {"expression": "6 * 7"})
    end = await env.step(say(tokenizer, call, "eos"))
    assert end.done and end.reward == 1.0
    await env.close()
    assert seen["value"].content == call and not seen["value"].tool_calls
    assert seen["reward"] == 0.25  # what the program posted, handed to the reward function


def forced_calls(task, base_url, api_key):
    """Refused tool_choices first (each a 400 it reads), then "required", then a named function, each answer's
    call run and sent back; returns the errors and the calls it got."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    errors, calls = [], []
    for bad in ({"type": "function", "function": {"name": "search"}}, "required", "always"):
        try:
            tools = [CALCULATOR] if bad != "required" else None  # "required" with no tools
            client.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice=bad)
        except BadRequestError as exc:
            errors.append(exc.body["message"])
    for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
        message = (
            client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], tool_choice=choice)
            .choices[0]
            .message
        )
        calls.append([(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls])
        messages += [message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls]
    client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    return errors, calls


async def test_a_forcing_tool_choice_opens_the_call_in_the_prompt_and_the_policy_samples_the_rest(tokenizer):
    fmt, seen = ChatFormat(tokenizer), {}
    env = ProgramEnv(forced_calls, fmt, reward=lambda task, episode, output: seen.update(vars(output)) or 1.0)
    first = await env.reset({})  # the three refused requests were answered with a 400 and waited past
    tools = [{"role": "system", "content": tools_system_prompt([CALCULATOR])}]
    question = fmt.initial([*tools, {"role": "user", "content": "What is 6 * 7?"}])
    opening = tokenizer.encode("<tool_call>\n", add_special_tokens=False)
    assert first.token_ids == question + opening  # "required": the call is open, the policy names the tool
    rest = '{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    assert tokenizer.decode(opening) + rest == format_tool_call("calculator", {"expression": "6 * 7"})
    grammars = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    grammars.masks(env.grammar, tokenizer.encode(rest, add_special_tokens=False))  # the rest is what it allows
    with pytest.raises(ValueError, match="not allowed"):  # a call to no tool of the request's
        grammars.masks(env.grammar, tokenizer.encode('{"name": "search", "arguments": {}}', add_special_tokens=False))
    act = say(tokenizer, rest)
    second = await env.step(act)
    assert second.info["tool_calls"] == 1 and second.info["metrics"]["gateway/merged_steps"] == 1.0
    results = [{"role": "user", "content": format_tool_responses(["42"])}]
    context = first.token_ids + act.token_ids + fmt.continuation(results, False)  # the opening stays, as shown
    named = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments":', add_special_tokens=False)
    assert second.observation.token_ids == context + named  # a named function: only its arguments are sampled
    echo = ' {"type": "object", "properties": {"expression": {"type": "string"}}}}'  # the schema written back
    with pytest.raises(ValueError, match="not allowed"):
        grammars.masks(env.grammar, tokenizer.encode(echo, add_special_tokens=False))
    act2 = say(tokenizer, ' {"expression": "42 * 1"}}\n</tool_call>')
    grammars.masks(env.grammar, act2.token_ids)
    third = await env.step(act2)
    assert third.info["metrics"]["gateway/merged_steps"] == 1.0
    assert third.observation.token_ids == context + named + act2.token_ids + fmt.continuation(results, False)
    assert env.grammar is None  # the last request forces nothing: free text
    assert (await env.step(say(tokenizer, "42", "eos"))).done
    await env.close()
    errors, calls = seen["value"]
    assert "'search', which is not among the request's tools ['calculator']" in errors[0]
    assert "forces a tool call, but the request lists no tools" in errors[1]
    assert "tool_choice='always' is not one of" in errors[2]
    assert calls == [[("calculator", {"expression": "6 * 7"})], [("calculator", {"expression": "42 * 1"})]]


def two_answers_then_the_second(task, base_url, api_key):
    """Asks for n=2 (streamed, with the usage), goes on from the second answer, then asks again."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Pick one"}]
    stream = client.chat.completions.create(
        model="m", messages=messages, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts, usage = {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    messages += [{"role": "assistant", "content": texts[1]}, {"role": "user", "content": "Why?"}]
    return texts, usage.completion_tokens, client.chat.completions.create(model="m", messages=messages)


async def test_n_answers_and_the_program_goes_on_from_the_one_it_took(tokenizer):
    fmt, seen = ChatFormat(tokenizer), {}
    env = ProgramEnv(two_answers_then_the_second, fmt, reward=lambda task, ep, output: seen.update(vars(output)) or 1.0)
    first = await env.reset({})
    assert env.samples == 2
    a, b = say(tokenizer, "Red.", "eos"), say(tokenizer, "Blue.", "eos")
    a.alternatives = [b]
    second = await env.step(a)
    assert second.info["choice"] == 1 and second.info["metrics"]["gateway/merged_steps"] == 1.0
    why = fmt.continuation([{"role": "user", "content": "Why?"}], after_eos=True)
    assert second.observation.token_ids == first.token_ids + b.token_ids + why  # extends the answer it took
    assert env.samples == 1
    assert (await env.step(say(tokenizer, "Calm.", "eos"))).done
    await env.close()
    texts, completion_tokens, last = seen["value"]
    assert texts == {0: "Red.", 1: "Blue."} and completion_tokens == len(a.token_ids) + len(b.token_ids)
    assert last.choices[0].message.content == "Calm."


def send_the_call_back(task, base_url, api_key):
    """Asks, then sends the answer back as it came (whatever its call's arguments) with a tool result."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    message = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR]).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    result = "Error: the arguments are not an object"
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result})
    client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
    return message.tool_calls[0].function.arguments


async def test_a_call_whose_arguments_are_not_json_can_be_sent_back(tokenizer):
    """The model wrote "arguments": "6 * 7": the program gets valid JSON (a JSON string) and its history with
    the call is accepted, merged, instead of a 400 that ended the episode as an error."""
    fmt, seen = ChatFormat(tokenizer), {}
    env = ProgramEnv(send_the_call_back, fmt, reward=lambda task, episode, output: seen.update(vars(output)) or 0.0)
    first = await env.reset({})
    act = say(tokenizer, format_tool_call("calculator", "6 * 7"))
    second = await env.step(act)
    assert not second.done and second.info["metrics"] == {
        "gateway/merged_steps": 1.0,
        "gateway/branched_steps": 0.0,
        "gateway/fresh_steps": 0.0,
        "gateway/unseen_steps": 0.0,
    }
    results = [{"role": "user", "content": format_tool_responses(["Error: the arguments are not an object"])}]
    assert second.observation.token_ids == first.token_ids + act.token_ids + fmt.continuation(results, False)
    end = await env.step(say(tokenizer, "Sorry.", "eos"))
    assert end.done and end.info["termination"] == Termination.ANSWERED
    await env.close()
    assert json.loads(seen["value"]) == "6 * 7"


def ask_forever(task, base_url, api_key):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "go"}]
    while True:
        answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]


async def test_the_turn_budget_ends_the_episode(tokenizer):
    fmt = ChatFormat(tokenizer)
    env = ProgramEnv(ask_forever, fmt, max_turns=2)
    first = await env.reset({})
    act = say(tokenizer, "one", "eos")
    second = await env.step(act)
    # the model sampled its end of turn: the delta does not close the turn a second time
    more = fmt.continuation([{"role": "user", "content": "more"}], after_eos=True)
    assert second.observation.token_ids == first.token_ids + act.token_ids + more
    assert more[0] != tokenizer.eos_token_id and not second.done
    end = await env.step(say(tokenizer, "two", "eos"))
    assert end.done and end.reward == 0.0 and end.info["termination"] == Termination.MAX_TURNS
    await env.close()


def post_rewards_then_ask(task, base_url, api_key):
    """Posts a reward past the episode's bound (refused, with the bound named), one within it, then asks."""
    auth, url = {"Authorization": f"Bearer {api_key}"}, base_url.removesuffix("/v1") + "/reward"
    refused = httpx.post(url, json={"reward": 1e300}, headers=auth)
    kept = httpx.post(url, json={"reward": -2.5}, headers=auth)
    ask_once(task, base_url, api_key)
    return refused.status_code, refused.json()["error"], kept.status_code


async def test_a_posted_reward_outside_the_tasks_bound_is_refused_naming_it(tokenizer):
    """An agent program is untrusted: a finite 1e300 would otherwise swamp every advantage of its batch."""
    seen = {}
    env = ProgramEnv(
        post_rewards_then_ask, ChatFormat(tokenizer), max_reward=10.0,
        reward=lambda task, episode, output: seen.update(vars(output)) or output.reward,
    )  # fmt: skip
    await env.reset({})
    end = await env.step(say(tokenizer, "Hi.", "eos"))
    await env.close()
    assert end.done and end.reward == -2.5  # the posted reward within the bound; the refused one never kept
    status, error, kept = seen["value"]
    assert (status, kept) == (400, 200) and error["param"] == "reward"
    assert error["message"] == "reward 1e+300 is outside [-10, 10] (task.max_reward)"


def test_a_program_inherits_only_what_it_needs_of_the_trainers_environment(monkeypatch):
    """Tokens and credentials in the trainer's environment never reach a program that may run model-written
    code; the task passes more by name."""
    from agent_r1.gateway.env import program_env

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    env = program_env()
    assert "HF_TOKEN" not in env and "WANDB_API_KEY" not in env
    assert env["PATH"] and env["LC_ALL"] == "C.UTF-8"
    assert program_env(["HF_TOKEN"])["HF_TOKEN"] == "hf_secret" and "WANDB_API_KEY" not in program_env(["HF_TOKEN"])


async def test_a_request_renders_off_the_event_loop_so_other_episodes_go_on(tokenizer, monkeypatch):
    """Rendering and tokenizing a long request takes time: on the rollout's event loop it would stall every
    other episode meanwhile. A render slowed to 0.5 s (a blocking sleep) leaves the loop ticking."""
    import asyncio
    import time

    from agent_r1.gateway import env as env_module

    observe = env_module.ProgramEnv._observe

    def slow_observe(self, call):
        time.sleep(0.5)
        return observe(self, call)

    monkeypatch.setattr(env_module.ProgramEnv, "_observe", slow_observe)
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    env = ProgramEnv(ask_once, ChatFormat(tokenizer))
    try:
        obs = await env.reset({})
    finally:
        ticker.cancel()
    await env.step(say(tokenizer, "Hi.", "eos"))
    await env.close()
    assert obs.token_ids and ticks >= 20  # ~50 ticks while it rendered; none if it had blocked the loop


def give_up_then_retry(task, base_url, api_key):
    """The first request times out on the client's side (it goes away); the retry waits for its answer."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Hello"}]
    with contextlib.suppress(APITimeoutError):  # this program gives up and asks again
        client.with_options(timeout=0.5).chat.completions.create(model="m", messages=messages)
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.content


async def test_an_answer_whose_client_went_away_is_marked_unseen_and_not_trained(tokenizer):
    import asyncio

    from agent_r1.rollout.merge import merge_trajectory
    from agent_r1.types import Step, Trajectory

    env = ProgramEnv(give_up_then_retry, ChatFormat(tokenizer))
    first = await env.reset({})
    await asyncio.sleep(1.5)  # the policy is slow: the program has given up on this request by now
    late = say(tokenizer, "Too late.", "eos")
    retried = await env.step(late)  # answered into the void; the program's retry is the next request
    assert retried.info["unseen"] and retried.info["metrics"]["gateway/unseen_steps"] == 1.0
    assert retried.observation.token_ids == first.token_ids  # the retry: the same prompt, a branch
    answer = say(tokenizer, "Hi!", "eos")
    end = await env.step(answer)
    assert end.done and "unseen" not in end.info
    await env.close()
    steps = [
        Step(first.token_ids, late.token_ids, late.logprobs, info=retried.info, index=0),
        Step(retried.observation.token_ids, answer.token_ids, answer.logprobs, info=end.info, index=1),
    ]
    unseen, seen = merge_trajectory(Trajectory({}, "t", "g", steps))
    assert unseen.loss_mask == [0] * len(unseen.input_ids)  # kept as context, never trained
    assert seen.loss_mask == [0] * len(first.token_ids) + [1] * len(answer.token_ids)

"""The agentic tasks on the tiny agent model: multi-turn `guess_number_told` and tool-calling `locker`.

What a full learning run shows is in docs/environments.md and docs/experiments/agentic.md (minutes per
run); these check, in seconds, what makes training on such episodes right: the replies of every turn are
trained and nothing else is (hints and tool results are context), a tool's result reaches the next prompt
token-exactly, one episode reward reaches every turn's tokens, and `molt-train` runs both tasks end to end.
"""

import subprocess
import sys

import pytest
from conftest import run
from transformers import AutoTokenizer

from environments.guess_number import GuessNumber, GuessNumberNoFeedback
from environments.locker import LETTERS, BlankLocker, Locker
from molt_agents.chat_template import render_text
from molt_agents.engines import SamplingParams
from molt_agents.runner import run_episode
from molt_agents.tool_calls import parse_reply
from molt_env import check
from molt_train.batch import assemble
from molt_train.config import AlgoConfig
from molt_train.group import Group


@pytest.fixture(scope="module")
def agent_dir():
    from molt_agents.tiny import tiny_model

    return tiny_model("agent")


def _play(engine, tokenizer, env_class, episodes: int, seed: int = 0):
    async def play():
        import asyncio

        return await asyncio.gather(*(
            run_episode(env_class(), engine, tokenizer, SamplingParams(max_tokens=32, seed=seed + i),
                        max_total_tokens=1024, seed=seed + i, rollout_id=f"r{i}", group_id="g")
            for i in range(episodes)))

    return [trajectory for episode in run(play()) for trajectory in episode]


def _sampled_runs(trajectory) -> list[tuple[int, int]]:
    """[start, end) of every run of trained tokens: one per turn."""
    runs, start = [], None
    for i, m in enumerate(trajectory.mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _conversation(tokenizer, trajectory):
    """The chat messages of an episode, rebuilt from its token ids: the prompt is what precedes the first
    reply, every reply is a run of sampled tokens, every observation the context between two runs."""
    runs = _sampled_runs(trajectory)
    replies = [tokenizer.decode(trajectory.token_ids[a:b], skip_special_tokens=True) for a, b in runs]
    return runs, replies


def test_multi_turn_hints_are_context_and_the_reward_reaches_every_turn(vllm_engines, agent_dir):
    tokenizer = AutoTokenizer.from_pretrained(agent_dir)
    engine = vllm_engines.get(agent_dir)
    trajectories = _play(engine, tokenizer, lambda: GuessNumber(hint="told"), 16)
    for t in trajectories:
        check(t)
    # One segment per episode: its turns' replies are the sampled runs, and each is one reply.
    assert len({t.rollout_id for t in trajectories}) == len(trajectories) == 16
    multi = [t for t in trajectories if t.info["turns"] > 1]
    assert multi, "no episode took a second guess"
    for t in multi:
        runs, replies = _conversation(tokenizer, t)
        assert len(runs) == t.info["turns"]
        # Between two replies lies only the hint, as the chat template writes a user turn, and it carries
        # the number: context, not trained.
        secret = t.info["reset_info"]["secret"]
        for (_, end), (start, _) in zip(runs, runs[1:]):
            between = tokenizer.decode(t.token_ids[end:start])
            # (ends with: a reply cut off by max_tokens leaves its end-of-turn token to the context)
            assert between.endswith(f"\n<|im_start|>user\nNo: it is {secret}. Guess again.<|im_end|>\n"
                                    "<|im_start|>assistant\n") or "No number there" in between, between
    # The batch: every turn's tokens carry the episode's advantage (the reward is given at the last turn).
    items, stats = assemble([Group(0, trajectories, [])], 0,
                            AlgoConfig(estimator="grpo", filter_zero_variance=False))
    assert stats["rollouts/trained"] == 16
    by_tokens = {tuple(item.token_ids): item for item in items}
    rewards = {t.reward for t in trajectories}
    assert len(rewards) > 1, "all 16 episodes got the same reward; nothing to check"
    mean = sum(x.reward for x in trajectories) / len(trajectories)
    for t in multi:
        item = by_tokens[tuple(t.token_ids)]
        assert item.mask == t.mask and len(_sampled_runs(t)) == t.info["turns"]
        # The advantage is the episode's own, on every turn: its sign is that of the reward's difference
        # from the group's mean.
        assert (item.advantage > 0) == (t.reward > mean) and (item.advantage == 0) == (t.reward == mean)


def test_tool_results_reach_the_next_prompt_token_exactly(vllm_engines, agent_dir):
    tokenizer = AutoTokenizer.from_pretrained(agent_dir)
    engine = vllm_engines.get(agent_dir)
    trajectories = _play(engine, tokenizer, Locker, 48)
    called = [t for t in trajectories if t.info["turns"] > 1]
    assert called, "no episode called the tool"
    for t in called:
        check(t)
        runs, replies = _conversation(tokenizer, t)
        env = Locker()
        prompt, _ = env.reset(seed=int(t.rollout_id[1:]))
        messages = [{"role": "user", "content": prompt}]
        for reply in replies[:-1]:
            assert parse_reply(reply)[1], f"a turn that is not the last made no tool call: {reply!r}"
            observation, *_ = env.step(reply)
            messages += [{"role": "assistant", "content": reply}, *observation]
            # The tool's reply: a digit (the locker's or another's) or an error naming the mistake.
            assert observation[0]["role"] == "tool"
        # The context before the last reply is the conversation rendered, token for token, right after the
        # sampled ids of the previous reply: what the tool returned, as the policy will read it.
        rendered = render_text(tokenizer, messages, Locker.tools)
        last_start = runs[-1][0]
        assert tokenizer.decode(t.token_ids[:last_start]) == rendered
        previous_end = runs[-2][1]
        delta = rendered[len(tokenizer.decode(t.token_ids[:previous_end])):]
        assert t.token_ids[previous_end:last_start] == tokenizer.encode(delta, add_special_tokens=False)
        assert all(m == 0 for m in t.mask[previous_end:last_start])  # tool tokens are not trained


class Recording:
    """The real engine, with the seed of every request it gets written down."""

    def __init__(self, engine):
        self.engine, self.seeds = engine, []

    async def generate(self, prompt, params, **kwargs):
        self.seeds.append(params.seed)
        return await self.engine.generate(prompt, params, **kwargs)


def test_every_turn_of_a_seeded_episode_samples_from_its_own_stream(vllm_engines, agent_dir):
    """One seed for every turn would draw the same random numbers on each: a policy that reads nothing
    would repeat its first guess four times. The runner and the loopback move the seed on per turn."""
    import openai

    from molt_agents.engines.base import turn_seed
    from molt_agents.loopback import Loopback

    tokenizer = AutoTokenizer.from_pretrained(agent_dir)
    engine = Recording(vllm_engines.get(agent_dir))
    (trajectory,) = run(run_episode(GuessNumber(), engine, tokenizer, SamplingParams(max_tokens=8, seed=5),
                                    max_total_tokens=512, seed=3))
    turns = trajectory.info["turns"]
    assert turns > 1 and engine.seeds == [turn_seed(5, turn) for turn in range(turns)]
    assert len(set(engine.seeds)) == turns and turn_seed(5, 0) == 5 and turn_seed(None, 2) is None

    engine.seeds.clear()
    server = Loopback(engine, tokenizer, max_model_len=512).start()
    try:
        session = server.open_session(defaults={"seed": 7, "max_tokens": 4})
        client = openai.OpenAI(base_url=server.base_url(session.id), api_key=server.api_key, max_retries=0)
        messages = [{"role": "user", "content": "Guess a digit."}]
        for _ in range(3):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        client.chat.completions.create(model="policy", messages=messages, seed=11)  # the client's own seed
    finally:
        server.stop()
    assert engine.seeds == [7, turn_seed(7, 1), turn_seed(7, 2), 11]


@pytest.mark.parametrize("env_class,blanked", [(Locker, False), (BlankLocker, True)])
def test_locker_tool_and_its_blank_control(env_class, blanked):
    env = env_class()
    prompt, info = env.reset(seed=5)
    assert prompt == f"What is the digit in locker {LETTERS[info['locker'] - 1]}?"
    call = '<tool_call>\n{"name": "lookup", "arguments": {"id": %d}}\n</tool_call>'
    observation, reward, terminated, truncated, facts = env.step(call % info["locker"])
    assert observation[0]["content"] == ("" if blanked else f"It holds {info['answer']}.")
    assert not (terminated or truncated)
    assert facts == {"tool_calls": 1, "called": True, "right_id": True, "read_result": False}
    wrong = env.step(call % 42)[0]
    assert wrong[0]["content"].startswith("[error] arguments must be")
    assert env.step('<tool_call>\n{"name": "open", "arguments": {}}\n</tool_call>')[3]  # the turn budget
    env.reset(seed=5)
    assert env.step(f" {info['answer']}.")[1:3] == (0.0, True)  # right, but a guess: no locker opened
    env.reset(seed=5)
    env.step(call % (info["locker"] % 9 + 1))  # another locker opened: the right digit is still a guess
    assert env.step(str(info["answer"]))[1:3] == (0.0, True)
    env.reset(seed=5)
    env.step(call % info["locker"])
    assert env.step(f" {info['answer']}.")[1:3] == (1.0, True)
    env.reset(seed=5)
    env.step(call % info["locker"])
    assert env.step(str((info["answer"] + 1) % 10))[1:3] == (0.0, True)
    env.reset(seed=5)  # the digit must open the answer: not inside a broken call, nor after words
    assert env.step('okup", "arguments": {"slot": %d}}' % info["answer"])[1:3] == (0.0, True)
    env.reset(seed=5)
    assert env.step(f"It is {info['answer']}.")[1:3] == (0.0, True)


def test_locker_facts_say_which_locker_was_asked_and_what_was_read():
    env = Locker()
    _, info = env.reset(seed=5)
    call = '<tool_call>\n{"name": "lookup", "arguments": {"id": %d}}\n</tool_call>'
    other = info["locker"] % 9 + 1
    env.step(call % other)
    shown = env.digits[other - 1]
    *_, facts = env.step(f"{shown}")  # answered what the tool showed, for the wrong locker
    assert facts == {"tool_calls": 1, "called": True, "right_id": False, "read_result": True}
    env.reset(seed=5)
    env.step('<tool_call>\n{"name": "lookup", "arguments": {"id": "A"}}\n</tool_call>')  # malformed: no digit
    env.step(call % info["locker"])  # the second call is right, but the first call counts for right_id
    *_, facts = env.step("x")
    assert facts == {"tool_calls": 2, "called": True, "right_id": False, "read_result": False}
    env.reset(seed=5)
    assert env.step("5")[4] == {"tool_calls": 0, "called": False, "right_id": False,
                                "read_result": False}
    blank = BlankLocker()
    blank.reset(seed=5)
    blank.step(call % info["locker"])
    assert blank.step(str(info["answer"]))[4]["read_result"] is False  # nothing was shown to read
    with pytest.raises(ValueError, match="lockers=27: choose 1 to 26"):
        Locker(lockers=27)


def test_agent_warm_start_teaches_tool_use_on_no_task_of_its_own():
    """The warm start's conversations call a tool with an argument from the user's message and answer
    from what the tool returned, but never on a bundled tool task's question, tool or tool reply."""
    import random
    import re

    from environments.locker import LOOKUP
    from environments.python_tool import PYTHON_TOOL
    from molt_agents.tiny.tokenizer import _corpus_lines
    from molt_agents.tiny.warm_start import _agent_conversation

    prompts = [line for line in _corpus_lines(1, 4000) if "\n" not in line and not any(c.isdigit() for c in line)]
    rng = random.Random(0)
    conversations = [_agent_conversation(rng, prompts[:1000]) for _ in range(3000)]
    descriptions = {tool["function"]["description"] for _, tools in conversations for tool in tools or []}
    assert not descriptions & {LOOKUP["function"]["description"], PYTHON_TOOL["function"]["description"]}
    texts = [str(m.get("content", "")) for messages, _ in conversations for m in messages]
    for text in texts:
        assert not re.search(r"locker|What is the digit in|It holds \d", text), text
    copied = read = 0
    for messages, tools in conversations:
        calls = [m for m in messages if m.get("tool_calls")]
        if not calls:
            continue
        argument = next(iter(calls[0]["tool_calls"][0]["function"]["arguments"].values()))
        asked = re.findall(r"\d", messages[0]["content"])
        copied += asked == [str(argument)]
        result = re.findall(r"\d", messages[-2]["content"])
        read += result == [messages[-1]["content"]]
    called = sum(any(m.get("tool_calls") for m in messages) for messages, _ in conversations)
    assert called > 1000 and read == called  # every answer after a call is the digit the tool returned
    assert 0.6 < copied / called < 0.9  # mostly the user's digit; a digit of its own when there is none


def test_env_stats_average_the_numeric_facts_of_each_episode():
    from molt_env.trajectory import Trajectory
    from molt_train.batch import env_stats

    def rollout(info):
        return [Trajectory(token_ids=[1, 2], logprobs=[0.0, -1.0], mask=[0, 1], versions=[0, 0], reward=0.0,
                           info=info)]

    stats = env_stats([rollout({"called": True, "tool_calls": 2, "note": "x", "step_rewards": [0.0]}),
                       rollout({"called": False, "tool_calls": 1, "right_id": 1.0}),
                       rollout({})])
    assert stats == {"env/called": 0.5, "env/right_id": 1.0, "env/tool_calls": 1.5}


def test_guess_number_hints_and_the_control_that_hides_them():
    for env, hints in [(GuessNumber(), lambda secret: {"higher", "lower"}),
                       (GuessNumber(hint="told"), lambda secret: {f"No: it is {secret}. Guess again."}),
                       (GuessNumberNoFeedback(), lambda secret: {"Guess again."})]:
        _, info = env.reset(seed=1)
        guess = (info["secret"] + 5) % 10
        assert env.step(str(guess))[0] in hints(info["secret"])
    with pytest.raises(ValueError, match="hint='loud': choose one of direction, told, none"):
        GuessNumber(hint="loud")


@pytest.mark.parametrize("env,agent", [("guess_number_told", None), ("locker", None),
                                       ("locker", "environments.agents:LockerAgent")])
def test_molt_train_runs_the_agentic_task(tmp_path, ray_address, env, agent):
    """Both tasks on the env runner, and the tool task through the loopback with a stock openai-client
    agent that runs the tool calls itself."""
    import json

    out = tmp_path / env
    result = subprocess.run(
        [sys.executable, "-m", "molt_train.cli", "--config", f"recipes/{env}.yaml", "--out", str(out),
         "--ray.address", ray_address, "--log.tensorboard", "false", "--steps", "2",
         "--rollout.groups_per_step", "4", "--rollout.group_size", "4", "--train.async_queue_size", "0",
         "--engine.data_parallel_size", "1", "--algo.filter_zero_variance", "false",  # every group trains
         *(["--agent", agent] if agent else [])],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["episodes/failed"] == 0 and r["tokens/trained"] > 0 for r in rows)
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows)  # every turn's tokens are the engine's
    if env == "locker":  # the environment's own facts, through the runner and through the agent alike
        for row in rows:
            assert {"env/called", "env/right_id", "env/read_result", "env/tool_calls"} <= set(row)
            assert all(0 <= row[f"env/{key}"] <= 1 for key in ("called", "right_id", "read_result"))
            assert ("env/turns" in row) == (agent is None)  # the runner counts turns; this agent does not
    assert (out / "plots" / "metrics.png").exists()

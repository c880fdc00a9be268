"""TRL's side of the agentic benchmark: GRPO on the locker task with GRPOTrainer's own tool calling.

Runs in bench/.venv-trl (bench/setup_trl.sh: TRL 1.16, no Molt):

    bench/.venv-trl/bin/python bench/trl_agentic.py --model DIR --latency 100ms --seed 0 --steps 300 --out trl.jsonl

The task is bench/locker_task.py's, through TRL's `environment_factory`: one
`LockerEnv` per rollout, reset with its dataset row (the episode's digits and
asked locker), whose public method `lookup` is the tool. TRL parses each
reply's tool calls, runs them, appends the results and generates again, up to
`max_tool_calling_iterations` = MAX_TURNS - 1 times, so at most MAX_TURNS
replies, as Molt's Locker. The tool is `async` and sleeps `--latency`: TRL
awaits one sample's calls together and the samples one after the other
(GRPOTrainer._tool_call_loop), which is the cost this benchmark measures.

Two settings that TRL does not make by itself for Molt's tiny template
(docs/experiments/agentic-bench.md): the tokenizer's `response_template` is
TRL's `qwen3_template` (its automatic `add_response_schema` does not know the
template and raises), and the prompt's tools are rendered from Molt's `LOOKUP`
schema (TRL would render the method's docstring, a longer schema than the
model's warm start saw).

The run is bench/trl_run.py's (`grpo_config`: group size 8 x 16 groups, GRPO,
no KL, clip 0.2, fp32, constant lr without warmup) with --lr, 32 new tokens
per reply and a whole episode's completion within Molt's 1024-token window.
Each JSON line is trl_run.py's, plus `tool_calls`, TRL's tools/call_frequency
(tool calls per rollout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer
from trl.chat_template_utils import parse_response, qwen3_template

sys.path.insert(0, str(Path(__file__).resolve().parent))
import locker_task  # noqa: E402
import workload  # noqa: E402
from trl_run import StepLog, TimedGRPOTrainer, grpo_config, train  # noqa: E402

MAX_TOKENS = 32  # new tokens per reply (Molt's --rollout.max_tokens)
MAX_TOTAL_TOKENS = 1024  # a whole episode, prompt included (Molt's --rollout.max_total_tokens)

LATENCY = 0.0  # seconds a tool call waits; set from --latency


class LockerEnv:
    """One rollout's locker (TRL makes one per row of the batch). Public methods are TRL's tools, so the
    helpers' names start with an underscore."""

    def reset(self, digits, locker, **row):
        self._episode = locker_task.LockerEpisode(digits, locker)
        return None  # keep the dataset's prompt

    async def lookup(self, id: int) -> str:
        """The digit inside a locker; id is its letter's place in the alphabet (A is one, B is two...).

        Args:
            id: the locker's number.
        """
        if LATENCY:
            await asyncio.sleep(LATENCY)
        return self._episode.call("lookup", json.dumps({"id": id}))


def locker_reward(completions, environments, **kwargs) -> list[float]:
    """The episode's reward: its last message must be an answer (an assistant message without tool calls;
    a rollout that ends on calls ran out of turns or tokens and scores 0, as a truncated Molt episode)."""
    rewards = []
    for completion, environment in zip(completions, environments):
        final = completion[-1]
        answered = final["role"] == "assistant" and not final.get("tool_calls")
        rewards.append(environment._episode.reward(final.get("content") or "") if answered else 0.0)
    return rewards


def dataset(seed: int, groups: int) -> Dataset:
    """Prompt groups 0 .. groups-1: the prompt and the episode (bench/locker_task.py's)."""
    rows = []
    for group in range(groups):
        digits, locker = locker_task.episode(seed, group)
        rows.append({"prompt": [{"role": "user", "content": locker_task.prompt(locker)}], "digits": digits,
                     "locker": locker, "group": group})
    return Dataset.from_list(rows)


class AgenticGRPOTrainer(TimedGRPOTrainer):
    """Renders every prompt's tools from `locker_task.LOOKUP`, Molt's exact schema; TRL parses the replies
    with the tool methods' own schema (the same name and argument)."""

    def _tokenize_prompts(self, prompts):
        tools, self._env_tools = self._env_tools, {name: [locker_task.LOOKUP] for name in self._env_tools}
        try:
            return super()._tokenize_prompts(prompts)
        finally:
            self._env_tools = tools


def check_parser(tokenizer, tools) -> None:
    """TRL must parse the tiny model's tool calls: with a wrong parser every call would quietly become the
    reply's text, and no tool would ever run."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": locker_task.prompt(3)}],
                                           tools=[locker_task.LOOKUP], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    reply = tokenizer.encode('<tool_call>\n{"name": "lookup", "arguments": {"id": 3}}\n</tool_call><|im_end|>',
                             add_special_tokens=False)
    parsed = parse_response(tokenizer, reply, prefix=prompt, tools=tools)
    if [call["function"] for call in parsed.get("tool_calls") or []] != [{"name": "lookup", "arguments": {"id": 3}}]:
        sys.exit(f"trl_agentic: TRL's parser read a tool call as {parsed}: set the tokenizer's response_template")


class AgenticStepLog(StepLog):
    LOGGED = {"tool_calls": "tools/call_frequency"}


def main() -> None:
    global LATENCY
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (tiny:agent's)")
    parser.add_argument("--latency", required=True, choices=sorted(locker_task.LATENCIES),
                        help="how long a reply's tool calls wait")
    parser.add_argument("--seed", type=int, default=0, help="seed of the episodes, sampling and initialisation")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--lr", type=float, required=True, help="constant learning rate")
    parser.add_argument("--out", required=True, type=Path, help="JSON lines, one per optimizer step")
    args = parser.parse_args()
    LATENCY = locker_task.LATENCIES[args.latency]

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left", truncation_side="left")
    tokenizer.response_template = qwen3_template
    prompt_tokens = len(tokenizer.apply_chat_template(
        [{"role": "user", "content": locker_task.prompt(1)}], tools=[locker_task.LOOKUP],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    config = grpo_config(args.out, args.seed, args.steps, learning_rate=args.lr,
                         max_completion_length=MAX_TOTAL_TOKENS - prompt_tokens,
                         generation_kwargs={"max_new_tokens": MAX_TOKENS},
                         max_tool_calling_iterations=locker_task.MAX_TURNS - 1)
    trainer = AgenticGRPOTrainer(model=args.model, processing_class=tokenizer, reward_funcs=locker_reward,
                                 args=config, train_dataset=dataset(args.seed, args.steps * workload.GROUPS_PER_STEP),
                                 environment_factory=LockerEnv)
    check_parser(tokenizer, trainer._env_tools[None])
    train(trainer, args.out, AgenticStepLog)


if __name__ == "__main__":
    main()

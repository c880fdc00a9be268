"""`judged_digit`: the `digit` task graded by an LLM judge instead of a rule.

"Repeat the digit 7."; the reply goes to a `molt_env.Judge` with a rubric
that asks whether it does what the task asks, on a scale of 0 to 9; the
reward is the judge's score divided by 9. The judge's endpoint comes from
MOLT_JUDGE_URL (and MOLT_JUDGE_MODEL): a hosted API, or a frozen model
served by `molt-serve`. An episode whose judge fails is dropped, not scored 0.
The episode's info keeps the rule's verdict (`right`), so a run shows how far
the judge's reward follows the task.
"""

from __future__ import annotations

from environments.digit import Digit, first_char
from molt_env import Judge

RUBRIC = ("A task and a reply to it.\nTask: {task}\nReply: {reply}\n"
          "How well does the reply do what the task asks, from 0 (not at all) to 9 (exactly)? "
          "Answer with one digit.")


class JudgedDigit(Digit):
    judge = Judge(RUBRIC, scale=9)

    async def astep(self, action: str):
        score = await self.judge(task=f"Repeat the digit {self.digit}.", reply=action)
        return "", score, True, False, {"right": first_char(action) == self.digit, "judge": score}

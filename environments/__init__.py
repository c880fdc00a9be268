"""Bundled environments, registered on import under a short name and as `molt/<Name>-v0`.

Each is a small task built on molt_env and molt_agents only.
"""

from molt_env import register, register_family

DEFAULT_ENV = "digit"

register("digit", "environments.digit:Digit")
register("arithmetic", "environments.arithmetic:Arithmetic")
register("countdown", "environments.countdown:Countdown")
register("guess_number", "environments.guess_number:GuessNumber")
register("guess_number_told", "environments.guess_number:GuessNumber", hint="told")
register("frozen_lake", "environments.frozen_lake:FrozenLake")
register("python_tool", "environments.python_tool:PythonTool")
register("locker", "environments.locker:Locker")
register("judged_digit", "environments.judged:JudgedDigit")
register_family("reasoning_gym", "environments.reasoning_gym:ReasoningGym")
register("shapes", "environments.shapes:Shapes")

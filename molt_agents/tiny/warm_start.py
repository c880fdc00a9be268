"""The data of the tiny chat, agent and vision-language models' warm starts, which `molt-sft` trains on.

A randomly initialised model almost never ends its turn or answers briefly,
so RL from it has nothing to reinforce. The warm start teaches one habit, on
prompts from the tokenizer corpus: the assistant answers with a single random
digit and ends the turn. The digit is independent of the prompt, so no task
is learned here; a task's mapping is left to RL.

The chat model learns a second format beside it: a line that offers words
("Is it red or blue?", "up, down or left") is answered with one of the
offered words, drawn at random (`_choice_turn`), and a line without "or" with
a digit. The offered words come from `ANSWER_WORDS`, two dozen common ones
that are each one token after a space, few enough for the 64-wide model to
learn to copy; the reply is that token (" red"). So a task that asks a
question and offers its answers ("Is 7 even? Answer yes or no.") starts at
chance among them, and RL learns the mapping, while the digit tasks start
where they did: the reply's kind follows the line, its content never does.

The digit habit also teaches a model to ignore what it reads, images included: a
vision-language model warm-started on text alone gives the same answer for
every picture (its digit probabilities move by about 1e-4 between pictures),
and RL then has no gradient toward using the image. So half the
vision-language conversations are an alignment pretext, as LLaVA's first
stage aligns its projector on captions: a picture, either filled with one of
ten colours or with that colour in some cells of a 2x2 grid on a dark
background, and a colour question whose answer is the colour's index. It
teaches the model to look, not any task's mapping (no bundled task asks for
colours).

Half of those picture turns ask something else and get a random digit, as
the text turns do. Without them the colour answer carries over to every
question about a picture: on `shapes` the tiny VLM then answered with the
colour indices nearest the shapes' colours, gave the right counts 1 and 2
about 1% of the time, and RL settled on answering 3 (about 0.55 reward after
150 steps). With them, other questions start near uniform over the digits
but still depend on the picture, and RL can find the mapping.

The agent model's warm start teaches general tool use on random tools and
random words (`_agent_conversation`): call a tool with the digit the user's
line holds, and answer with the digit the tool's reply holds. It is those
conversations alone, without the text turns: their random-digit targets keep
a 2-layer model from learning to copy the tool's digit, and undo the copy
once learned. What a task asks of its tool, and which part of the reply it
wants, is left to RL.

`records(kind, count, seed)` gives molt-sft's chat records (`messages`,
`tools`; pictures as PNG data: URLs), and `WARM_START` how long each kind
trains on them (the builder runs molt-sft, `build.py`).
"""

from __future__ import annotations

import base64
import io
import random
import re
import string

from molt_agents.tiny.tokenizer import _WORDS, _corpus_lines

PALETTE = [(0, 0, 0), (255, 255, 255), (128, 128, 128), (255, 140, 0), (0, 128, 128),
           (128, 0, 0), (0, 0, 128), (128, 128, 0), (255, 192, 203), (0, 255, 255)]

# Per kind, molt-sft's steps; each step is BATCH conversations, each conversation trained once.
WARM_START = {"chat": 1000, "agent": 600, "vlm": 300}
BATCH = 32
LR = 3e-3


def records(kind: str, count: int, seed: int = 0) -> list[dict]:
    """`count` chat records of `kind`'s warm start: a corpus line and a digit (chat); half of them a picture
    and a colour's index or a digit (vlm); conversations of several turns and tool calls (agent)."""
    rng = random.Random(seed)
    # Prompts without digits: the model learns the reply format, not to ignore digits it reads.
    prompts = [line for line in _corpus_lines(seed + 1, 4000)
               if "\n" not in line and not any(c.isdigit() for c in line)][:1000]
    if kind == "chat":  # a digit answers lines without "or", the cue of a choice (`_choice_turn`)
        prompts = [line for line in prompts if not re.search(r"\bor\b", line, re.IGNORECASE)]
    out = []
    for i in range(count):
        if kind == "agent":
            messages, tools = _agent_conversation(rng, prompts)
            out.append({"messages": messages, **({"tools": tools} if tools else {})})
        elif kind == "vlm" and i % 2:
            out.append({"messages": _picture_turn(rng, prompts)})
        elif kind == "chat" and rng.random() < CHOICES:
            out.append({"messages": _choice_turn(rng)})
        else:
            out.append({"messages": [{"role": "user", "content": rng.choice(prompts)},
                                     {"role": "assistant", "content": str(rng.randrange(10))}]})
    return out


# --------------------------------------------------------------------------
# Choices: a line that offers words ("red or blue", "up, down or left") is answered with one of them

CHOICES = 1 / 2
CHOICE_WORDS = [word for word in _WORDS if word != "or"]
# The words a choice offers: few enough for a 64-wide model to copy (one token each, after a space).
ANSWER_WORDS = ("yes no true false left right up down red green blue small large higher lower correct wrong "
                "good bad first second third next last").split()


def _choice_turn(rng: random.Random) -> list[dict]:
    """A line of random words that offers two or three others and one of those, at random, as the reply
    (after a space: the word's own token, as the line holds it). The reply's kind follows the line, never
    its content."""
    options = rng.sample(ANSWER_WORDS, rng.choice((2, 2, 3)))
    offer = " or ".join(options) if len(options) == 2 else f"{options[0]}, {options[1]} or {options[2]}"
    before, after = _words(rng, 0, 6, CHOICE_WORDS), _words(rng, 0, 3, CHOICE_WORDS)
    line = " ".join(part for part in (before, offer, after) if part)
    line = line[0].upper() + line[1:] + rng.choice("?.")
    return [{"role": "user", "content": line}, {"role": "assistant", "content": " " + rng.choice(options)}]


# --------------------------------------------------------------------------
# Agent conversations: the reply format of every turn, and general tool use

TOOL_NAMES = ["lookup", "search", "fetch", "read", "query", "get_value"]
ARGUMENT_NAMES = ["id", "key", "index", "n", "item", "slot"]


def _agent_conversation(rng: random.Random, prompts: list[str]) -> tuple[list[dict], list[dict] | None]:
    """A conversation whose assistant turns are each a digit or a tool call: general tool use.

    A third are 1-4 turns of chat: the later user turns are corpus lines or a few words ("higher", "try
    again"...), so a digit follows any user turn. The rest offer a tool with one integer argument, named
    from short lists of common names (`TOOL_NAMES`, `ARGUMENT_NAMES`: the tiny model learns to copy a
    name it knows from the signature, not to spell an unseen one), with a description of random words,
    and a user line (`_user_line`: a statement or a question) that holds a digit three times in four.
    Three times in four the assistant calls the tool: with the line's digit when it holds one (an
    argument taken from the user's message), else with a digit of its own; the tool replies with a line
    of random words that holds one digit (or the bare digit), and the assistant answers that digit (an
    answer taken from what the tool returned). Without a call it answers a random digit. No line is a
    task's question, tool or reply: what to ask a task's tool and which part of its reply to report is
    left to RL."""
    if rng.random() < 1 / 3:
        messages = []
        for turn in range(rng.randint(1, 4)):
            line = _user_line(rng, prompts) if turn == 0 or rng.random() < 0.5 else _words(rng, 1, 3)
            messages += [{"role": "user", "content": line},
                         {"role": "assistant", "content": str(rng.randrange(10))}]
        return messages, None
    name, argument = rng.choice(TOOL_NAMES), rng.choice(ARGUMENT_NAMES)
    tools = [{"type": "function", "function": {
        "name": name, "description": _words(rng, 3, 8).capitalize() + ".",
        "parameters": {"type": "object", "properties": {argument: {"type": "integer"}}, "required": [argument]}}}]
    asked = rng.randrange(10) if rng.random() < 0.75 else None
    messages = [{"role": "user", "content": _user_line(rng, prompts, asked)}]
    if rng.random() >= 0.75:
        return messages + [{"role": "assistant", "content": str(rng.randrange(10))}], tools
    call = {"type": "function", "function": {"name": name, "arguments": {
        argument: rng.randrange(10) if asked is None else asked}}}
    returned = rng.randrange(10)
    reply = str(returned) if rng.random() < 0.25 else _insert(rng, _words(rng, 1, 6), returned) + "."
    messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": reply},
                 {"role": "assistant", "content": str(returned)}]
    return messages, tools


QUESTION_WORDS = ["What", "Which", "Where", "Who", "How", "Why", "When", "Is", "Can", "Do"]


def _user_line(rng: random.Random, prompts: list[str], digit: int | None = None) -> str:
    """A corpus line, or a question of random words; a third of them with a capital letter among the words
    (a name, a label), and `digit`, when given, put between two of its words."""
    if rng.random() < 0.5:
        line, end = rng.choice(prompts).rstrip("."), "."
    else:
        line, end = f"{rng.choice(QUESTION_WORDS)} {_words(rng, 2, 7)}", "?"
    if rng.random() < 1 / 3:
        line = _insert(rng, line, rng.choice(string.ascii_uppercase))
    return (line if digit is None else _insert(rng, line, digit)) + end


def _words(rng: random.Random, least: int, most: int, vocabulary: list[str] = _WORDS) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(least, most)))


def _insert(rng: random.Random, line: str, word) -> str:
    """`line` with `word` (a digit, a letter) put between two of its words (or at either end)."""
    words = line.split()
    words.insert(rng.randint(0, len(words)), str(word))
    return " ".join(words)


QUESTIONS = ["What colour is this?", "Which colour do you see?", "Name the colour.", "Colour?"]


def _pretext_picture(rng: random.Random):
    """A picture and its colour's index: one colour filling the picture, or (half the time) filling
    some cells of a 2x2 grid on a dark background, so the model learns to look for what stands out."""
    from PIL import Image, ImageDraw

    colour = rng.randrange(len(PALETTE))
    if rng.random() < 0.5:
        return Image.new("RGB", (32, 32), PALETTE[colour]), colour
    colour = rng.randrange(1, len(PALETTE))  # not black, on the dark background
    image = Image.new("RGB", (32, 32), (20, 20, 28))
    pen = ImageDraw.Draw(image)
    for cell in rng.sample(range(4), rng.randint(1, 4)):
        x, y = cell % 2 * 16, cell // 2 * 16
        pen.rectangle([x, y, x + 15, y + 15], fill=PALETTE[colour])
    return image, colour


def _picture_turn(rng: random.Random, prompts: list[str]) -> list[dict]:
    """A picture with a colour question and the colour's index, or (half the time) another question and a
    random digit."""
    image, colour = _pretext_picture(rng)
    question = rng.choice(QUESTIONS)
    if rng.random() < 0.5:  # another question about a picture: the reply format only
        question, colour = rng.choice(prompts), rng.randrange(10)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]},
            {"role": "assistant", "content": str(colour)}]

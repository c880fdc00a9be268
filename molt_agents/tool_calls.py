"""Parse tool calls out of a reply in the chat template's format.

The tiny models (and Qwen / Hermes-style templates) write each call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. A reply whose
tool-call blocks do not all parse is returned as plain content: a malformed
call is the policy's mistake to learn from, not the server's to repair.
"""

from __future__ import annotations

import json
import re
import uuid

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_reply(text: str) -> tuple[str | None, list[dict]]:
    """Split a reply into `(content, tool_calls)` in OpenAI message form."""
    matches = list(_TOOL_CALL.finditer(text))
    if not matches:
        return text, []
    calls = []
    for match in matches:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)},
        })
    content = text[: matches[0].start()].rstrip("\n")
    return content or None, calls

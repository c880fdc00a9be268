"""In-distribution copy accuracy: P(answer digit == tool's returned digit) on warm-start conversations, and on locker's shape."""
import sys, random, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from molt_agents.chat_template import render_text
from molt_agents.tiny.tokenizer import _corpus_lines
from molt_agents.tiny.warm_start import _agent_conversation
from environments.locker import Locker
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d); model = AutoModelForCausalLM.from_pretrained(d).eval()
prompts = [l for l in _corpus_lines(99, 4000) if "\n" not in l and not any(c.isdigit() for c in l)][:1000]
rng = random.Random(123)
digits = [tok.convert_tokens_to_ids(str(i)) for i in range(10)]
def p_of(messages, tools, want):
    text = render_text(tok, messages, tools, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad(): logits = model(ids).logits[0, -1]
    p = torch.softmax(logits, -1)
    return float(p[digits[want]]), float(p[digits].sum())
acc, mass, n = 0, 0, 0
while n < 200:
    msgs, tools = _agent_conversation(rng, prompts)
    if not any(m.get("tool_calls") for m in msgs): continue
    pw, pm = p_of(msgs[:-1], tools, int(msgs[-1]["content"])); acc += pw; mass += pm; n += 1
print(f"warm-start shape: p(copy) {acc/n:.3f}, p(any digit) {mass/n:.3f}")
acc, n = 0, 0
for i in range(200):
    env = Locker(); p, info = env.reset(seed=i)
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"id": info["locker"]}}}
    msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": f"It holds {info['answer']}."}]
    pw, _ = p_of(msgs, env.tools, info["answer"]); acc += pw; n += 1
print(f"locker shape: p(copy) {acc/n:.3f}")

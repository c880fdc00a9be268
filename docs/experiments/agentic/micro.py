"""Can the tiny agent model learn to answer the tool's digit? Warm start variants, copy accuracy every 250 steps."""
import sys, random, time, torch
from transformers import AutoTokenizer, AutoModelForCausalLM
import molt_agents.tiny.warm_start as ws
from molt_agents.tiny.build import _config, DEFAULTS
from molt_agents.tiny.tokenizer import _corpus_lines
from molt_agents.chat_template import render_text
from environments.locker import Locker
variant = sys.argv[1]; sizes = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained("/tmp/agent-v8")
p = {**DEFAULTS, **sizes}; torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(_config("agent", p, tok), dtype=torch.float32)
prompts = [l for l in _corpus_lines(1, 4000) if "\n" not in l and not any(c.isdigit() for c in l)][:1000]
rng = random.Random(0)
def conv(rng):
    if variant == "mix":
        return ws._agent_conversation(rng, prompts)
    while True:
        m, t = ws._agent_conversation(rng, prompts)
        if len(m) >= 4 and t:
            if variant == "bare": m[-2]["content"] = m[-1]["content"]
            return m, t
digits = [tok.convert_tokens_to_ids(str(i)) for i in range(10)]
def evaluate():
    model.eval(); r = random.Random(7); acc = n = 0
    with torch.no_grad():
        while n < 100:
            m, t = ws._agent_conversation(r, prompts)
            if not t or len(m) < 4: continue
            ids = tok(render_text(tok, m[:-1], t, add_generation_prompt=True), return_tensors="pt", add_special_tokens=False).input_ids
            acc += float(torch.softmax(model(ids).logits[0, -1], -1)[digits[int(m[-1]["content"])]]); n += 1
        lacc = 0
        for i in range(100):
            env = Locker(); q, info = env.reset(seed=i)
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"id": info["locker"]}}}
            m = [{"role": "user", "content": q}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": f"It holds {info['answer']}." if variant != "bare" else str(info["answer"])}]
            ids = tok(render_text(tok, m, env.tools, add_generation_prompt=True), return_tensors="pt", add_special_tokens=False).input_ids
            lacc += float(torch.softmax(model(ids).logits[0, -1], -1)[digits[info["answer"]]])
    model.train(); return acc / n, lacc / 100
opt = torch.optim.AdamW(model.parameters(), lr=3e-3); model.train(); t0 = time.time()
for step in range(1, 3001):
    if (variant == "full" and step % 2 == 0) or (variant == "full4" and step % 4 == 0) or (variant == "seq" and step > 600 and step % 2 == 0):
        rows = ws._text_rows(tok, rng, prompts, 32)
    else:
        rows = [ws._conversation_row(tok, *(ws._agent_conversation(rng, prompts) if variant in ("full", "full4", "seq") else conv(rng))) for _ in range(32)]
    width = max(len(i) for i, _ in rows); pad = tok.pad_token_id
    x = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows]); y = torch.tensor([l + [-100] * (width - len(l)) for _, l in rows])
    a = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    loss = model(input_ids=x, attention_mask=a, labels=y).loss; loss.backward(); opt.step(); opt.zero_grad()
    if step % 250 == 0:
        c, l = evaluate(); print(f"{variant} {sizes} step {step}: loss {loss.item():.3f} p(copy) {c:.3f} locker {l:.3f} ({time.time()-t0:.0f} s)", flush=True)

import sys, torch, collections
from transformers import AutoModelForCausalLM, AutoTokenizer
from molt_agents.chat_template import render_text
from molt_agents.tool_calls import parse_reply
from environments.locker import Locker, LETTERS, locker_number
d, tokdir = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(tokdir); model = AutoModelForCausalLM.from_pretrained(d).eval(); torch.manual_seed(0)
end = tok.convert_tokens_to_ids("<|im_end|>")
for letter in range(1, 10):
    prompt = f"What is the digit in locker {LETTERS[letter-1]}?"
    ids = tok(render_text(tok, [{"role": "user", "content": prompt}], Locker.tools), return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids.repeat(40, 1), max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0, eos_token_id=end, pad_token_id=tok.pad_token_id)
    c = collections.Counter()
    for row in out:
        calls = parse_reply(tok.decode(row[ids.shape[1]:], skip_special_tokens=True))[1]
        c[locker_number(calls[0]["function"]["arguments"], 9) if calls else "-"] += 1
    print(LETTERS[letter-1], letter, dict(c.most_common(5)))

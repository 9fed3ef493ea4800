"""Drive a live `plumbline serve` with the official `openai` Python client.

Usage: openai_client.py BASE_URL MODEL PROMPT

Prints one JSON object with what the client got back; the Rust test (cli/tests/serve/api.rs)
makes the assertions, so this script only exercises the client and records results.
"""

import json
import sys

import openai

base, model, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
out = {"openai_version": openai.__version__}

# Completions, greedy, and the same streamed.
c = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
out["completion"] = {
    "text": c.choices[0].text,
    "finish_reason": c.choices[0].finish_reason,
    "usage": c.usage.model_dump(),
    "object": c.object,
}
text, finish, n_chunks = "", None, 0
for chunk in client.completions.create(
    model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
):
    n_chunks += 1
    if chunk.choices:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
out["completion_stream"] = {"text": text, "finish_reason": finish, "chunks": n_chunks}

# Stop string: cut the greedy text at a piece of itself.
greedy = out["completion"]["text"]
stop = greedy[3:6] if len(greedy) >= 6 else None
if stop:
    s = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "\u0000never"]
    )
    out["stop"] = {"stop": stop, "text": s.choices[0].text, "finish_reason": s.choices[0].finish_reason}
    st = ""
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
    ):
        if chunk.choices:
            st += chunk.choices[0].text
    out["stop"]["stream_text"] = st

# Seeded sampling.
def sampled(seed):
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed
    )
    return r.choices[0].text

out["seeded"] = {"a": sampled(42), "b": sampled(42), "others": [sampled(s) for s in (43, 44, 45, 46)]}

# Chat, plain and streamed (with usage), and log-probabilities.
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
ch = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
out["chat"] = {
    "content": ch.choices[0].message.content,
    "role": ch.choices[0].message.role,
    "finish_reason": ch.choices[0].finish_reason,
    "usage": ch.usage.model_dump(),
    "object": ch.object,
}
content, roles, finish, usage = "", [], None, None
for chunk in client.chat.completions.create(
    model=model,
    messages=msgs,
    max_tokens=10,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for choice in chunk.choices:
        if choice.delta.role:
            roles.append(choice.delta.role)
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
out["chat_stream"] = {"content": content, "roles": roles, "finish_reason": finish, "usage": usage}

lp = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
)
out["chat_logprobs"] = {
    "content": lp.choices[0].message.content,
    "completion_tokens": lp.usage.completion_tokens,
    "tokens": [
        {"token": t.token, "logprob": t.logprob, "top": [[x.token, x.logprob] for x in t.top_logprobs]}
        for t in lp.choices[0].logprobs.content
    ],
}
clp = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
out["completion_logprobs"] = clp.choices[0].logprobs.model_dump()

# Errors the client raises as typed exceptions.
errors = {}
for name, kwargs in {
    "n2": dict(model=model, prompt=prompt, n=2),
    "unknown_model": dict(model="no-such-model", prompt=prompt),
    "max_tokens0": dict(model=model, prompt=prompt, max_tokens=0),
}.items():
    try:
        client.completions.create(**kwargs)
        errors[name] = {"status": 200}
    except openai.APIStatusError as e:
        errors[name] = {"status": e.status_code, "type": type(e).__name__, "message": e.message}
out["errors"] = errors

out["models"] = [m.id for m in client.models.list().data]
print(json.dumps(out))
